"""Gates 3 and 4 composed once, for the pipeline and ``sluicegate train`` alike: load the splits, train a
candidate, judge its training, convert it (ONNX parity; a TensorRT engine where one can be built) and
write it as a model version in the serving layout.

The stage logic is ``training``, ``train_gate`` and ``conversion``; this module decides what they are fed
and how a version is named and laid out. Registering in MLflow and recording rows is the flow's part.
Heavy libraries (torch, onnx) are imported inside the functions: flow modules import this one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from serving.model_format import DEFAULT_BATCHING, ModelConfig
from sluicegate import ids
from sluicegate.settings import Settings
from tasks.verdicts import Check, GateVerdict

if TYPE_CHECKING:
    import numpy as np

    from serving.preprocessing import PreprocessSpec
    from tasks.dataset_source import DatasetSource
    from tasks.train_gate import HistoryRun
    from tasks.training import ResolvedTraining

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TrainingData:
    """The decoded, preprocessed train and validation splits of one dataset version."""

    x_train: np.ndarray
    y_train: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    labels: tuple[str, ...]
    spec: PreprocessSpec


@dataclass(frozen=True)
class Trained:
    """What training hands to conversion and packaging (kept in memory within one run)."""

    model: Any  # torch.nn.Module
    result: Any  # tasks.training.TrainingResult
    val_batch: np.ndarray  # the parity batch
    spec: PreprocessSpec
    workdir: Path


@dataclass(frozen=True)
class Converted:
    verdict: GateVerdict
    onnx_path: Path
    onnx_sha256: str
    engine_path: Path | None
    engine_reason: str  # why an engine was or was not built (no GPU, no TensorRT, disabled, ...)


def load_training_data(
    settings: Settings, source: DatasetSource, manifest: bytes, spec: PreprocessSpec
) -> TrainingData:
    """Decode and preprocess the train and val splits with the candidate's preprocessing ``spec``
    (``tasks.dataset_gates.candidate_spec``)."""
    from tasks.training_data import load_split

    concurrency = settings.data_gate.read_concurrency
    x_train, y_train, labels = load_split(source, manifest, "train", spec, None, concurrency=concurrency)
    x_val, y_val, _ = load_split(source, manifest, "val", spec, labels, concurrency=concurrency)
    return TrainingData(x_train, y_train, x_val, y_val, tuple(labels), spec)


def resolved_training(settings: Settings, data: TrainingData) -> ResolvedTraining:
    """The training settings with what was left unset chosen from the data (architecture, epochs, ...)."""
    from tasks.training import resolve_training

    _, channels, height, width = data.x_train.shape
    return resolve_training(
        settings.training, channels=channels, height=height, width=width, train_count=len(data.x_train)
    )


def train_candidate(
    settings: Settings, data: TrainingData, workdir: Path, on_epoch: Callable[[Any], None] | None = None
) -> Trained:
    """Train with ``settings.training``; ``on_epoch`` gets each ``EpochRecord`` (metrics, progress)."""
    from tasks.training import train

    model, result = train(
        (data.x_train, data.y_train), (data.x_val, data.y_val), list(data.labels), settings.training, on_epoch=on_epoch
    )
    return Trained(model, result, data.x_val[: settings.conversion.parity_batch], data.spec, workdir)


def gate_training(settings: Settings, trained: Trained, history: Sequence[HistoryRun]) -> GateVerdict:
    """The train gate against ``history`` (earlier runs of the same model; empty judges the run alone),
    with what the run learned added to the verdict's metrics."""
    from tasks.train_gate import train_gate

    result = trained.result
    verdict = train_gate(
        result.train_loss_curve,
        result.peak_memory_bytes,
        history,
        settings.train_gate,
        val_curve=[record.val_loss for record in result.history],
        step_losses=result.step_losses,
    )
    return dataclasses.replace(
        verdict,
        metrics={
            **verdict.metrics,
            "model_name": settings.model.name,
            "epochs": result.resolved.epochs,  # the epoch budget: runs are history to runs of a like one
            "best_epoch": result.best_epoch,
            "best_val_accuracy": result.best_val_accuracy,
            "best_val_loss": result.best_val_loss,
            "device": result.device,
            "parameters": result.parameters,
            "history_runs": len(history),
        },
    )


def convert(settings: Settings, trained: Trained) -> Converted:
    """ONNX export + parity; then the one TensorRT decision: build an engine unless the settings say off,
    record why none was built (no GPU, no TensorRT) as a passing check, and judge its parity when built."""
    from tasks.conversion import export_onnx, parity

    conv = settings.conversion
    onnx_path = trained.workdir / "model.onnx"
    sha = export_onnx(trained.model, trained.val_batch[:1], onnx_path, opset=conv.opset)
    verdict = parity(trained.model, onnx_path, trained.val_batch, atol=conv.parity_atol)
    if conv.tensorrt == "off":
        reason = "disabled by settings"
        engine_check, engine_path = Check("tensorrt engine", f"skipped: {reason}", _WHEN_GPU, True), None
    else:
        engine_check, engine_path, reason = _tensorrt(settings, trained, onnx_path)
    metrics = {**verdict.metrics, "onnx_sha256": sha}
    checks = GateVerdict("convert", (*verdict.checks, engine_check), metrics)
    return Converted(checks, onnx_path, sha, engine_path, reason)


_WHEN_GPU = "built when a GPU exists"


def _tensorrt(settings: Settings, trained: Trained, onnx_path: Path) -> tuple[Check, Path | None, str]:
    import numpy as np
    import torch

    from tasks.conversion import build_tensorrt_engine

    conv = settings.conversion
    with torch.no_grad():
        reference = trained.model.cpu()(torch.from_numpy(np.ascontiguousarray(trained.val_batch))).numpy()
    outcome = build_tensorrt_engine(
        onnx_path,
        trained.workdir / "model.plan",
        profile=conv.profile,
        fp16=conv.fp16,
        cache_dir=conv.engine_cache or settings.home / "engines",
        parity_batch=trained.val_batch,
        reference_logits=reference,
        fp16_atol=conv.fp16_atol,
        atol=conv.parity_atol,
    )
    if not outcome.built:
        return Check("tensorrt engine", f"skipped: {outcome.reason}", _WHEN_GPU, True), None, outcome.reason
    bound = conv.fp16_atol if conv.fp16 else conv.parity_atol
    diff = outcome.parity_max_abs_diff
    ok = diff is not None and diff <= bound
    check = Check(f"tensorrt parity ({outcome.precision})", diff, f"<= {bound:g}", ok, outcome.reason)
    return check, outcome.path, outcome.reason


def repository_root(settings: Settings) -> Path:
    """The serving repository the pipeline writes versions into."""
    return settings.model.repository or settings.home / "repository"


def version_name(settings: Settings, code: ids.CodeVersion, data_version: str) -> str:
    """``vX.Y.Z-<commit7>-<data7>`` from the configured semver (the one place it is parsed)."""
    return str(ids.model_version(ids.parse_semver(settings.model.semver), code, data_version))


def free_version(repository: Path, settings: Settings, code: ids.CodeVersion, data_version: str, run: str) -> str:
    """The model version for this build: the configured semver, with PATCH raised past builds of the same
    (code, data) by other runs (a retrain of an unchanged dataset is a new build, not the same one), and
    this run's own version again when a crashed run is re-run."""
    from serving.model_format import read_config

    major, minor, patch = ids.parse_semver(settings.model.semver)
    while True:
        version = str(ids.model_version((major, minor, patch), code, data_version))
        folder = repository / settings.model.name / version
        if not folder.exists() or read_config(folder).lineage.get("sluicegate.mlflow_run_id") == run:
            return version
        patch += 1


def find_packaged(settings: Settings, code: ids.CodeVersion, data_version: str, run: str) -> Path | None:
    """The version folder an earlier attempt of this run wrote (a run killed after packaging and taken
    over, or retried by Prefect), if it is intact; then training is not redone.

    Retraining would not give the same bytes (thread scheduling changes float sums), and versions are
    immutable, so the folder already written is the model; the rest of packaging is idempotent.
    """
    from serving.errors import RepositoryError
    from serving.model_format import verify_version

    repository = repository_root(settings)
    folder = repository / settings.model.name / free_version(repository, settings, code, data_version, run)
    if not folder.exists():
        return None
    try:
        verify_version(folder)
    except RepositoryError as exc:
        log.warning("not reusing %s: %s", folder, exc)
        return None
    return folder


def model_config(
    settings: Settings,
    *,
    version: str,
    trained: Trained,
    converted: Converted,
    baseline: dict[str, Any],
    lineage: Mapping[str, str],
) -> ModelConfig:
    """The version's ``config.json``: its tensors, labels, preprocessing, batching and drift baseline."""
    spec = trained.spec
    labels = list(trained.result.labels)
    return ModelConfig(
        name=settings.model.name,
        version=version,
        platform="tensorrt" if converted.engine_path is not None else "onnxruntime",
        inputs=[{"name": "input", "datatype": "FP32", "shape": [-1, spec.channels, spec.height, spec.width]}],
        outputs=[{"name": "logits", "datatype": "FP32", "shape": [-1, len(labels)]}],
        labels=labels,
        preprocessing=spec.to_dict(),
        # The engine's optimisation profile caps the batch the server may form; the rest are the format's.
        batching={**DEFAULT_BATCHING, "max_batch_size": settings.conversion.profile[2]},
        drift_baseline=baseline,
        lineage=dict(lineage),
    )


def package(
    settings: Settings,
    repository: Path,
    *,
    version: str,
    trained: Trained,
    converted: Converted,
    baseline: dict[str, Any],
    lineage: Mapping[str, str],
) -> Path:
    """Write ``<repository>/<model>/<version>/``: ONNX model, engine when built, checkpoint, config, sums."""
    from serving.model_format import write_version
    from tasks.training import save_checkpoint

    checkpoint = trained.workdir / "checkpoint.safetensors"
    save_checkpoint(trained.model, checkpoint, dict(lineage))
    files = {"model.onnx": converted.onnx_path, "checkpoint.safetensors": checkpoint}
    if converted.engine_path is not None:
        files["model.plan"] = converted.engine_path
    config = model_config(
        settings, version=version, trained=trained, converted=converted, baseline=baseline, lineage=lineage
    )
    return write_version(repository, config, files)
