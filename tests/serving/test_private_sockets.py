"""The native front end's private socket folders: a server killed outright cannot remove its own, so the
next server to start removes those nobody listens on, and nothing else."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from serving.grpc_api.native_port import PRIVATE_PREFIX, STALE_AFTER_S, remove_stale_folders
from serving.native import load
from tests.serving.process import ServerProcess

OLD = time.time() - 2 * STALE_AFTER_S


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A temp dir with a short path: a Unix socket's path has 107 bytes at most, and pytest's tmp_path for
    a long test name takes most of them."""
    folder = Path(tempfile.mkdtemp(prefix="sg-", dir="/tmp"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def folder_with_socket(root: Path, name: str, *, listening: bool, age: float = OLD) -> tuple[Path, socket.socket]:
    folder = root / (PRIVATE_PREFIX + name)
    folder.mkdir(mode=0o700)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(folder / "grpc.sock"))
    if listening:
        server.listen()
    else:
        server.close()  # the file stays, as after SIGKILL; connecting is refused
    os.utime(folder, (age, age))
    return folder, server


def test_only_old_folders_of_gone_servers_are_removed(short_tmp: Path) -> None:
    live, listener = folder_with_socket(short_tmp, "live", listening=True)
    dead, _ = folder_with_socket(short_tmp, "dead", listening=False)
    young, _ = folder_with_socket(short_tmp, "young", listening=False, age=time.time())
    empty = short_tmp / (PRIVATE_PREFIX + "empty")  # killed between mkdtemp and binding
    empty.mkdir()
    os.utime(empty, (OLD, OLD))
    other = short_tmp / "someone-else-dead"
    other.mkdir()
    os.utime(other, (OLD, OLD))
    try:
        removed = remove_stale_folders(short_tmp)
    finally:
        listener.close()

    assert sorted(removed) == sorted([dead, empty])
    assert not dead.exists() and not empty.exists()
    assert live.exists() and young.exists() and other.exists()


def test_a_stray_file_or_link_with_the_prefix_is_left_alone(short_tmp: Path) -> None:
    target = short_tmp / "target"
    target.mkdir()
    (short_tmp / (PRIVATE_PREFIX + "file")).write_text("not ours to judge")
    link = short_tmp / (PRIVATE_PREFIX + "link")
    link.symlink_to(target)
    for path in (short_tmp / (PRIVATE_PREFIX + "file"), link):
        os.utime(path, (OLD, OLD), follow_symlinks=False)

    assert remove_stale_folders(short_tmp) == []
    assert target.exists() and link.is_symlink()


def test_a_killed_servers_folder_is_removed_by_the_next_server(repo: Path, tmp_path: Path, short_tmp: Path) -> None:
    assert load()[0] is not None, "make test builds serving/native; the servers must use it"
    env = {"TMPDIR": str(short_tmp)}  # tempfile.gettempdir() of the servers
    first = ServerProcess(repo, tmp_path, env={"SHUTDOWN_DELAY_S": "0"}, environ=env)
    (left,) = short_tmp.glob(PRIVATE_PREFIX + "*")
    first.stop()  # SIGKILL: no chance to clean up
    assert left.exists()
    os.utime(left, (OLD, OLD))

    second = ServerProcess(repo, tmp_path, env={"SHUTDOWN_DELAY_S": "0"}, environ=env)
    try:
        (own,) = short_tmp.glob(PRIVATE_PREFIX + "*")  # the second server's own, live folder only
        assert own != left and not left.exists()
        assert "removed 1 private socket folder(s) of servers that are gone" in second.log_text()
        os.utime(own, (OLD, OLD))
        assert remove_stale_folders(short_tmp) == []  # a live server's folder stays, however old
    finally:
        second.stop()
