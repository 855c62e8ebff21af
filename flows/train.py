"""Gates 3 and 4 in the pipeline: train (with the stability gate), convert (ONNX parity, TensorRT
where present), then package the model version: serving repository folder, MLflow registry version,
metadata-store row. Heavy imports (torch, onnx) stay inside the functions (see flows/pipeline.py)."""

from __future__ import annotations

import dataclasses
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.wrappers import stage
from sluicegate import ids
from sluicegate.settings import Settings
from tasks import tracking
from tasks.datasets import ResolvedDataset
from tasks.verdicts import Check, GateVerdict

if TYPE_CHECKING:
    from sluicegate.metadata import MetadataStore

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Trained:
    """What training hands to conversion and packaging (kept in memory within one flow run)."""

    model: Any
    result: Any  # tasks.training.TrainingResult
    val_batch: Any  # np.ndarray, the parity batch
    spec: Any  # serving.preprocessing.PreprocessSpec
    workdir: Path


def _train(settings: Settings, dataset: ResolvedDataset, manifest: bytes, mlflow_run_id: str) -> Trained:
    from flows.gates import _source, candidate_spec
    from tasks.training import load_split, train

    spec = candidate_spec(settings)
    source = _source(settings, dataset)
    concurrency = settings.data_gate.read_concurrency
    x_train, y_train, labels = load_split(source, manifest, "train", spec, None, concurrency=concurrency)
    x_val, y_val, _ = load_split(source, manifest, "val", spec, labels, concurrency=concurrency)
    tracker = tracking.client(settings.mlflow.url)
    training = settings.training
    for name, value in training.model_dump().items():
        tracker.log_param(mlflow_run_id, f"training.{name}", value)

    def on_epoch(record: Any) -> None:
        for metric in ("train_loss", "val_loss", "val_accuracy", "images_per_second"):
            tracker.log_metric(mlflow_run_id, metric, float(getattr(record, metric)), step=record.epoch)

    model, result = train((x_train, y_train), (x_val, y_val), labels, training, on_epoch=on_epoch)
    workdir = Path(tempfile.mkdtemp(prefix="sluicegate-train-", dir=settings.home))
    return Trained(model, result, x_val[: settings.conversion.parity_batch], spec, workdir)


def _train_gate(settings: Settings, store: MetadataStore, run_id: int, trained: Trained) -> GateVerdict:
    from sluicegate.metadata import repository as repo
    from tasks.train_gate import history_from_metrics, train_gate

    with store.session() as session:
        earlier = repo.recent_gate_results(session, "train", exclude_run_id=run_id, limit=200)
        metrics = [r.metrics.get("metrics", {}) for r in earlier]
    same_model = [m for m in metrics if m.get("model_name") == settings.model.name]
    history = history_from_metrics(same_model[: settings.train_gate.history_runs])
    verdict = train_gate(
        trained.result.train_loss_curve,
        trained.result.peak_memory_bytes,
        history,
        settings.train_gate,
        val_curve=[record.val_loss for record in trained.result.history],
    )
    result = trained.result
    return dataclasses.replace(
        verdict,
        metrics={
            **verdict.metrics,
            "model_name": settings.model.name,
            "best_epoch": result.best_epoch,
            "best_val_accuracy": result.best_val_accuracy,
            "best_val_loss": result.best_val_loss,
            "device": result.device,
            "parameters": result.parameters,
            "history_runs": len(history),
        },
    )


@dataclass(frozen=True)
class Converted:
    verdict: GateVerdict
    onnx_path: Path
    onnx_sha256: str
    engine_path: Path | None


def _convert(settings: Settings, trained: Trained) -> Converted:
    import numpy as np

    from tasks.conversion import build_tensorrt_engine, export_onnx, parity

    conv = settings.conversion
    onnx_path = trained.workdir / "model.onnx"
    sha = export_onnx(trained.model, trained.val_batch[:1], onnx_path, opset=conv.opset)
    verdict = parity(trained.model, onnx_path, trained.val_batch, atol=conv.parity_atol)
    checks = list(verdict.checks)
    engine_path = None
    if conv.tensorrt == "off":
        checks.append(Check("tensorrt engine", "skipped: disabled by settings", "built when a GPU exists", True))
    else:
        import torch

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
            checks.append(Check("tensorrt engine", f"skipped: {outcome.reason}", "built when a GPU exists", True))
        else:
            bound = conv.fp16_atol if conv.fp16 else conv.parity_atol
            diff = outcome.parity_max_abs_diff
            ok = diff is not None and diff <= bound
            checks.append(Check(f"tensorrt parity ({outcome.precision})", diff, f"<= {bound:g}", ok, outcome.reason))
            engine_path = outcome.path
    metrics = {**verdict.metrics, "onnx_sha256": sha}
    return Converted(GateVerdict("convert", tuple(checks), metrics), onnx_path, sha, engine_path)


def _package(
    settings: Settings,
    store: MetadataStore,
    *,
    run_id: int,
    dataset_version_id: int | None,
    mlflow_run_id: str,
    dataset: ResolvedDataset,
    code: ids.CodeVersion,
    trained: Trained,
    converted: Converted,
    baseline: dict[str, Any],
) -> dict[str, str]:
    """Repository folder, registry version and metadata row for the new model version."""
    from serving.model_format import ModelConfig, write_version
    from tasks.training import save_checkpoint

    repository = _repository(settings)
    version = _free_version(repository, settings, code, dataset.data_version, mlflow_run_id)
    lineage_tags = {
        "sluicegate.model_version": version,
        "sluicegate.data_version": dataset.data_version,
        "sluicegate.code_version": code.commit,
        "sluicegate.code_dirty": str(code.dirty).lower(),
        "sluicegate.mlflow_run_id": mlflow_run_id,
        "sluicegate.pipeline_run_id": str(run_id),
    }
    checkpoint = trained.workdir / "checkpoint.safetensors"
    save_checkpoint(trained.model, checkpoint, lineage_tags)
    files = {"model.onnx": converted.onnx_path, "checkpoint.safetensors": checkpoint}
    if converted.engine_path is not None:
        files["model.plan"] = converted.engine_path
    spec = trained.spec
    classes = len(trained.result.labels)
    config = ModelConfig(
        name=settings.model.name,
        version=version,
        platform="tensorrt" if converted.engine_path is not None else "onnxruntime",
        inputs=[{"name": "input", "datatype": "FP32", "shape": [-1, 3, spec.height, spec.width]}],
        outputs=[{"name": "logits", "datatype": "FP32", "shape": [-1, classes]}],
        labels=list(trained.result.labels),
        preprocessing=spec.to_dict(),
        batching={"max_batch_size": settings.conversion.profile[2], "max_queue_delay_us": 0, "max_queue_size": 256},
        drift_baseline=baseline,
        lineage=lineage_tags,
    )
    version_dir = write_version(repository, config, files)
    return _publish(
        settings, store, version_dir, dataset_version_id=dataset_version_id, mlflow_run_id=mlflow_run_id, code=code
    )


def _publish(
    settings: Settings,
    store: MetadataStore,
    version_dir: Path,
    *,
    dataset_version_id: int | None,
    mlflow_run_id: str,
    code: ids.CodeVersion,
) -> dict[str, str]:
    """Register a written version folder in MLflow and record its row; both are idempotent by version.

    Args:
        settings: Platform settings.
        store: The metadata store.
        version_dir: The verified repository folder; its config's lineage names the version and the run.
        dataset_version_id: The dataset version's row, when recorded.
        mlflow_run_id: The pipeline's MLflow run.
        code: The code version the model was built from.

    Returns:
        ``model_version``, ``registry_version`` and ``repository`` (the folder).
    """
    from serving.model_format import read_config
    from sluicegate.metadata import repository as repo
    from tasks import registry

    config = read_config(version_dir)
    lineage_tags = dict(config.lineage)
    environment = ids.environment()
    registry_version = registry.register_version(
        settings.mlflow.url, settings.model.name, mlflow_run_id, version_dir, lineage_tags
    )
    tracker = tracking.client(settings.mlflow.url)
    tracker.set_tag(mlflow_run_id, "sluicegate.model_version", config.version)
    tracker.log_dict(mlflow_run_id, environment, "environment.json")
    sums = {line.split()[1]: line.split()[0] for line in (version_dir / "SHA256SUMS").read_text().splitlines() if line}
    with store.session() as session:
        repo.record_model_version(
            session,
            model_name=settings.model.name,
            version=config.version,
            mlflow_run_id=mlflow_run_id,
            code_version=code.commit,
            data_version=lineage_tags["sluicegate.data_version"],
            artifacts=sums,
            environment=environment,
            pipeline_run_id=int(lineage_tags["sluicegate.pipeline_run_id"]),
            dataset_version_id=dataset_version_id,
            mlflow_model_version=registry_version,
        )
    return {"model_version": config.version, "registry_version": registry_version, "repository": str(version_dir)}


def _repository(settings: Settings) -> Path:
    return settings.model.repository or settings.home / "repository"


def _find_packaged(settings: Settings, code: ids.CodeVersion, data_version: str, mlflow_run_id: str) -> str | None:
    """The version folder an earlier attempt of this pipeline run wrote (a run killed after packaging and
    taken over, or retried by Prefect), if it is intact; then training is not redone.

    Retraining would not give the same bytes (thread scheduling changes float sums), and versions are
    immutable, so the folder already written is the model; the rest of packaging is idempotent.
    """
    from serving.errors import RepositoryError
    from serving.model_format import verify_version

    repository = _repository(settings)
    version = _free_version(repository, settings, code, data_version, mlflow_run_id)
    folder = repository / settings.model.name / version
    if not folder.exists():
        return None
    try:
        verify_version(folder)
    except RepositoryError as exc:
        log.warning("not reusing %s: %s", folder, exc)
        return None
    return str(folder)


def _free_version(repository: Path, settings: Settings, code: ids.CodeVersion, data_version: str, run: str) -> str:
    """The model version for this build: the configured semver, with PATCH raised past builds of the same
    (code, data) by other runs (a retrain of an unchanged dataset is a new build, not the same one), and
    this run's own version again when a crashed run is re-run."""
    from serving.model_format import read_config

    major, minor, patch = (int(part) for part in settings.model.semver.split("."))
    while True:
        version = str(ids.model_version((major, minor, patch), code, data_version))
        folder = repository / settings.model.name / version
        if not folder.exists() or read_config(folder).lineage.get("sluicegate.mlflow_run_id") == run:
            return version
        patch += 1


train_model = stage(_train, "train", network=False)
check_training = stage(_train_gate, "train-gate")
convert_model = stage(_convert, "convert", network=False)
package_model = stage(_package, "package-model")
find_packaged = stage(_find_packaged, "find-packaged-model", network=False)
publish_model = stage(_publish, "publish-model")
