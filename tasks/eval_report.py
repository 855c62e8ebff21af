"""Gate 5's reports: the side-by-side comparison (markdown), its plots (PNG via matplotlib's Agg backend,
no display needed) and the model card."""

from __future__ import annotations

import io
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tasks.evaluation import Evaluation
from tasks.reports import markdown_table, verdict_markdown
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    from tasks.baselines import Baselines


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def comparison_table(evaluations: Sequence[Evaluation], baselines: Baselines | None = None) -> str:
    """Headline metrics, one column per model (candidate first), then one per baseline when given (their
    accuracy and test images only: they are not served, so they have no latency or calibration)."""
    batch_sizes = sorted({entry.batch_size for e in evaluations for entry in e.latency})
    rows: list[list[object]] = [
        ["model version", *(f"`{e.model_version}`" for e in evaluations)],
        ["runtime", *(f"{e.runtime} ({', '.join(e.providers)})" for e in evaluations)],
        ["test images", *(e.samples for e in evaluations)],
        ["accuracy", *(f"{e.accuracy:.4f}" for e in evaluations)],
        ["macro F1", *(f"{_macro_f1(e):.4f}" for e in evaluations)],
        ["expected calibration error", *(f"{e.ece:.4f}" for e in evaluations)],
    ]
    for size in batch_sizes:
        for stat in ("p50", "p95"):
            cells = []
            for e in evaluations:
                entry = e.latency_at(size)
                cells.append(_ms(None if entry is None else getattr(entry, f"{stat}_ms")))
            rows.append([f"{stat} latency ms @ batch {size}", *cells])
    if any(e.latency_attempts > 1 for e in evaluations):
        rows.append(["latency measurements", *(e.latency_attempts for e in evaluations)])
    headers = ["metric", *(e.role for e in evaluations)]
    if baselines is not None:
        headers += ["majority class", "linear baseline"]
        for row in rows:
            row += _baseline_cells(str(row[0]), baselines)
    return markdown_table(headers, rows)


def _baseline_cells(metric: str, baselines: Baselines) -> list[object]:
    if metric == "accuracy":
        return [f"{baselines.majority_accuracy:.4f}", f"{baselines.linear_accuracy:.4f}"]
    if metric == "test images":
        return [baselines.test_count, baselines.test_count]
    return ["-", "-"]


def baselines_line(baselines: Baselines) -> str:
    """What the two baselines are, in one sentence under the side-by-side table."""
    features = f"{baselines.size}x{baselines.size} {'grey' if baselines.grey else 'RGB'} pixels"
    note = "" if baselines.linear_converged else " (the solver stopped at its iteration limit)"
    return (
        f"Baselines, fit on {baselines.train_count} train images: majority class `{baselines.majority_label}`; "
        f"linear = standardised logistic regression on {features}, {baselines.linear_seconds:.1f} s{note}. "
        "The candidate's accuracy must reach each plus the margin (capped at 1)."
    )


def _macro_f1(evaluation: Evaluation) -> float:
    present = [c.f1 for c in evaluation.per_class if c.support > 0]
    return sum(present) / len(present) if present else 0.0


def per_class_table(evaluations: Sequence[Evaluation]) -> str:
    headers = ["class", "support"]
    for e in evaluations:
        headers += [f"{e.role} precision", f"{e.role} recall", f"{e.role} F1"]
    rows = []
    for index, label in enumerate(evaluations[0].axis):
        row: list[object] = [label, evaluations[0].per_class[index].support]
        for e in evaluations:
            c = e.per_class[index]
            row += [f"{c.precision:.3f}", f"{c.recall:.3f}", f"{c.f1:.3f}"]
        rows.append(row)
    return markdown_table(headers, rows)


def confusion_table(evaluation: Evaluation) -> str:
    rows = [[f"**{label}**", *row] for label, row in zip(evaluation.axis, evaluation.confusion, strict=True)]
    return markdown_table(["true \\ predicted", *evaluation.axis], rows)


def eval_markdown(
    verdict: GateVerdict,
    evaluations: Sequence[Evaluation],
    *,
    context: str,
    images: Mapping[str, str],
    baselines: Baselines | None = None,
) -> str:
    """The gate report: verdict, side-by-side table (with the baselines), per-class scores, confusion
    matrices, plot links."""
    parts = [verdict_markdown(verdict, context=context), "## Side by side\n", comparison_table(evaluations, baselines)]
    if baselines is not None:
        parts.append("\n" + baselines_line(baselines))
    parts += ["\n## Per class\n", per_class_table(evaluations)]
    for name, url in images.items():
        parts.append(f"\n![{name}]({url})\n")
    for evaluation in evaluations:
        parts += [
            f"\n### Confusion matrix: {evaluation.role} `{evaluation.model_version}`\n",
            confusion_table(evaluation),
        ]
    return "\n".join(parts) + "\n"


def confusion_png(evaluations: Sequence[Evaluation]) -> bytes:
    """Row-normalised confusion matrices side by side, counts written in each cell."""
    import numpy as np

    plt = _pyplot()
    axis = evaluations[0].axis
    size = max(3.5, 0.6 * len(axis) + 2)
    fig, panels = plt.subplots(1, len(evaluations), figsize=(size * len(evaluations), size), squeeze=False)
    for panel, evaluation in zip(panels[0], evaluations, strict=True):
        counts = np.asarray(evaluation.confusion, dtype=float)
        rates = counts / np.maximum(counts.sum(axis=1, keepdims=True), 1)
        panel.imshow(rates, cmap="Blues", vmin=0, vmax=1)
        for (row, col), value in np.ndenumerate(counts):
            colour = "white" if rates[row, col] > 0.5 else "black"
            panel.text(col, row, str(int(value)), ha="center", va="center", color=colour, fontsize=9)
        panel.set_xticks(range(len(axis)), axis, rotation=45, ha="right")
        panel.set_yticks(range(len(axis)), axis)
        panel.set_xlabel("predicted")
        panel.set_ylabel("true")
        panel.set_title(
            f"{evaluation.role}\n{evaluation.model_version}\naccuracy {evaluation.accuracy:.3f}", fontsize=9
        )
    return _png(fig)


def calibration_png(evaluations: Sequence[Evaluation]) -> bytes:
    """Reliability diagram: accuracy against mean confidence per bin; the diagonal is perfect calibration."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(5, 5))
    ax.plot([0, 1], [0, 1], linestyle="--", color="grey", linewidth=1, label="perfectly calibrated")
    for evaluation in evaluations:
        points = [
            (b.confidence, b.accuracy) for b in evaluation.calibration if b.count and not math.isnan(b.confidence)
        ]
        if points:
            xs, ys = zip(*points, strict=True)
            ax.plot(xs, ys, marker="o", label=f"{evaluation.role} (ECE {evaluation.ece:.3f})")
    ax.set_xlim(0, 1)
    ax.set_ylim(0, 1)
    ax.set_xlabel("confidence (top-1 probability)")
    ax.set_ylabel("accuracy")
    ax.legend(loc="upper left", fontsize=8)
    return _png(fig)


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # headless: flow runs have no display
    import matplotlib.pyplot as plt

    return plt


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    return buffer.getvalue()


def model_card(
    *,
    model_name: str,
    candidate: Evaluation,
    champion: Evaluation | None,
    verdict: GateVerdict,
    lineage: Mapping[str, str],
    dataset: str,
    environment: Mapping[str, Any],
    intended_use: str,
    labels: Sequence[str],
    train_images: int | None = None,
    baselines: Baselines | None = None,
) -> str:
    """``model_card.md``: what the model is, what it was trained and judged on, how well, and its limits."""
    evaluations = [candidate] if champion is None else [candidate, champion]
    facts = markdown_table(
        ["what", "value"],
        [
            ["model", f"`{model_name}` `{candidate.model_version}`"],
            ["dataset", f"`{dataset}`"],
            ["data version", f"`{lineage.get('sluicegate.data_version', '-')}`"],
            ["code version", f"`{lineage.get('sluicegate.code_version', '-')}`"],
            ["MLflow run", f"`{lineage.get('sluicegate.mlflow_run_id', '-')}`"],
            ["pipeline run", f"`{lineage.get('sluicegate.pipeline_run_id', '-')}`"],
            ["classes", ", ".join(labels)],
            ["training images", "-" if train_images is None else train_images],
            ["evaluation gate", "passed" if verdict.passed else f"FAILED: {verdict.reason()}"],
        ],
    )
    env_rows = [[key, f"`{value}`"] for key, value in sorted(environment.items()) if not isinstance(value, dict | list)]
    return "\n".join(
        [
            f"# Model card: {model_name} {candidate.model_version}\n",
            facts,
            "\n## Intended use\n",
            intended_use,
            "\n## Metrics (test split of the data version above)\n",
            comparison_table(evaluations, baselines),
            *([] if baselines is None else ["\n" + baselines_line(baselines)]),
            "\n### Per class\n",
            per_class_table(evaluations),
            "\n## Limitations\n",
            "\n".join(f"- {line}" for line in limitations(candidate, labels)),
            "\n## Environment\n",
            markdown_table(["component", "version"], env_rows) if env_rows else "-",
            "",
        ]
    )


def limitations(candidate: Evaluation, labels: Sequence[str], weak_recall: float = 0.8) -> list[str]:
    """What the numbers say this model should not be trusted with, plus the standing caveats."""
    lines = [
        f"Measured on {candidate.samples} test images of one data version; performance on other boards, "
        "cameras or lighting is unknown until the drift monitor and a canary have seen them.",
        f"Only the classes {', '.join(labels)} exist: any other defect is forced into one of them.",
    ]
    weak = [c for c in candidate.per_class if c.support and c.recall < weak_recall]
    if weak:
        detail = ", ".join(f"{c.label} (recall {c.recall:.2f}, {c.support} images)" for c in weak)
        lines.append(f"Classes below {weak_recall:.0%} recall on the test split: {detail}.")
    small = [c for c in candidate.per_class if 0 < c.support < 30]
    if small:
        lines.append(
            "Fewer than 30 test images for "
            + ", ".join(c.label for c in small)
            + ": those per-class figures have wide confidence intervals."
        )
    if candidate.unknown_label_samples:
        lines.append(
            f"{candidate.unknown_label_samples} test images carry labels the model has no output for "
            "(counted as errors)."
        )
    confidence = "over" if _overconfident(candidate) else "under"
    lines.append(
        f"Expected calibration error {candidate.ece:.3f} (the model is mostly {confidence}confident): "
        "do not read its probabilities as frequencies without recalibrating."
    )
    lines.append(
        f"Latency was measured with {candidate.runtime} on {', '.join(candidate.providers)}; other hardware differs."
    )
    return lines


def _overconfident(evaluation: Evaluation) -> bool:
    gap = sum(b.count * (b.confidence - b.accuracy) for b in evaluation.calibration if b.count)
    return gap > 0
