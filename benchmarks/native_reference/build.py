"""Build the native reference's front end (``front.cc``) into a Python extension module, once per content.

The module links grpc++ and protobuf from the system (Debian: ``libgrpc++-dev``, ``protobuf-compiler-grpc``;
``libxxhash-dev`` for the request digests, header-only);
PyPI's grpcio ships no C++ headers. The V2 service's C++ code is generated from our
``serving/proto/grpc_service.proto``, so the wire format is the one every other server here speaks. The
result is cached under ``CACHE/native-<hash of the sources, Python, numpy and grpc++ versions>``, so
later runs start at once; a build takes ~40 s on 2 cores.

Where the tools are missing and we may install Debian packages (root, ``apt-get`` present), they are
installed, as the serving benchmark installs its peers; otherwise ``BuildUnavailable`` says what to install.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "front.cc"
PROTO = HERE.parent.parent / "serving" / "proto" / "grpc_service.proto"
MODULE = "native_front"
DEBIAN_PACKAGES = (
    "g++",
    "pkg-config",
    "libgrpc++-dev",
    "libprotobuf-dev",
    "protobuf-compiler",
    "protobuf-compiler-grpc",
    "libxxhash-dev",
)
TOOLS = ("g++", "pkg-config", "protoc", "grpc_cpp_plugin")
LIBRARIES = ("grpc++", "protobuf", "libxxhash")  # pkg-config names; xxhash is used header-only
BUILD_TIMEOUT_S = 600


class BuildUnavailable(RuntimeError):
    """The front end cannot be built here; the message says what is missing."""


def missing() -> list[str]:
    """Tools or libraries the build needs that this machine lacks."""
    lacking = [tool for tool in TOOLS if shutil.which(tool) is None]
    if "pkg-config" not in lacking and run(["pkg-config", "--exists", *LIBRARIES], check=False).returncode:
        lacking.append("grpc++/protobuf/xxhash development files")
    return lacking


def install() -> None:
    """``apt-get install`` the Debian packages, where this process may."""
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        raise BuildUnavailable(f"missing {', '.join(missing())}: apt-get install {' '.join(DEBIAN_PACKAGES)}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for argv in (["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", *DEBIAN_PACKAGES]):
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
        if done.returncode:
            raise BuildUnavailable(f"{' '.join(argv[:2])} failed: {done.stderr.strip()[-400:]}")


def run(argv: list[str], *, check: bool = True, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=BUILD_TIMEOUT_S, check=False)
    if check and done.returncode:
        raise BuildUnavailable(f"{argv[0]} failed ({done.returncode}): {(done.stderr or done.stdout).strip()[-1500:]}")
    return done


def cache_key() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), PROTO.read_bytes()):
        digest.update(part)
    grpc_version = run(["pkg-config", "--modversion", *LIBRARIES]).stdout
    digest.update(f"{sys.version}|{np.__version__}|{grpc_version}".encode())
    return digest.hexdigest()[:16]


def trusted(*paths: Path) -> None:
    """Refuse a cached module someone else could have put there: the cache sits under /tmp by default, and
    importing a planted module runs its code as whoever runs the benchmark."""
    for path in paths:
        info = path.stat()
        if info.st_uid != os.geteuid() or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise BuildUnavailable(
                f"{path} is not owned by this user or is writable by others: remove it and run again"
            )


def build(cache: Path) -> Path:
    """The folder holding the built module (``import native_front`` with it on ``sys.path``)."""
    if missing():
        install()
        if lacking := missing():
            raise BuildUnavailable(f"still missing after apt-get: {', '.join(lacking)}")
    target = cache / f"native-{cache_key()}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if (target / f"{MODULE}{suffix}").is_file():
        trusted(cache, target, target / f"{MODULE}{suffix}")
        return target
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".building-") as scratch:
        out = Path(scratch)
        plugin = shutil.which("grpc_cpp_plugin")
        run(["protoc", f"-I{PROTO.parent}", f"--cpp_out={out}", f"--grpc_out={out}",
             f"--plugin=protoc-gen-grpc={plugin}", PROTO.name], cwd=PROTO.parent)  # fmt: skip
        flags = run(["pkg-config", "--cflags", "--libs", "grpc++", "protobuf"]).stdout.split()
        include = [f"-I{out}", f"-I{sysconfig.get_paths()['include']}", f"-I{np.get_include()}"]
        sources = [str(SOURCE), str(out / "grpc_service.pb.cc"), str(out / "grpc_service.grpc.pb.cc")]
        module = out / f"{MODULE}{suffix}"
        run(["g++", "-O2", "-fPIC", "-shared", "-std=c++17", *include, *sources, *flags, "-o", str(module)])
        staged = cache / f".{target.name}-{os.getpid()}"
        staged.mkdir(mode=0o755)
        shutil.move(str(module), staged / module.name)
        (staged / module.name).chmod(0o755)  # whatever the umask: trusted() checks these bits
        try:
            staged.rename(target)  # atomic: two builds at once leave one complete folder
        except OSError:
            shutil.rmtree(staged, ignore_errors=True)
    trusted(cache, target, target / f"{MODULE}{suffix}")
    return target


if __name__ == "__main__":
    print(build(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.gettempdir()) / "sluicegate-native"))
