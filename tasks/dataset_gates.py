"""Gates 1 and 2 composed once, for the pipeline and the CLI alike: read the dataset through its source,
compare with the champion's references, return the verdict.

The gate logic itself is ``data_gate`` (Great Expectations over manifest and image statistics) and
``feature_gate`` (old vs new preprocessing); this module decides what they are fed: which images, which
sample, which reference. The flow publishes and enforces; the CLI prints.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluicegate.settings import FeatureGateSettings, Settings
from tasks.datasets import manifest_paths
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    from serving.preprocessing import PreprocessSpec
    from tasks.champion import Champion
    from tasks.dataset_source import DatasetSource


@dataclass(frozen=True)
class DataGateOutcome:
    verdict: GateVerdict
    validation: dict[str, Any]  # Great Expectations' result, kept as evidence
    baseline: dict[str, Any]  # per-channel statistics: the served model's drift baseline


def check_data(
    settings: Settings,
    source: DatasetSource,
    manifest: bytes,
    *,
    champion: Champion | None,
    on_image: Callable[[Any], None] | None = None,
) -> DataGateOutcome:
    """The data gate on every image the manifest lists, labels compared with the champion's training split.

    Args:
        settings: platform settings (``data_gate`` thresholds, read concurrency, MLflow URL).
        source: where the version's bytes are read from.
        manifest: the version's manifest bytes.
        champion: the model whose training labels are the reference; None judges without one.
        on_image: called once per image read (progress).
    """
    from tasks.champion import champion_labels
    from tasks.data_gate import run_data_gate
    from tasks.image_stats import channel_baseline, collect_stats

    stats = collect_stats(
        source, manifest_paths(manifest), concurrency=settings.data_gate.read_concurrency, on_image=on_image
    )
    reference = champion_labels(settings.mlflow.url, champion) if champion is not None else None
    verdict, validation = run_data_gate(manifest, stats, reference, settings.data_gate)
    return DataGateOutcome(verdict, validation, channel_baseline(stats))


def sampled_paths(manifest: bytes, rules: FeatureGateSettings) -> list[str]:
    """The images the feature gate compares: a seeded sample of the manifest's distinct paths, so the same
    version gives the same sample in the pipeline and on the command line."""
    from tasks.feature_gate import sample_indices

    paths = sorted(set(manifest_paths(manifest)))
    return [paths[i] for i in sample_indices(len(paths), rules.sample_size, rules.seed)]


def candidate_spec(settings: Settings) -> PreprocessSpec:
    """The preprocessing a model trained now is trained and served with."""
    from tasks.feature_gate import spec_from_settings

    return spec_from_settings(settings.preprocessing)


def champion_spec(settings: Settings, champion: Champion | None) -> PreprocessSpec | None:
    """The preprocessing the champion was trained and is served with, as its run recorded it."""
    from serving.preprocessing import PreprocessSpec
    from tasks.champion import champion_preprocessing

    recorded = champion_preprocessing(settings.mlflow.url, champion) if champion is not None else None
    return PreprocessSpec.from_dict(recorded) if recorded else None


def check_features(
    settings: Settings, source: DatasetSource, manifest: bytes, *, reference: PreprocessSpec | None
) -> GateVerdict:
    """The feature gate: ``reference`` preprocessing (the champion's) vs the candidate's on the sample."""
    from tasks.feature_gate import feature_gate
    from tasks.image_stats import load_images

    rules = settings.feature_gate
    images = load_images(source, sampled_paths(manifest, rules), concurrency=settings.data_gate.read_concurrency)
    return feature_gate(
        images, reference, candidate_spec(settings), percentile=rules.percentile, min_cosine=rules.min_cosine
    )
