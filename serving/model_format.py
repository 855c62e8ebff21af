"""The serving model repository format (DESIGN section 6), laid out like Triton's.

``<repo>/<model>/<version>/`` holds the model files (``model.onnx``, ``model.plan``, ``rules.json``, a
safetensors checkpoint ...), ``config.json`` (inputs, outputs, labels, preprocessing, batching, drift
baseline, lineage) and ``SHA256SUMS`` in sha256sum format covering every other file. A version is written
once, atomically, and verified before anything loads it. Pickles are refused: loading one runs code.

The format lives in ``serving/`` because the server reads it and may import nothing from the pipeline;
the pipeline writes it through this module too (``serving/`` may not import ``tasks/``; the reverse is allowed).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from serving.errors import RepositoryError
from serving.preprocessing import COLOUR_CHANNELS

CONFIG = "config.json"
SUMS = "SHA256SUMS"
CONFIG_FORMAT = 1
# platform -> the file it loads; ``rules`` is the conservative last resort of the fallback chain.
PLATFORMS = {"onnxruntime": "model.onnx", "tensorrt": "model.plan", "rules": "rules.json"}
DEFAULT_BATCHING: dict[str, int] = {"max_batch_size": 64, "max_queue_delay_us": 0, "max_queue_size": 256}
PICKLE_SUFFIXES = frozenset({".pkl", ".pickle", ".pt", ".pth", ".ckpt", ".joblib"})
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]*$")
_SUM_LINE = re.compile(r"^(?P<hex>[0-9a-f]{64}) [ *](?P<name>.+)$")
_CHUNK = 1 << 20  # 1 MiB: large enough to hash at disk speed, small enough not to hold a model in memory


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with path.open("rb") as handle:
        while block := handle.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


@dataclass(frozen=True)
class ModelConfig:
    """``config.json`` of one model version.

    ``inputs``/``outputs`` follow the KServe V2 / Triton metadata: ``{"name", "datatype", "shape"}`` with
    ``-1`` for the batch axis. ``lineage`` holds free-form strings (data_version, code_version,
    model_version, mlflow_run_id ...).
    """

    name: str
    version: str
    platform: str
    inputs: list[dict[str, Any]]
    outputs: list[dict[str, Any]]
    labels: list[str]
    preprocessing: dict[str, Any]
    batching: dict[str, Any] = field(default_factory=lambda: dict(DEFAULT_BATCHING))
    drift_baseline: dict[str, Any] = field(default_factory=dict)
    lineage: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for attr in ("name", "version"):
            value = getattr(self, attr)
            if not isinstance(value, str) or not _NAME.match(value):
                raise RepositoryError(
                    f"ModelConfig.{attr} {value!r} must be a non-empty path-safe name (letters, digits, . _ + -)"
                )
        if self.platform not in PLATFORMS:
            raise RepositoryError(f"ModelConfig.platform {self.platform!r} must be one of {sorted(PLATFORMS)}")
        for attr in ("inputs", "outputs"):
            tensors = getattr(self, attr)
            if not tensors:
                raise RepositoryError(f"ModelConfig.{attr} is empty: describe at least one tensor")
            for tensor in tensors:
                if not {"name", "datatype", "shape"} <= set(tensor):
                    raise RepositoryError(f"ModelConfig.{attr} entry {tensor!r} needs name, datatype and shape")
        unknown = set(self.batching) - set(DEFAULT_BATCHING)
        if unknown:
            raise RepositoryError(
                f"ModelConfig.batching: unknown keys {sorted(unknown)}; known: {sorted(DEFAULT_BATCHING)}"
            )
        self._check_image_channels()

    def _check_image_channels(self) -> None:
        """The preprocessing's colour and the NCHW input it feeds agree on the channel count.

        ``serving.preprocessing.preprocess`` makes ``(N, 1, H, W)`` for colour "L" and ``(N, 3, H, W)``
        for "RGB"/"BGR"; a version whose 4-D FP32 inputs all take another count could be published but
        never fed (or, for drift, never watched). Configs that name no known colour are not checked.
        """
        colour = self.preprocessing.get("colour") if isinstance(self.preprocessing, Mapping) else None
        if not isinstance(colour, str) or colour not in COLOUR_CHANNELS:
            return
        want = COLOUR_CHANNELS[colour]
        images = [t for t in self.inputs if t["datatype"] == "FP32" and len(t["shape"]) == 4]
        if not images or any(str(t["shape"][1]) in (str(want), "-1") for t in images):
            return
        first = images[0]
        raise RepositoryError(
            f"ModelConfig.inputs: preprocessing colour {colour!r} makes (N, {want}, H, W) tensors, but no 4-D "
            f"FP32 input takes {want} channel(s) (input {first['name']!r} has shape {list(first['shape'])}): "
            f"declare the image input as [-1, {want}, H, W], or set preprocessing.colour to the model's"
        )

    @property
    def model_file(self) -> str:
        """The file the platform loads (``model.onnx``, ``model.plan`` or ``rules.json``)."""
        return PLATFORMS[self.platform]

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": CONFIG_FORMAT,
            "name": self.name,
            "version": self.version,
            "platform": self.platform,
            "inputs": self.inputs,
            "outputs": self.outputs,
            "labels": self.labels,
            "preprocessing": self.preprocessing,
            "batching": {**DEFAULT_BATCHING, **self.batching},
            "drift_baseline": self.drift_baseline,
            "lineage": self.lineage,
        }

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        if raw.get("format") != CONFIG_FORMAT:
            raise RepositoryError(
                f"config format {raw.get('format')!r} is not {CONFIG_FORMAT}: this code cannot read it; "
                "re-export the version with this release"
            )
        known = {"format", "name", "version", "platform", "inputs", "outputs", "labels", "preprocessing"}
        known |= {"batching", "drift_baseline", "lineage"}
        missing = {"name", "version", "platform", "inputs", "outputs", "labels", "preprocessing"} - set(raw)
        unknown = set(raw) - known
        if missing or unknown:
            raise RepositoryError(f"config.json: missing keys {sorted(missing)}, unknown keys {sorted(unknown)}")
        values = {key: raw[key] for key in known - {"format"} if key in raw}
        return cls(**values)

    def to_json(self) -> bytes:
        """Deterministic bytes (sorted keys), so the same config always has the same checksum."""
        return (json.dumps(self.to_dict(), indent=2, sort_keys=True, allow_nan=False) + "\n").encode()


def write_version(repo: Path, config: ModelConfig, files: Mapping[str, Path]) -> Path:
    """Write ``<repo>/<name>/<version>/`` with ``files``, ``config.json`` and ``SHA256SUMS``, atomically.

    The version is assembled in a temporary folder next to it and renamed into place. Writing a version
    that exists with identical content is a no-op; with different content it is refused (versions are
    immutable: publish a new version).

    Args:
        repo: repository root.
        config: the version's config; its platform's model file must be among ``files``.
        files: target file name -> source path (e.g. ``{"model.onnx": p}``).

    Returns:
        The version folder.

    Raises:
        RepositoryError: a bad or reserved file name, a pickle, the platform's model file missing, or the
            version already exists with other content (or is damaged).
    """
    _check_sources(config, files)
    model_dir = repo / config.name
    final = model_dir / config.version
    model_dir.mkdir(parents=True, exist_ok=True)
    staging = model_dir / f".{config.version}.{uuid.uuid4().hex}.partial"
    try:
        staging.mkdir()
        for name, source in sorted(files.items()):
            shutil.copyfile(source, staging / name)
        (staging / CONFIG).write_bytes(config.to_json())
        sums = _sums_text(staging, sorted([*files, CONFIG]))
        (staging / SUMS).write_text(sums)
        _fsync_tree(staging)
        if final.exists():
            return _same_or_refuse(final, sums)
        try:
            staging.rename(final)
        except OSError:
            if final.exists():  # another writer won the race
                return _same_or_refuse(final, sums)
            raise
        _fsync_dir(model_dir)
        return final
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _check_sources(config: ModelConfig, files: Mapping[str, Path]) -> None:
    if config.model_file not in files:
        raise RepositoryError(
            f"platform {config.platform!r} loads {config.model_file}, which is not among the files {sorted(files)}"
        )
    for name, source in files.items():
        if name in (CONFIG, SUMS) or not _NAME.match(name):
            raise RepositoryError(f"file name {name!r} is reserved or not a plain file name: rename it")
        if not Path(source).is_file():
            raise RepositoryError(f"source of {name!r} is not a file: {source}")
        refusal = pickle_refusal(name, Path(source))
        if refusal:
            raise RepositoryError(refusal)


def _same_or_refuse(final: Path, sums: str) -> Path:
    existing = final / SUMS
    if existing.is_file() and existing.read_text() == sums:
        verify_version(final)  # identical sums, and the files still match them
        return final
    raise RepositoryError(
        f"{final} already exists with different content: versions are immutable, publish a new version "
        "(or remove the old folder if it was never served)"
    )


def verify_version(path: Path) -> ModelConfig:
    """Check a version folder before loading it and return its config.

    Every file must be listed in ``SHA256SUMS`` with a matching sum, every listed file must exist, no
    file may be a pickle, and the platform's model file must be present.

    Raises:
        RepositoryError: naming the missing, extra, altered or refused file and the fix.
    """
    if not (path / SUMS).is_file():
        raise RepositoryError(f"{path} has no {SUMS}: it was not written by write_version; re-publish the version")
    present = {p.name for p in path.iterdir() if p.name != SUMS}
    for name in sorted(present):
        refusal = pickle_refusal(name, path / name) if (path / name).is_file() else ""
        if refusal:
            raise RepositoryError(f"{path}: {refusal}")
    listed = _read_sums(path / SUMS)
    missing, extra = sorted(set(listed) - present), sorted(present - set(listed))
    if missing:
        raise RepositoryError(f"{path}: {', '.join(missing)} listed in {SUMS} but missing: restore or re-publish")
    if extra:
        raise RepositoryError(f"{path}: {', '.join(extra)} not listed in {SUMS} (extra): remove or re-publish")
    for name, expected in sorted(listed.items()):
        if not (path / name).is_file():
            raise RepositoryError(f"{path}: {name} is not a regular file: remove it or re-publish the version")
        actual = sha256_file(path / name)
        if actual != expected:
            raise RepositoryError(
                f"{path}: {name} was altered (sha256 {actual[:12]}..., {SUMS} says {expected[:12]}...): "
                "restore it or re-publish the version"
            )
    config = read_config(path)
    if (config.name, config.version) != (path.parent.name, path.name):
        raise RepositoryError(
            f"{path}: config.json describes {config.name}/{config.version}, not the folder it is in: re-publish it"
        )
    if config.model_file not in listed:
        raise RepositoryError(f"{path}: platform {config.platform!r} needs {config.model_file}, not in the version")
    return config


def read_config(path: Path) -> ModelConfig:
    """Parse ``config.json`` of a version folder (or the file itself). Does not verify sums."""
    file = path / CONFIG if path.is_dir() else path
    try:
        raw = json.loads(file.read_bytes())
    except FileNotFoundError as exc:
        raise RepositoryError(f"{file} does not exist: is {path} a model version folder?") from exc
    except ValueError as exc:
        raise RepositoryError(f"{file} is not valid JSON ({exc}): re-publish the version") from exc
    if not isinstance(raw, dict):
        raise RepositoryError(f"{file} must hold a JSON object, got {type(raw).__name__}")
    return ModelConfig.from_dict(raw)


def pickle_refusal(name: str, path: Path) -> str:
    """Why ``path`` is refused as a pickle ("" if it is not one).

    Caught: pickle suffixes, pickle protocol 2-5 headers (``\\x80`` + protocol byte), and zip archives
    holding a ``.pkl`` member (``torch.save``). A safetensors header whose length happens to start with
    ``\\x80`` is recognised and allowed.
    """
    fix = "store weights as safetensors and the model as ONNX"
    if Path(name).suffix.lower() in PICKLE_SUFFIXES:
        return f"{name} has a pickle suffix: pickles run code when loaded; {fix}"
    with path.open("rb") as handle:
        head = handle.read(9)
    if len(head) >= 2 and head[0] == 0x80 and 2 <= head[1] <= 5 and not _looks_like_safetensors(head, path):
        return f"{name} is a pickle (protocol {head[1]} header): pickles run code when loaded; {fix}"
    if head.startswith(b"PK") and zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            pickled = [m for m in archive.namelist() if m.endswith((".pkl", ".pickle"))]
        if pickled:
            return f"{name} is a zip holding pickles {pickled[:3]} (a torch.save file?): {fix}"
    return ""


def _looks_like_safetensors(head: bytes, path: Path) -> bool:
    header_len = int.from_bytes(head[:8], "little")
    return len(head) == 9 and head[8:9] == b"{" and 8 + header_len <= path.stat().st_size


def _sums_text(folder: Path, names: list[str]) -> str:
    return "".join(f"{sha256_file(folder / name)}  {name}\n" for name in names)


def _read_sums(path: Path) -> dict[str, str]:
    sums: dict[str, str] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        match = _SUM_LINE.match(line)
        if not match or "/" in match["name"] or match["name"] in sums:
            raise RepositoryError(f"{path}, line {number}: {line!r} is not '<sha256>  <file>': re-publish the version")
        sums[match["name"]] = match["hex"]
    return sums


def _fsync_tree(folder: Path) -> None:
    for file in folder.iterdir():
        with file.open("rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(folder)


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
