"""One pipeline run's context: what every stage needs (settings, store, run ids, the pinned dataset, the
code version) and the one way a stage's outcome is told: ``gate`` publishes a verdict everywhere people
look (MLflow artifacts, a Prefect markdown artifact, a gate-result row), notes it in the run's summary
and stops the run when it failed.

Heavy libraries stay out of this module's imports (see flows/pipeline.py: they cost event latency).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from prefect.artifacts import create_markdown_artifact

from flows.wrappers import stage
from sluicegate import ids
from sluicegate.errors import GateFailed
from sluicegate.settings import Settings
from tasks import reports, tracking
from tasks.datasets import ResolvedDataset
from tasks.reports import StageRecord
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    from serving.preprocessing import PreprocessSpec
    from sluicegate.metadata import MetadataStore


def dataset_context(dataset: ResolvedDataset) -> str:
    return f"dataset `{dataset.name}` data version `{dataset.data7}`"


def artifact_key(prefix: str, dataset: ResolvedDataset) -> str:
    """A Prefect artifact key (lower-case letters, digits, dashes) for one dataset's report."""
    return re.sub(r"[^a-z0-9-]+", "-", f"{prefix}-{dataset.name}".lower()).strip("-")


def enforce(verdict: GateVerdict) -> None:
    """The one place a negative verdict becomes a failed run."""
    if not verdict.passed:
        raise GateFailed(verdict.reason())


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
    from sluicegate.metadata import gates as gate_rows

    if markdown is None:
        markdown = reports.verdict_markdown(verdict, context=dataset_context(dataset))
    report_uri = tracking.log_gate(settings.mlflow.url, mlflow_run_id, verdict, markdown, evidence)
    create_markdown_artifact(
        key=artifact_key(f"{verdict.gate}-gate", dataset),
        markdown=markdown,
        description=f"{verdict.gate} gate: {verdict.reason()}",
    )
    with store.session() as session:
        gate_rows.record_gate_result(
            session,
            pipeline_run_id=run_id,
            gate=verdict.gate,
            passed=verdict.passed,
            metrics=verdict.to_dict(),
            report_uri=report_uri,
        )
    return report_uri


publish_verdict = stage(_publish, "publish-verdict")


@dataclass
class RunContext:
    """A pipeline run as its stages see it; ``dataset`` and ``mlflow_run_id`` are set once pinned."""

    settings: Settings
    store: MetadataStore
    run_id: int
    code: ids.CodeVersion
    event_id: str
    dataset: ResolvedDataset | None = None
    manifest: bytes = b""
    dataset_version_id: int | None = None
    mlflow_run_id: str | None = None
    spec: PreprocessSpec | None = None  # the candidate's preprocessing, chosen between gates 1 and 2
    stages: list[StageRecord] = field(default_factory=list)

    @property
    def pinned(self) -> ResolvedDataset:
        if self.dataset is None:
            raise RuntimeError("the dataset version is not pinned yet: resolve it first")
        return self.dataset

    @property
    def tracked(self) -> str:
        if self.mlflow_run_id is None:
            raise RuntimeError("the MLflow run is not started yet: pin the dataset first")
        return self.mlflow_run_id

    @property
    def preprocessing(self) -> PreprocessSpec:
        if self.spec is None:
            raise RuntimeError("the candidate's preprocessing is not chosen yet: run the data gate first")
        return self.spec

    def note(self, name: str, outcome: str, detail: str) -> None:
        """A line of the run's summary."""
        self.stages.append(StageRecord(name, outcome, detail))

    def gate(
        self,
        name: str,
        verdict: GateVerdict,
        *,
        detail: str | None = None,
        evidence: dict[str, Any] | None = None,
        markdown: str | None = None,
    ) -> str:
        """Publish ``verdict``, note it as stage ``name`` (``detail`` replaces its reason in the summary),
        then stop the run if it failed. Returns the report's location."""
        report = publish_verdict(
            self.settings,
            self.store,
            run_id=self.run_id,
            mlflow_run_id=self.tracked,
            dataset=self.pinned,
            verdict=verdict,
            evidence=evidence,
            markdown=markdown,
        )
        self.note(name, "passed" if verdict.passed else "FAILED", detail or verdict.reason())
        enforce(verdict)
        return report

    def publish_summary(self) -> None:
        """The run's summary artifact, written whether the run passed every stage or stopped at one."""
        if self.dataset is None:
            return
        url = None
        if self.mlflow_run_id is not None:
            mlflow = self.settings.mlflow
            experiment = tracking.experiment_id(tracking.client(mlflow.url), mlflow.experiment)
            url = reports.mlflow_run_url(mlflow.url, experiment, self.mlflow_run_id)
        summary = reports.pipeline_summary(
            dataset=self.dataset,
            code=self.code,
            pipeline_run_id=str(self.run_id),
            event_id=self.event_id or None,
            mlflow_url=url,
            stages=self.stages,
        )
        create_markdown_artifact(
            key=artifact_key("pipeline", self.dataset),
            markdown=summary,
            description=f"pipeline/{self.dataset.name}@{self.dataset.data7}",
        )
