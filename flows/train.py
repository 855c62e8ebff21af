"""Gates 3 and 4 in the pipeline, as Prefect tasks around ``tasks.build`` (the same composition
``sluicegate train`` runs): train (with the stability gate against this model's earlier runs), convert,
then package the model version and publish it: serving repository folder, MLflow registry version,
metadata-store row. Heavy imports (torch, onnx) stay inside the functions (see flows/pipeline.py)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flows.gates import source_of
from flows.wrappers import stage
from sluicegate import ids
from sluicegate.settings import Settings
from tasks import build, tracking
from tasks.datasets import ResolvedDataset
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    from flows.run_context import RunContext
    from serving.preprocessing import PreprocessSpec
    from sluicegate.metadata import MetadataStore


def _train(
    settings: Settings, dataset: ResolvedDataset, manifest: bytes, mlflow_run_id: str, spec: PreprocessSpec
) -> build.Trained:
    data = build.load_training_data(settings, source_of(settings, dataset), manifest, spec)
    tracker = tracking.client(settings.mlflow.url)
    # The values training will use (unset settings resolved from the data), so a run's params say what
    # it did, whether the settings, a model spec or the data chose them.
    for name, value in build.resolved_training(settings, data).params().items():
        tracker.log_param(mlflow_run_id, f"training.{name}", value)

    def on_epoch(record: Any) -> None:
        for metric in ("train_loss", "val_loss", "val_accuracy", "images_per_second"):
            tracker.log_metric(mlflow_run_id, metric, float(getattr(record, metric)), step=record.epoch)

    workdir = Path(tempfile.mkdtemp(prefix="sluicegate-train-", dir=settings.home))
    return build.train_candidate(settings, data, workdir, on_epoch=on_epoch)


def _train_gate(settings: Settings, store: MetadataStore, run_id: int, trained: build.Trained) -> GateVerdict:
    """The train gate against this model's recent runs (their recorded train-gate metrics)."""
    from sluicegate.metadata import gates as gate_rows
    from tasks.train_gate import comparable_runs, history_from_metrics

    with store.session() as session:
        rows = gate_rows.recent_gate_results(session, "train", exclude_run_id=run_id, limit=200)
        metrics = [r.metrics.get("metrics", {}) for r in rows]
    epochs = trained.result.resolved.epochs
    earlier = comparable_runs(metrics, model=settings.model.name, epochs=epochs, limit=settings.train_gate.history_runs)
    history = history_from_metrics(earlier)
    return build.gate_training(settings, trained, history)


def _package(
    run: RunContext, trained: build.Trained, converted: build.Converted, baseline: dict[str, Any]
) -> dict[str, str]:
    """Repository folder, registry version and metadata row for the new model version."""
    settings, dataset, code = run.settings, run.pinned, run.code
    repository = build.repository_root(settings)
    version = build.free_version(repository, settings, code, dataset.data_version, run.tracked)
    lineage_tags = {
        "sluicegate.model_version": version,
        "sluicegate.data_version": dataset.data_version,
        "sluicegate.code_version": code.commit,
        "sluicegate.code_dirty": str(code.dirty).lower(),
        "sluicegate.mlflow_run_id": run.tracked,
        "sluicegate.pipeline_run_id": str(run.run_id),
    }
    version_dir = build.package(
        settings,
        repository,
        version=version,
        trained=trained,
        converted=converted,
        baseline=baseline,
        lineage=lineage_tags,
    )
    return _publish(run, version_dir)


def _publish(run: RunContext, version_dir: Path) -> dict[str, str]:
    """Register a written version folder in MLflow and record its row; both are idempotent by version.

    Args:
        run: the pipeline run (settings, store, MLflow run, code version, dataset version row).
        version_dir: the verified repository folder; its config's lineage names the version and the run.

    Returns:
        ``model_version``, ``registry_version`` and ``repository`` (the folder).
    """
    from serving.model_format import read_config
    from sluicegate.metadata import model_versions
    from tasks import registry

    settings = run.settings
    config = read_config(version_dir)
    lineage_tags = dict(config.lineage)
    environment = ids.environment()
    registry_version = registry.register_version(
        settings.mlflow.url, settings.model.name, run.tracked, version_dir, lineage_tags
    )
    tracker = tracking.client(settings.mlflow.url)
    tracker.set_tag(run.tracked, "sluicegate.model_version", config.version)
    tracker.log_dict(run.tracked, environment, "environment.json")
    sums = {line.split()[1]: line.split()[0] for line in (version_dir / "SHA256SUMS").read_text().splitlines() if line}
    with run.store.session() as session:
        model_versions.record_model_version(
            session,
            model_name=settings.model.name,
            version=config.version,
            mlflow_run_id=run.tracked,
            code_version=run.code.commit,
            data_version=lineage_tags["sluicegate.data_version"],
            artifacts=sums,
            environment=environment,
            pipeline_run_id=int(lineage_tags["sluicegate.pipeline_run_id"]),
            dataset_version_id=run.dataset_version_id,
            mlflow_model_version=registry_version,
        )
    return {"model_version": config.version, "registry_version": registry_version, "repository": str(version_dir)}


train_model = stage(_train, "train", network=False)
check_training = stage(_train_gate, "train-gate")
convert_model = stage(build.convert, "convert", network=False)
package_model = stage(_package, "package-model")
find_packaged = stage(build.find_packaged, "find-packaged-model", network=False)
publish_model = stage(_publish, "publish-model")
