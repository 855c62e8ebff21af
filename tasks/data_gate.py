"""Gate 1, the data gate: Great Expectations (GX Core 1.x) over the manifest joined with image statistics.

The frame GX validates has one row per manifest row and columns derived from the image statistics
(decodable, size, leaked, sha256_ok), so every DESIGN section 5 check is a stock expectation whose
result (observed value, unexpected rows) GX reports itself.
"""

from __future__ import annotations

import io
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluicegate.errors import DatasetError
from sluicegate.settings import DataGateSettings
from tasks.image_stats import ImageStats
from tasks.verdicts import Check, GateVerdict

if TYPE_CHECKING:
    import pandas as pd

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class LabelReference:
    """The label distribution a new dataset is compared with, and where it came from."""

    weights: dict[str, float]
    source: str  # e.g. "champion v1.0.0-3f2a1bc-9d0e4f1 (train split)", "settings", "uniform over labels seen"
    closed: bool  # True: labels outside `weights` are unknown labels

    @classmethod
    def from_labels(cls, labels: Sequence[str], source: str) -> LabelReference:
        counts = Counter(label for label in labels if label)
        total = sum(counts.values())
        if total == 0:
            raise DatasetError(f"label reference from {source} has no labels")
        return cls({label: count / total for label, count in sorted(counts.items())}, source, closed=True)


def reference_for(
    manifest: pd.DataFrame, champion: LabelReference | None, settings: DataGateSettings
) -> LabelReference:
    """The champion's training labels when there is a champion, else the configured labels, else uniform."""
    if champion is not None:
        return champion
    if settings.labels:
        return LabelReference({label: 1 / len(settings.labels) for label in settings.labels}, "settings", closed=True)
    seen = sorted({label for label in manifest["label"].dropna() if label})
    if not seen:
        return LabelReference({}, "no labels in the manifest", closed=False)
    return LabelReference({label: 1 / len(seen) for label in seen}, "uniform over the labels seen", closed=False)


def read_manifest_frame(manifest: bytes) -> pd.DataFrame:
    """The manifest as strings, empty cells as missing (not the string 'nan')."""
    import pandas as pd

    frame = pd.read_csv(io.BytesIO(manifest), dtype=str, keep_default_na=False, skipinitialspace=True)
    frame.columns = [column.strip() for column in frame.columns]
    missing = [column for column in ("path", "label", "split") if column not in frame.columns]
    if missing:
        raise DatasetError(f"manifest.csv lacks column(s) {', '.join(missing)}; its header must be 'path,label,split'")
    # Object columns holding None for empty cells: pandas' string dtype would turn None into NaN, a
    # float, and mix types in a column GX compares against a set of strings.
    cleaned = {column: [(value.strip() or None) for value in frame[column]] for column in frame.columns}
    return pd.DataFrame({column: pd.Series(values, dtype=object) for column, values in cleaned.items()})


def gate_frame(manifest: pd.DataFrame, stats: Sequence[ImageStats], reference: LabelReference) -> pd.DataFrame:
    """The frame GX validates: manifest rows plus the per-image facts each expectation reads."""
    by_path = {s.path: s for s in stats}
    frame = manifest.copy()
    frame["decodable"] = [bool(by_path[p].decodable) if p in by_path else False for p in frame["path"]]
    # Undecodable images are counted by their own check, not again as an odd size.
    frame["size"] = [by_path[p].size if p in by_path and by_path[p].decodable else None for p in frame["path"]]
    content = [by_path[p].sha256 if p in by_path else None for p in frame["path"]]
    frame["content_sha256"] = content
    train = {h for h, split in zip(content, frame["split"], strict=True) if h and split == "train"}
    test = {h for h, split in zip(content, frame["split"], strict=True) if h and split == "test"}
    leaked = train & test
    frame["leaked"] = [bool(h in leaked) for h in content]
    if "sha256" in frame.columns:
        frame["sha256_ok"] = [
            None if declared is None else bool(declared.lower() == actual)
            for declared, actual in zip(frame["sha256"], content, strict=True)
        ]
    # The distribution check sees only labels the reference knows: unknown labels and missing labels
    # have checks of their own, and one defect should fail one check.
    known = set(reference.weights)
    frame["label_in_reference"] = [label if label in known else None for label in frame["label"]]
    return frame


def _expectations(
    frame: pd.DataFrame, reference: LabelReference, settings: DataGateSettings
) -> list[tuple[str, Any, str]]:
    """(check name, GX expectation, threshold text) in report order: the manifest's, then the images'.

    Each check's observed value is the fraction of offending rows (the KL divergence for the label
    distribution), and the threshold text is written about that same quantity.
    """
    return _manifest_expectations(reference, settings) + _image_expectations(frame, settings)


def _manifest_expectations(reference: LabelReference, settings: DataGateSettings) -> list[tuple[str, Any, str]]:
    """Labels and splits: present, in their sets, and labels distributed like the reference."""
    import great_expectations.expectations as gxe

    present = 1.0 - settings.max_missing_fraction
    out: list[tuple[str, Any, str]] = [
        (
            "label present",
            gxe.ExpectColumnValuesToNotBeNull(column="label", mostly=present),
            f"missing <= {settings.max_missing_fraction:g}",
        ),
        (
            "split present",
            gxe.ExpectColumnValuesToNotBeNull(column="split", mostly=present),
            f"missing <= {settings.max_missing_fraction:g}",
        ),
        (
            "split values",
            gxe.ExpectColumnValuesToBeInSet(column="split", value_set=list(SPLITS)),
            "== 0 outside {train, val, test}",
        ),
    ]
    if reference.closed:
        out.append(
            (
                "known labels",
                gxe.ExpectColumnValuesToBeInSet(column="label", value_set=sorted(reference.weights)),
                "== 0 outside {" + ", ".join(sorted(reference.weights)) + "}",
            )
        )
    if reference.weights:
        partition = {"values": list(reference.weights), "weights": list(reference.weights.values())}
        out.append(
            (
                "label distribution",
                gxe.ExpectColumnKLDivergenceToBeLessThan(
                    column="label_in_reference", partition_object=partition, threshold=settings.max_label_kl
                ),
                f"KL <= {settings.max_label_kl:g}",
            )
        )
    return out


def _image_expectations(frame: pd.DataFrame, settings: DataGateSettings) -> list[tuple[str, Any, str]]:
    """The images: they decode, share one size, do not leak from train into test, match their sha256."""
    import great_expectations.expectations as gxe

    sizes = frame["size"].dropna()
    common = sizes.mode().iloc[0] if not sizes.empty else "none"
    out: list[tuple[str, Any, str]] = [
        (
            "images decode",
            gxe.ExpectColumnValuesToBeInSet(column="decodable", value_set=[True]),
            "== 0 undecodable or missing",
        ),
        (
            "one image size",
            gxe.ExpectColumnValuesToBeInSet(column="size", value_set=[common], mostly=settings.min_same_size_fraction),
            f"<= {1 - settings.min_same_size_fraction:.2g} not {common}",
        ),
        (
            "no train/test leakage",
            gxe.ExpectColumnValuesToBeInSet(column="leaked", value_set=[False]),
            "== 0 in both train and test",
        ),
    ]
    if "sha256_ok" in frame.columns:
        out.append(
            (
                "manifest sha256 matches",
                gxe.ExpectColumnValuesToBeInSet(column="sha256_ok", value_set=[True]),
                "== 0 mismatched",
            )
        )
    return out


def _observed(kind: str, result: Mapping[str, Any]) -> float | None:
    if "observed_value" in result:
        value = result["observed_value"]
        return None if value is None else float(value)
    if kind == "expect_column_values_to_not_be_null":
        return float(result.get("unexpected_percent") or 0.0) / 100
    if "unexpected_percent" in result:
        return float(result.get("unexpected_percent") or 0.0) / 100
    return None


def _examples(result: Mapping[str, Any], frame: pd.DataFrame, limit: int = 3) -> str:
    indices = result.get("unexpected_index_list") or []
    rows = [frame.iloc[int(i)]["path"] for i in indices[:limit] if isinstance(i, int | float)]
    values = result.get("partial_unexpected_list") or []
    shown = ", ".join(str(r) for r in rows) or ", ".join(str(v) for v in values[:limit])
    count = result.get("unexpected_count")
    return f"{count} rows, e.g. {shown}" if count and shown else ""


def run_data_gate(
    manifest: bytes, stats: Sequence[ImageStats], champion: LabelReference | None, settings: DataGateSettings
) -> tuple[GateVerdict, dict[str, Any]]:
    """Validate a dataset version; returns the verdict and GX's validation result (JSON-able).

    Raises:
        DatasetError: the manifest cannot be read as the contract's CSV at all.
    """
    import great_expectations as gx
    from great_expectations.data_context.types.base import ProgressBarsConfig

    manifest_frame = read_manifest_frame(manifest)
    reference = reference_for(manifest_frame, champion, settings)
    frame = gate_frame(manifest_frame, stats, reference)
    expectations = _expectations(frame, reference, settings)

    context = gx.get_context(mode="ephemeral")
    context.variables.progress_bars = ProgressBarsConfig(globally=False)
    batch = (
        context.data_sources.add_pandas("dataset")
        .add_dataframe_asset("manifest")
        .add_batch_definition_whole_dataframe("dataset version")
    )
    suite = context.suites.add(gx.ExpectationSuite(name="sluicegate data gate"))
    for _, expectation, _ in expectations:
        suite.add_expectation(expectation)
    validation = context.validation_definitions.add(gx.ValidationDefinition(name="data gate", data=batch, suite=suite))
    checkpoint = context.checkpoints.add(
        gx.Checkpoint(
            name="data gate", validation_definitions=[validation], result_format={"result_format": "COMPLETE"}
        )
    )
    outcome = checkpoint.run(batch_parameters={"dataframe": frame})
    [validation_result] = list(outcome.run_results.values())
    by_id = {str(r.expectation_config.id): r for r in validation_result.results}
    checks = []
    for name, expectation, threshold in expectations:
        result = by_id[str(expectation.id)]
        observed = _observed(result.expectation_config.type, result.result)
        checks.append(
            Check(
                name=name,
                observed=round(observed, 6) if observed is not None and math.isfinite(observed) else observed,
                threshold=threshold,
                passed=bool(result.success),
                detail="" if result.success else _examples(result.result, frame),
            )
        )
    label_counts = Counter(label for label in manifest_frame["label"] if label)
    metrics = {
        "rows": len(frame),
        "images_decodable": int(frame["decodable"].sum()),
        "labels": dict(sorted(label_counts.items())),
        "splits": dict(sorted(Counter(s for s in manifest_frame["split"] if s).items())),
        "reference": {"source": reference.source, "weights": reference.weights},
    }
    return GateVerdict("data", tuple(checks), metrics), validation_result.to_json_dict()
