"""Scheduled retraining, per model: the pipeline again on the newest version of the datasets that feed each
model, unless that version already produced the model's champion (then the skip and its reason are
recorded, not silently dropped). One model's failure does not keep the others from retraining."""

from __future__ import annotations

import re
from datetime import datetime
from typing import Any

from prefect import State, flow, get_run_logger
from prefect.artifacts import create_markdown_artifact
from prefect.runtime import flow_run
from prefect.states import Completed, Failed

from flows.pipeline import pipeline
from flows.wrappers import stage
from sluicegate import ids, model_specs, storage
from sluicegate.settings import Settings
from tasks import retrain


def _newest(settings: Settings) -> dict[str, retrain.NewestDataset]:
    s3 = storage.s3_client(settings)

    def model_of(dataset: str) -> str:
        return model_specs.model_for_dataset(settings, dataset).name

    return retrain.newest_per_model(s3, settings.storage.bucket, settings.storage.datasets_prefix, model_of)


def _record_skip(settings: Settings, decision: retrain.RetrainDecision) -> int:
    """A pipeline-run row with status ``skipped``, linked to the dataset version, so lineage shows it."""
    from sluicegate.metadata import MetadataStore, runs

    code = ids.code_version(baked=settings.code_commit)
    newest = decision.newest
    with MetadataStore.checked(settings.metadata_url) as store:
        return runs.record_skipped_run(
            store,
            flow_run_id=flow_run.get_id(),
            trigger="schedule",
            code_commit=code.commit,
            code_dirty=code.dirty,
            parameters={"key": newest.key if newest else "", "version_id": newest.version_id if newest else ""},
            data_version=newest.data_version if newest else None,
            reason=decision.reason,
        )


find_newest = stage(_newest, "find-newest-dataset")
champion_data = stage(retrain.champion_data_version, "champion-data-version")
record_skip = stage(_record_skip, "record-skip")


def _run_name() -> str:
    when: datetime = flow_run.scheduled_start_time
    return "scheduled-retrain/" + when.strftime("%Y-%m-%dT%H%M")


@flow(name="scheduled-retrain", flow_run_name=_run_name, log_prints=True)
def scheduled_retrain(force: bool = False, model: str = "") -> dict[str, Any] | State:
    """Re-run the pipeline on each model's newest dataset version.

    Args:
        force: Retrain even when the newest dataset version already produced the champion.
        model: Retrain only this model (empty: every model with a dataset in the bucket).

    Returns:
        ``{"status", "models": {model: the pipeline's result or the skip}}``; a Completed state named
        "Skipped" when every model was skipped, a Failed one (same data) when a model's pipeline failed.
    """
    logger = get_run_logger()
    settings = Settings()
    newest = find_newest(settings)
    if model:
        newest = {model: newest[model]} if model in newest else {}
    results: dict[str, dict[str, Any]] = {}
    failed: list[str] = []
    for name, target in newest.items():
        try:
            results[name] = _retrain_model(settings, name, target, force=force)
        except Exception as exc:  # one model's failure is reported, and the others still retrain
            logger.error("retraining %s failed: %s", name, exc)
            results[name] = {"status": "failed", "reason": f"{type(exc).__name__}: {exc}"}
            failed.append(name)
    if not newest:
        reason = f"no dataset manifest in the bucket{' for model ' + model if model else ''}: nothing to retrain"
        logger.info(reason)
        _skip_artifact(reason, None)
        return Completed(name="Skipped", message=reason, data={"status": "skipped", "reason": reason, "models": {}})
    summary = {"status": _overall(results), "models": results}
    if failed:
        return Failed(message=f"retraining failed for {', '.join(failed)}", data=summary)
    if summary["status"] == "skipped":
        reason = "; ".join(f"{name}: {result['reason']}" for name, result in results.items())
        return Completed(name="Skipped", message=reason, data={**summary, "reason": reason})
    return summary


def _overall(results: dict[str, dict[str, Any]]) -> str:
    statuses = {result["status"] for result in results.values()}
    if "failed" in statuses:
        return "failed"
    return "skipped" if statuses == {"skipped"} else "succeeded"


def _retrain_model(settings: Settings, name: str, target: retrain.NewestDataset, *, force: bool) -> dict[str, Any]:
    """The pipeline on ``target`` for model ``name``, or the recorded skip."""
    logger = get_run_logger()
    decision = retrain.decide(target, champion_data(settings.mlflow.url, name), force=force)
    logger.info("%s: %s", name, decision.reason)
    if not decision.retrain:
        run_id = record_skip(settings, decision)
        _skip_artifact(f"{name}: {decision.reason}", run_id, model=name)
        return {"status": "skipped", "reason": decision.reason, "pipeline_run_id": run_id}
    logger.info(
        "retraining %s on s3://%s/%s (version %s)", name, settings.storage.bucket, target.key, target.version_id
    )
    result: dict[str, Any] = pipeline(
        bucket=settings.storage.bucket, key=target.key, version_id=target.version_id or "", trigger="schedule"
    )
    return result


def _skip_artifact(reason: str, run_id: int | None, *, model: str = "") -> None:
    key = f"scheduled-retrain-{model}" if model else "scheduled-retrain"
    create_markdown_artifact(
        key=re.sub(r"[^a-z0-9-]+", "-", key.lower()),
        markdown=f"## Scheduled retrain skipped\n\n{reason}\n\nPipeline run row: {run_id or '-'}",
        description="scheduled-retrain: skipped",
    )
