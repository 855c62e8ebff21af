"""Reports people read (Prefect markdown artifacts, MLflow text artifacts), built as plain strings."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from sluicegate.ids import CodeVersion
from tasks.datasets import ResolvedDataset
from tasks.verdicts import GateVerdict


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        return str(value).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(value) for value in row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class StageRecord:
    """One line of a pipeline run's summary: a stage, how it ended, and the figure that says why."""

    name: str
    outcome: str  # "passed", "FAILED", "found", "recorded", a canary status ...
    detail: str


def mlflow_run_url(tracking_uri: str, experiment_id: str, run_id: str) -> str:
    return f"{tracking_uri.rstrip('/')}/#/experiments/{experiment_id}/runs/{run_id}"


def pipeline_summary(
    *,
    dataset: ResolvedDataset,
    code: CodeVersion,
    pipeline_run_id: str,
    event_id: str | None,
    mlflow_url: str | None,
    stages: Sequence[StageRecord],
) -> str:
    """The pipeline run's summary: what data, what code, which stages ran with what outcome."""
    versions = markdown_table(
        ["what", "value"],
        [
            ["dataset", f"`{dataset.name}` / `{dataset.label}`"],
            ["data version", f"`{dataset.data_version}`"],
            [
                "manifest",
                f"`{dataset.uri}` (version `{dataset.manifest_version_id or '-'}`, etag `{dataset.manifest_etag}`)",
            ],
            ["objects", f"{len(dataset.objects)} listed, {dataset.rows} manifest rows"],
            ["code version", f"`{code.commit}`" + (" (dirty)" if code.dirty else "")],
            ["pipeline run", f"`{pipeline_run_id}`"],
            ["trigger event", f"`{event_id}`" if event_id else "manual"],
            ["MLflow run", f"[open]({mlflow_url})" if mlflow_url else "-"],
        ],
    )
    stage_table = markdown_table(["stage", "outcome", "detail"], [[s.name, s.outcome, s.detail] for s in stages])
    return f"# pipeline/{dataset.name}@{dataset.data7}\n\n{versions}\n\n## Stages\n\n{stage_table}\n"


def verdict_markdown(verdict: GateVerdict, *, context: str = "") -> str:
    """One row per check (observed value, threshold, pass/fail), failures first in the summary line."""
    rows = [
        [check.name, _value(check.observed), check.threshold, "pass" if check.passed else "**FAIL**", check.detail]
        for check in verdict.checks
    ]
    status = "passed" if verdict.passed else "FAILED"
    head = f"# {verdict.gate} gate: {status}\n\n" + (f"{context}\n\n" if context else "")
    summary = "" if verdict.passed else f"> {verdict.reason()}\n\n"
    return head + summary + markdown_table(["check", "observed", "threshold", "result", "detail"], rows) + "\n"


def _value(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)
