"""The native gRPC front end (``front.cc``): grpc++ owns the gRPC port, answers the common ModelInfer with
Python called once per batch, and passes everything else to the grpcio server on a private Unix socket
(serving/grpc_api/native_port.py runs it; serving/README.md, "The native front end").

Built by ``make install`` (``python -m serving.native.build``) from Debian's grpc++; where it is not built,
or was built from other sources, ``load()`` says why and the server runs on grpcio alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import sysconfig
from pathlib import Path
from types import ModuleType

HERE = Path(__file__).resolve().parent


def load(folder: Path = HERE) -> tuple[ModuleType | None, str]:
    """``(module, "")``, or ``(None, why not)``; ``folder``: where it was built (``build_front``'s)."""
    from serving.native.build import FRONT_MODULE, FRONT_SOURCE, BuildUnavailable, source_key, trusted

    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    module, stamp = folder / f"{FRONT_MODULE}{suffix}", folder / f"{FRONT_MODULE}.key"
    if not module.is_file() or not stamp.is_file():
        return None, "not built (make install, or python -m serving.native.build)"
    if stamp.read_text().strip() != source_key(FRONT_SOURCE):
        return None, "built from other sources or for another Python/numpy: rebuild (python -m serving.native.build)"
    try:
        trusted(module)
        if folder == HERE:
            return importlib.import_module(f"serving.native.{FRONT_MODULE}"), ""
        spec = importlib.util.spec_from_file_location(f"serving.native.{FRONT_MODULE}", module)
        assert spec is not None and spec.loader is not None
        loaded = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(loaded)
        return loaded, ""
    except (BuildUnavailable, ImportError) as exc:
        return None, str(exc)
