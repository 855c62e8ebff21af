"""The peers' one-time setup: run the harness's script when a piece is missing, name its log when it fails."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.peers import default_root, ensure_peers, missing

FILLS_ROOT = """#!/usr/bin/env bash
set -e
echo "installing into $PB_ROOT"
mkdir -p "$PB_ROOT/venv-kserve/bin" "$PB_ROOT/venv-pytriton/bin" "$PB_ROOT/models"
touch "$PB_ROOT/venv-kserve/bin/python" "$PB_ROOT/venv-pytriton/bin/python" "$PB_ROOT/models/models.json"
echo "$PB_ROOT" >> "$(dirname "$0")/runs"
"""


def harness(tmp_path: Path, script: str) -> Path:
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "setup_venvs.sh").write_text(script)
    return bench


def test_a_missing_root_is_set_up_once(tmp_path: Path) -> None:
    bench, root = harness(tmp_path, FILLS_ROOT), tmp_path / "cache" / "peerbench"

    ensure_peers(bench, root)
    ensure_peers(bench, root)  # complete now: nothing to run

    assert missing(root) == []
    assert (bench / "runs").read_text().splitlines() == [str(root)]
    assert "installing into" in (root / "setup.log").read_text()


def test_a_failed_setup_names_its_log(tmp_path: Path) -> None:
    bench = harness(tmp_path, "echo 'pip: no matching distribution for kserve==0.21.0'\nexit 3\n")
    root = tmp_path / "peerbench"

    with pytest.raises(SystemExit, match=r"setup_venvs.sh exited 3(.|\n)*setup.log(.|\n)*no matching distribution"):
        ensure_peers(bench, root)


def test_the_root_comes_from_our_variable_then_the_harness_one() -> None:
    assert default_root({"SLUICEGATE_BENCH_PEER_ROOT": "/a", "PB_ROOT": "/b"}) == Path("/a")
    assert default_root({"PB_ROOT": "/b"}) == Path("/b")
    assert default_root({}) == Path("/tmp/peerbench")
