"""Gate 5 in the pipeline: the packaged candidate against the current champion on the test split, through
the serving runtime; reports to MLflow (plots, model card), Prefect (side-by-side table, confusion
matrix) and the metadata store; on a pass the ``challenger`` alias moves to the candidate."""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prefect.artifacts import create_image_artifact
from prefect.runtime import flow_run

from flows.gates import source_of
from flows.run_context import artifact_key, dataset_context
from flows.wrappers import stage
from sluicegate.settings import Settings
from tasks import tracking
from tasks.datasets import ResolvedDataset
from tasks.verdicts import Check, GateVerdict

if TYPE_CHECKING:
    from flows.run_context import RunContext
    from tasks.baselines import Baselines
    from tasks.evaluation import Evaluation
    from tasks.registry import RegistryVersion

CONFUSION_PNG = "gates/eval/confusion_matrix.png"
CALIBRATION_PNG = "gates/eval/calibration.png"
MODEL_CARD = "model_card.md"


@dataclass(frozen=True)
class Evaluated:
    verdict: GateVerdict
    evaluations: list[Evaluation]  # candidate first, then the champion when it could be evaluated
    champion: RegistryVersion | None
    baselines: Baselines | None = None  # None when nothing was measured (the champion could not be loaded)


def _evaluate(settings: Settings, dataset: ResolvedDataset, manifest: bytes, candidate_dir: Path) -> Evaluated:
    from tasks import registry
    from tasks.baselines import baselines, load_split_thumbnails, with_baselines
    from tasks.eval_gate import eval_gate, only_latency_failed
    from tasks.evaluation import EvalOptions, evaluate, load_test_split, model_under_test

    rules = settings.eval_gate
    source = source_of(settings, dataset)
    images, labels = load_test_split(
        source,
        manifest,
        limit=rules.max_images,
        concurrency=settings.data_gate.read_concurrency,
    )
    models = [model_under_test("candidate", candidate_dir)]
    champion = registry.alias_holder(settings.mlflow.url, settings.model.name, registry.CHAMPION)
    scratch = Path(tempfile.mkdtemp(prefix="sluicegate-eval-", dir=settings.home))
    try:
        if champion is not None:
            try:
                folder = registry.download_version(settings.mlflow.url, champion, scratch)
                models.append(model_under_test("champion", folder))
            except Exception as exc:  # the champion's files are broken or gone: say so, judge nothing
                check = Check(
                    "champion evaluable",
                    f"{type(exc).__name__}: {exc}",
                    "the champion's registered files download, verify and load",
                    False,
                    f"repair or re-promote the champion ({champion.describe()}): sluicegate models promote VERSION",
                )
                return Evaluated(GateVerdict("eval", (check,)), [], champion)
        options = EvalOptions(
            batch_sizes=tuple(rules.batch_sizes),
            latency_iterations=rules.latency_iterations,
            warmup_iterations=rules.warmup_iterations,
            threads=rules.threads,
            calibration_bins=rules.calibration_bins,
            latency_retries=rules.latency_retries,
        )
        evaluations = evaluate(models, images, labels, options, remeasure=partial(only_latency_failed, rules=rules))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # The baselines are scored on the very test images the candidate was, so the comparison is exact.
    train_images, train_labels = load_split_thumbnails(
        source, manifest, "train", size=rules.baseline_size, concurrency=settings.data_gate.read_concurrency
    )
    found = baselines(train_images, train_labels, images, labels, models[0].labels, size=rules.baseline_size)
    verdict = eval_gate(evaluations[0], evaluations[1] if len(evaluations) > 1 else None, rules)
    return Evaluated(with_baselines(verdict, evaluations[0], found, rules), evaluations, champion, found)


@dataclass(frozen=True)
class EvaluationReport:
    """What the eval gate's verdict is published with (``RunContext.gate``)."""

    markdown: str | None  # None: nothing was measured, the standard check table says why
    evidence: dict[str, Any] | None


def _publish(run: RunContext, evaluated: Evaluated, candidate: RegistryVersion) -> EvaluationReport:
    """Plots, model card and metrics in MLflow, the confusion matrix in Prefect, the outcome as registry
    tags on the candidate; returns the report the verdict is published with."""
    from tasks import registry

    evaluations, verdict = evaluated.evaluations, evaluated.verdict
    report = EvaluationReport(None, None)
    if evaluations:
        images = _log_evaluations(run, evaluations, evaluated.baselines)
        _log_model_card(run, evaluated, candidate)
        markdown = _eval_markdown(run, evaluated, images)
        evidence: dict[str, Any] = {"evaluations": [e.to_dict() for e in evaluations]}
        if evaluated.baselines is not None:
            evidence["baselines"] = evaluated.baselines.to_dict()
        report = EvaluationReport(markdown, {"evaluations": evidence})
        create_image_artifact(
            image_url=images["confusion matrix"],
            key=artifact_key("eval-confusion-matrix", run.pinned),
            description=f"confusion matrices, candidate {candidate.model_version} vs champion",
        )
    tags = {registry.TAG_EVAL_GATE: "passed" if verdict.passed else "failed"}
    if evaluations:
        tags["sluicegate.eval.accuracy"] = f"{evaluations[0].accuracy:.4f}"
    registry.set_tags(run.settings.mlflow.url, candidate, tags)
    return report


def _log_evaluations(run: RunContext, evaluations: list[Evaluation], found: Baselines | None) -> dict[str, str]:
    """Confusion-matrix and calibration plots, every evaluation's metrics and the baselines' beside them;
    returns the plots' URLs."""
    from tasks import eval_report

    tracker = tracking.client(run.settings.mlflow.url)
    images: dict[str, str] = {}
    for path, png in (
        (CONFUSION_PNG, eval_report.confusion_png(evaluations)),
        (CALIBRATION_PNG, eval_report.calibration_png(evaluations)),
    ):
        _log_bytes(tracker, run.tracked, path, png)
        images[Path(path).stem.replace("_", " ")] = artifact_url(run.settings.mlflow.url, run.tracked, path)
    for evaluation in evaluations:
        for name, value in _flat_metrics(evaluation).items():
            tracker.log_metric(run.tracked, f"eval.{evaluation.role}.{name}", value)
    if found is not None:
        for name, value in _baseline_metrics(found).items():
            tracker.log_metric(run.tracked, name, value)
    return images


def _log_model_card(run: RunContext, evaluated: Evaluated, candidate: RegistryVersion) -> None:
    from sluicegate import ids
    from tasks import eval_report
    from tasks.training_data import labelled_rows

    evaluations, settings = evaluated.evaluations, run.settings
    card = eval_report.model_card(
        model_name=settings.model.name,
        candidate=evaluations[0],
        champion=evaluations[1] if len(evaluations) > 1 else None,
        verdict=evaluated.verdict,
        lineage=candidate.tags,
        dataset=f"{run.pinned.name}/{run.pinned.label}",
        environment=ids.environment(),
        intended_use=settings.model.intended_use,
        labels=evaluations[0].model_labels,
        train_images=len(labelled_rows(run.manifest, "train")),
        baselines=evaluated.baselines,
    )
    tracking.client(settings.mlflow.url).log_text(run.tracked, card, MODEL_CARD)


def _eval_markdown(run: RunContext, evaluated: Evaluated, images: dict[str, str]) -> str:
    from tasks import eval_report

    context = dataset_context(run.pinned)
    return eval_report.eval_markdown(
        evaluated.verdict, evaluated.evaluations, context=context, images=images, baselines=evaluated.baselines
    )


def _flat_metrics(evaluation: Evaluation) -> dict[str, float]:
    out = {"accuracy": evaluation.accuracy, "ece": evaluation.ece}
    for entry in evaluation.latency:
        out[f"p50_ms_b{entry.batch_size}"] = entry.p50_ms
        out[f"p95_ms_b{entry.batch_size}"] = entry.p95_ms
    return out


def _baseline_metrics(found: Baselines) -> dict[str, float]:
    """The baselines' numeric figures under the verdict's metric names (MLflow metrics are numbers)."""
    return {
        name: float(value)
        for name, value in found.metrics().items()
        if isinstance(value, int | float) and not isinstance(value, bool)
    }


def _log_bytes(tracker: Any, run_id: str, path: str, data: bytes) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        local = Path(tmp) / Path(path).name
        local.write_bytes(data)
        tracker.log_artifact(run_id, str(local), artifact_path=str(Path(path).parent))


def artifact_url(tracking_uri: str, run_id: str, path: str) -> str:
    """An HTTP URL the MLflow server answers with the artifact's bytes (what the Prefect UI can show)."""
    from urllib.parse import urlencode

    return f"{tracking_uri.rstrip('/')}/get-artifact?" + urlencode({"path": path, "run_uuid": run_id})


def _promote_challenger(run: RunContext, candidate: RegistryVersion, verdict: GateVerdict) -> bool:
    """Move ``challenger`` to the candidate; True when it moved (False: it already held it)."""
    from tasks import registry

    metrics = verdict.metrics
    against = (
        f"champion {metrics['champion_version']} at {float(metrics['champion_accuracy']):.4f}"
        if "champion_version" in metrics
        else "no champion (first-model floor)"
    )
    reason = f"eval gate passed: accuracy {float(metrics['candidate_accuracy']):.4f} vs {against}"
    moved = registry.move_alias(
        run.settings.mlflow.url,
        run.store,
        candidate,
        registry.CHALLENGER,
        actor=f"pipeline:{flow_run.get_name() or 'manual'}",
        reason=reason,
        pipeline_run_id=run.run_id,
    )
    return moved is not None


def stage_result(verdict: GateVerdict, evaluations: list[Evaluation]) -> str:
    """The pipeline summary's one-line detail for gate 5."""
    if not evaluations:
        return verdict.reason()
    head = f"accuracy {evaluations[0].accuracy:.3f}"
    if len(evaluations) > 1:
        head += f" vs champion {evaluations[1].accuracy:.3f}"
    return f"{verdict.reason()}; {head}"


evaluate_candidate = stage(_evaluate, "eval-gate", network=True)
publish_evaluation = stage(_publish, "publish-evaluation")
promote_challenger = stage(_promote_challenger, "set-challenger-alias")
