"""Build a C++ extension module that speaks our V2 protocol through grpc++: the server's native front end
(``serving/native/front.cc``, built into this folder by ``make install``) and the serving benchmark's
native reference (benchmarks/native_reference, cached outside the repository).

The module links grpc++ and protobuf from the system (Debian: ``libgrpc++-dev``, ``protobuf-compiler-grpc``;
``libxxhash-dev`` for the request digests, header-only, ``digest.c`` built once per instruction set);
PyPI's grpcio ships no C++ headers. The V2 messages' C++ code is generated from
``serving/proto/grpc_service.proto``, so the wire format is the one the grpcio server speaks. A build takes
~40 s on 2 cores.

Where the tools are missing and we may install Debian packages (root, ``apt-get`` present), they are
installed; otherwise ``BuildUnavailable`` says what to install.

    python -m serving.native.build          # the server's front end, into serving/native/
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import stat
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import grpc

from serving.errors import ServingError

HERE = Path(__file__).resolve().parent
PROTO = HERE.parent / "proto" / "grpc_service.proto"
FRONT_SOURCE = HERE / "front.cc"
DIGEST_SOURCE = HERE / "digest.c"
FRONT_MODULE = "_front"
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


class BuildUnavailable(ServingError):
    """The module cannot be built (or loaded) here; the message says what is missing."""

    code = grpc.StatusCode.FAILED_PRECONDITION


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


def source_key(source: Path) -> str:
    """What the built module depends on that can change under it without a new grpc++: the sources, the
    protocol, the Python and numpy it was built for."""
    import numpy as np

    digest = hashlib.sha256()
    for part in (source.read_bytes(), PROTO.read_bytes(), (HERE / "digest.h").read_bytes(), DIGEST_SOURCE.read_bytes()):
        digest.update(part)
    digest.update(f"{sys.version}|{np.__version__}".encode())
    return digest.hexdigest()[:16]


def trusted(*paths: Path) -> None:
    """Refuse a module someone else could have put there: importing a planted module runs its code. Owned
    by this user or by root (an image built as root, run as an unprivileged user), writable by no one else."""
    for path in paths:
        info = path.stat()
        if info.st_uid not in (os.geteuid(), 0) or info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise BuildUnavailable(
                f"{path} is not owned by this user or is writable by others: remove it and run again"
            )


def ensure_tools() -> None:
    if missing():
        install()
        if lacking := missing():
            raise BuildUnavailable(f"still missing after apt-get: {', '.join(lacking)}")


def compile_module(source: Path, module: str, out: Path) -> Path:
    """Generate the V2 messages' C++ code and compile ``source`` with it into ``out/<module><suffix>``."""
    import numpy as np

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    plugin = shutil.which("grpc_cpp_plugin")
    run(["protoc", f"-I{PROTO.parent}", f"--cpp_out={out}", f"--grpc_out={out}",
         f"--plugin=protoc-gen-grpc={plugin}", PROTO.name], cwd=PROTO.parent)  # fmt: skip
    flags = run(["pkg-config", "--cflags", "--libs", "grpc++", "protobuf"]).stdout.split()
    include = [f"-I{out}", f"-I{HERE}", f"-I{sysconfig.get_paths()['include']}", f"-I{np.get_include()}"]
    sources = [str(source), str(out / "grpc_service.pb.cc"), str(out / "grpc_service.grpc.pb.cc")]
    target = out / f"{module}{suffix}"
    objects = digest_objects(out)
    run(["g++", "-O2", "-fPIC", "-shared", "-std=c++17", *include, *sources, *objects, *flags, "-o", str(target)])
    return target


def digest_objects(out: Path) -> list[str]:
    """``digest.c`` compiled once per instruction set ``digest.h`` chooses from at run time: the platform's
    baseline, and on x86-64 also AVX2 and AVX-512 (three times faster than SSE2 for a request's input)."""
    variants: list[tuple[str, list[str]]] = [("base", [])]
    if platform.machine().lower() in ("x86_64", "amd64"):
        variants += [("avx2", ["-mavx2"]), ("avx512", ["-mavx512f"])]
    objects = []
    for name, extra in variants:
        obj = out / f"digest_{name}.o"
        run(["g++", "-x", "c", "-std=c11", "-O2", "-fPIC", *extra, f"-DDIGEST_NAME=sluicegate_xxh3_128_{name}",
             "-c", str(DIGEST_SOURCE), "-o", str(obj)])  # fmt: skip
        objects.append(str(obj))
    return objects


def build_front(folder: Path = HERE) -> Path:
    """Build the server's front end into ``folder`` unless the one there matches its sources; the module's
    path. A stamp file beside it holds ``source_key``, which serving/native/__init__.py compares before
    importing, so a stale module is never loaded."""
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    target, stamp = folder / f"{FRONT_MODULE}{suffix}", folder / f"{FRONT_MODULE}.key"
    key = source_key(FRONT_SOURCE)
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == key:
        return target
    ensure_tools()
    with tempfile.TemporaryDirectory(prefix="sluicegate-front-") as scratch:
        built = compile_module(FRONT_SOURCE, FRONT_MODULE, Path(scratch))
        staged = folder / f".{target.name}.{os.getpid()}"
        shutil.copyfile(built, staged)
        staged.chmod(0o755)
        staged.replace(target)  # atomic: a server starting meanwhile imports the old module or the new one
    stamp.write_text(key + "\n")
    return target


if __name__ == "__main__":
    try:
        sys.stdout.write(f"{build_front()}\n")
    except BuildUnavailable as exc:
        sys.stderr.write(f"native front end not built ({exc}); the server uses grpcio only\n")
        sys.exit(0 if "--optional" in sys.argv else 1)
