"""The gate steps of the pipeline: run a tasks/ gate, publish its verdict everywhere people look
(MLflow artifacts, a Prefect markdown artifact, a gate-result row), and stop the flow on failure."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any

from prefect.artifacts import create_markdown_artifact

from flows.wrappers import stage
from sluicegate.errors import GateFailed
from sluicegate.settings import Settings
from tasks import reports, tracking
from tasks.datasets import ResolvedDataset
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    from sluicegate.metadata import MetadataStore


def _source(settings: Settings, dataset: ResolvedDataset) -> Any:
    from sluicegate import storage
    from tasks.dataset_source import S3Source

    return S3Source(
        storage.s3_client(settings),
        dataset.bucket,
        dataset.prefix,
        manifest_version=dataset.manifest_version_id,
        versions=dataset.objects,
    )


def _data_gate(
    settings: Settings, dataset: ResolvedDataset, manifest: bytes
) -> tuple[GateVerdict, dict[str, Any], dict[str, Any]]:
    """Returns (verdict, GX validation result, channel baseline for the drift monitor)."""
    from tasks import champion as champ
    from tasks.data_gate import run_data_gate
    from tasks.datasets import manifest_paths
    from tasks.image_stats import channel_baseline, collect_stats

    stats = collect_stats(
        _source(settings, dataset), manifest_paths(manifest), concurrency=settings.data_gate.read_concurrency
    )
    found = champ.find_champion(settings.mlflow.url, settings.model.name)
    reference = champ.champion_labels(settings.mlflow.url, found) if found else None
    verdict, validation = run_data_gate(manifest, stats, reference, settings.data_gate)
    return verdict, validation, channel_baseline(stats)


def _feature_gate(settings: Settings, dataset: ResolvedDataset) -> GateVerdict:
    from serving.preprocessing import PreprocessSpec
    from tasks import champion as champ
    from tasks.feature_gate import feature_gate, sample_indices
    from tasks.image_stats import load_images

    candidate = candidate_spec(settings)
    found = champ.find_champion(settings.mlflow.url, settings.model.name)
    recorded = champ.champion_preprocessing(settings.mlflow.url, found) if found else None
    champion = PreprocessSpec.from_dict(recorded) if recorded else None
    paths = sorted(dataset.objects)
    chosen = [
        paths[i] for i in sample_indices(len(paths), settings.feature_gate.sample_size, settings.feature_gate.seed)
    ]
    images = load_images(_source(settings, dataset), chosen, concurrency=settings.data_gate.read_concurrency)
    return feature_gate(
        images,
        champion,
        candidate,
        percentile=settings.feature_gate.percentile,
        min_cosine=settings.feature_gate.min_cosine,
    )


def candidate_spec(settings: Settings) -> Any:
    from tasks.feature_gate import spec_from_settings

    return spec_from_settings(settings.preprocessing)


def _publish(
    settings: Settings,
    store: MetadataStore,
    *,
    run_id: int,
    mlflow_run_id: str,
    dataset: ResolvedDataset,
    verdict: GateVerdict,
    evidence: dict[str, Any] | None = None,
    markdown: str | None = None,
) -> str:
    """Write the verdict to MLflow, Prefect and the metadata store; returns the report's location.

    ``markdown`` replaces the standard check table as the report (a gate with more to show).
    """
    from sluicegate.metadata import repository as repo

    if markdown is None:
        markdown = reports.verdict_markdown(verdict, context=dataset_context(dataset))
    report_uri = tracking.log_gate(settings.mlflow.url, mlflow_run_id, verdict, markdown, evidence)
    create_markdown_artifact(
        key=artifact_key(f"{verdict.gate}-gate", dataset),
        markdown=markdown,
        description=f"{verdict.gate} gate: {verdict.reason()}",
    )
    with store.session() as session:
        repo.record_gate_result(
            session,
            pipeline_run_id=run_id,
            gate=verdict.gate,
            passed=verdict.passed,
            metrics=verdict.to_dict(),
            report_uri=report_uri,
        )
    return report_uri


def dataset_context(dataset: ResolvedDataset) -> str:
    return f"dataset `{dataset.name}` data version `{dataset.data7}`"


def artifact_key(prefix: str, dataset: ResolvedDataset) -> str:
    """A Prefect artifact key (lower-case letters, digits, dashes) for one dataset's report."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{dataset.name}".lower()).strip("-")


def enforce(verdict: GateVerdict) -> None:
    """The one place a negative verdict becomes a failed run."""
    if not verdict.passed:
        raise GateFailed(verdict.reason())


data_gate = stage(_data_gate, "data-gate")
feature_gate = stage(_feature_gate, "feature-gate")
publish_verdict = stage(_publish, "publish-verdict")
