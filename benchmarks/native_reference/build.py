"""Build the native reference's front end (``front.cc``) into a Python extension module, once per content.

The tools, the protocol code and the compile are the server's own (serving/native/build.py); the result is
cached under ``CACHE/native-<hash of the sources, Python, numpy and grpc++ versions>``, so later runs start
at once. Where the tools are missing and we may install Debian packages (root, ``apt-get`` present), they
are installed, as the serving benchmark installs its peers; otherwise ``BuildUnavailable`` says what to
install.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import sysconfig
import tempfile
from pathlib import Path

from serving.native.build import (
    LIBRARIES,
    BuildUnavailable,
    compile_module,
    ensure_tools,
    run,
    source_key,
    trusted,
)

__all__ = ["BuildUnavailable", "build"]

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "front.cc"
MODULE = "native_front"


def cache_key() -> str:
    grpc_version = run(["pkg-config", "--modversion", *LIBRARIES]).stdout
    return hashlib.sha256(f"{source_key(SOURCE)}|{grpc_version}".encode()).hexdigest()[:16]


def build(cache: Path) -> Path:
    """The folder holding the built module (``import native_front`` with it on ``sys.path``)."""
    ensure_tools()
    target = cache / f"native-{cache_key()}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    if (target / f"{MODULE}{suffix}").is_file():
        trusted(cache, target, target / f"{MODULE}{suffix}")
        return target
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache, prefix=".building-") as scratch:
        module = compile_module(SOURCE, MODULE, Path(scratch))
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
