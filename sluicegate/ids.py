"""Version identities (DESIGN section 4): data version, code version, model version, environment.

A model version is ``v{MAJOR}.{MINOR}.{PATCH}-{commit7}-{data7}``: a semantic version alone cannot
tell two datasets (or two commits) apart.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import platform
import re
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluicegate.errors import ConfigError

SHORT = 7
_MODEL_VERSION = re.compile(
    r"^v(?P<major>0|[1-9]\d*)\.(?P<minor>0|[1-9]\d*)\.(?P<patch>0|[1-9]\d*)"
    r"-(?P<commit>[0-9a-f]{7})-(?P<data>[0-9a-f]{7})$"
)


@dataclass(frozen=True)
class CodeVersion:
    """The git commit the code ran from; ``dirty`` when the work tree had uncommitted changes."""

    commit: str
    dirty: bool

    @property
    def short(self) -> str:
        return self.commit[:SHORT]


@dataclass(frozen=True)
class ModelVersionId:
    """The name of a model version, ``vX.Y.Z-<commit7>-<data7>`` (the metadata store's row for one is
    ``sluicegate.metadata.models.ModelVersion``)."""

    major: int
    minor: int
    patch: int
    commit7: str
    data7: str

    def __str__(self) -> str:
        return f"v{self.major}.{self.minor}.{self.patch}-{self.commit7}-{self.data7}"

    @classmethod
    def parse(cls, text: str) -> ModelVersionId:
        match = _MODEL_VERSION.match(text)
        if match is None:
            raise ConfigError(
                f"model version {text!r} is not of the form vMAJOR.MINOR.PATCH-<commit7>-<data7> "
                "(e.g. v1.2.0-3f2a1bc-9d0e4f1)"
            )
        return cls(int(match["major"]), int(match["minor"]), int(match["patch"]), match["commit"], match["data"])


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def data_version(manifest: bytes) -> str:
    """The data version of a dataset: sha256 of its manifest's bytes (full hex)."""
    return sha256_bytes(manifest)


def object_versions_digest(objects: Mapping[str, Mapping[str, Any]]) -> str:
    """A digest of the S3 object versions a manifest resolved to, order-independent.

    Two uploads of the same manifest over different image bytes share a data version but not this
    digest; lineage keeps both.
    """
    digest = hashlib.sha256()
    for path in sorted(objects):
        meta = objects[path]
        digest.update(f"{path}\0{meta.get('version_id') or ''}\0{meta.get('etag') or ''}\n".encode())
    return digest.hexdigest()


def code_version(repo: Path | None = None, baked: str | None = None) -> CodeVersion:
    """The git commit of the working tree at ``repo`` (default: this package's checkout).

    Outside a git checkout (an installed wheel, a container image) the commit is ``baked`` (the
    ``code_commit`` setting, set at image build) or "unknown".
    """
    if baked:
        return CodeVersion(commit=baked, dirty=False)
    where = repo or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "HEAD"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        status = subprocess.run(
            ["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return CodeVersion(commit="unknown", dirty=False)
    return CodeVersion(commit=commit, dirty=bool(status.strip()))


def parse_semver(text: str, field: str = "model.semver") -> tuple[int, int, int]:
    """``MAJOR.MINOR.PATCH`` as three integers; the error names the setting and the form it wants."""
    parts = text.split(".")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        raise ConfigError(f"{field}: {text!r} is not MAJOR.MINOR.PATCH (three whole numbers, e.g. 1.0.0)")
    major, minor, patch = (int(part) for part in parts)
    return major, minor, patch


def model_version(semver: tuple[int, int, int], code: CodeVersion, data: str) -> ModelVersionId:
    commit7 = code.short if code.commit != "unknown" else "0000000"
    return ModelVersionId(*semver, commit7=commit7, data7=data[:SHORT])


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _gpu_facts() -> dict[str, Any]:
    """CUDA driver and GPU identity through NVML; empty on a machine without a GPU."""
    try:
        import pynvml  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return {}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:  # NVMLError_LibraryNotFound without a driver: no GPU here (FACTS.md)
        return {}
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            gpus.append({"name": pynvml.nvmlDeviceGetName(handle), "uuid": pynvml.nvmlDeviceGetUUID(handle)})
        return {"driver": pynvml.nvmlSystemGetDriverVersion(), "gpus": gpus}
    finally:
        pynvml.nvmlShutdown()


def environment() -> dict[str, Any]:
    """What a model was built with: interpreter, ML libraries, CUDA, driver and GPU identity.

    Reads package metadata instead of importing torch or TensorRT, so it is cheap in any process.
    """
    env: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
    }
    for dist in ("torch", "onnx", "onnxruntime", "onnxruntime-gpu", "tensorrt", "numpy", "sluicegate"):
        version = _dist_version(dist)
        if version is not None:
            env[dist] = version
    if "torch" in env:
        # torch's wheel tag says which CUDA it was built for (e.g. 2.13.0+cpu, 2.13.0+cu128).
        local = env["torch"].partition("+")[2]
        env["torch_cuda"] = local if local.startswith("cu") else None
    env.update(_gpu_facts())
    return env
