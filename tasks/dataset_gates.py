"""Gates 1 and 2 composed once, for the pipeline and the CLI alike: read the dataset through its source,
compare with the champion's references, return the verdict.

The gate logic itself is ``data_gate`` (Great Expectations over manifest and image statistics) and
``feature_gate`` (old vs new preprocessing); this module decides what they are fed: which images, which
sample, which reference. The flow publishes and enforces; the CLI prints.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sluicegate.settings import FeatureGateSettings, Settings
from tasks.datasets import manifest_paths
from tasks.verdicts import GateVerdict

if TYPE_CHECKING:
    import numpy as np

    from serving.preprocessing import PreprocessSpec
    from tasks.champion import Champion
    from tasks.dataset_source import DatasetSource


@dataclass(frozen=True)
class DataShape:
    """What a dataset version's images look like: a first model's input is made to fit them."""

    width: int
    height: int
    grey: bool  # every decodable image has one channel (or equal ones)


@dataclass(frozen=True)
class DataGateOutcome:
    verdict: GateVerdict
    validation: dict[str, Any]  # Great Expectations' result, kept as evidence
    baseline: dict[str, Any]  # per-channel statistics: the served model's drift baseline
    shape: DataShape | None  # None when no image decodes (the gate has failed then)


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
    from tasks.image_stats import channel_baseline, collect_stats, common_size, is_grey

    stats = collect_stats(
        source, manifest_paths(manifest), concurrency=settings.data_gate.read_concurrency, on_image=on_image
    )
    reference = champion_labels(settings.mlflow.url, champion) if champion is not None else None
    verdict, validation = run_data_gate(manifest, stats, reference, settings.data_gate)
    size = common_size(stats)
    shape = DataShape(size[0], size[1], is_grey(stats)) if size is not None else None
    return DataGateOutcome(verdict, validation, channel_baseline(stats), shape)


def sampled_paths(manifest: bytes, rules: FeatureGateSettings) -> list[str]:
    """The images the feature gate compares: a seeded sample of the manifest's distinct paths, so the same
    version gives the same sample in the pipeline and on the command line."""
    from tasks.feature_gate import sample_indices

    paths = sorted(set(manifest_paths(manifest)))
    return [paths[i] for i in sample_indices(len(paths), rules.sample_size, rules.seed)]


# ImageNet's statistics: reasonable for photographs, and what torchvision-trained users expect.
RGB_MEAN, RGB_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
# The same statistics through the luma weights the grey conversion uses.
GREY_MEAN, GREY_STD = (0.449,), (0.226,)


def fit_size(width: int, height: int, cap: int) -> tuple[int, int]:
    """(height, width) of an image shrunk to fit ``cap`` on its longer side, aspect kept; never enlarged."""
    scale = min(1.0, cap / max(width, height))
    return max(1, round(height * scale)), max(1, round(width * scale))


def candidate_spec(settings: Settings, *, champion: PreprocessSpec | None, data: DataShape | None) -> PreprocessSpec:
    """The preprocessing a model trained now is trained and served with.

    Field by field: what the settings (or the model's spec) pin; else the champion's, so a model keeps
    its input across versions; else, for a model's first version, what fits the data (its most common
    image size shrunk to ``max_size``, one grey channel when every image is grey); else the defaults.
    """
    from serving.preprocessing import PreprocessSpec

    p = settings.preprocessing
    colour = p.colour or (champion.colour if champion is not None else None)
    colour = colour or ("L" if data is not None and data.grey else "RGB")
    if champion is not None:
        height, width = champion.height, champion.width
    elif data is not None:
        height, width = fit_size(data.width, data.height, p.max_size)
    else:
        height, width = p.max_size, p.max_size
    same_channels = champion is not None and (champion.colour == "L") == (colour == "L")
    default_mean, default_std = (GREY_MEAN, GREY_STD) if colour == "L" else (RGB_MEAN, RGB_STD)
    mean = p.mean or (champion.mean if champion is not None and same_channels else default_mean)
    std = p.std or (champion.std if champion is not None and same_channels else default_std)
    return PreprocessSpec(
        height=p.height or height, width=p.width or width, colour=colour, mean=tuple(mean), std=tuple(std)
    )


def champion_spec(settings: Settings, champion: Champion | None) -> PreprocessSpec | None:
    """The preprocessing the champion was trained and is served with, as its run recorded it."""
    from serving.preprocessing import PreprocessSpec
    from tasks.champion import champion_preprocessing

    recorded = champion_preprocessing(settings.mlflow.url, champion) if champion is not None else None
    return PreprocessSpec.from_dict(recorded) if recorded else None


def shape_of(images: Sequence[np.ndarray]) -> DataShape | None:
    """The shape of decoded RGB images: the most common size, grey when every image has R == G == B."""
    if not images:
        return None
    (height, width), _ = Counter(image.shape[:2] for image in images).most_common(1)[0]
    grey = all(
        bool((image[..., 0] == image[..., 1]).all() and (image[..., 1] == image[..., 2]).all()) for image in images
    )
    return DataShape(int(width), int(height), grey)


def check_features(
    settings: Settings,
    source: DatasetSource,
    manifest: bytes,
    *,
    reference: PreprocessSpec | None,
    candidate: PreprocessSpec | None = None,
    follow_reference: bool = True,
) -> GateVerdict:
    """The feature gate: ``reference`` preprocessing (the champion's) vs ``candidate`` on the sample.

    ``candidate`` None: the one ``candidate_spec`` chooses with the sample's shape (the command line,
    which has not read every image as the pipeline's data gate has), keeping the reference's fields
    unless the settings pin them when ``follow_reference`` (the reference is the champion), or as a
    first model would get it (the reference is any spec a user compares with).
    """
    from tasks.feature_gate import feature_gate
    from tasks.image_stats import load_images

    rules = settings.feature_gate
    images = load_images(source, sampled_paths(manifest, rules), concurrency=settings.data_gate.read_concurrency)
    if candidate is None:
        champion = reference if follow_reference else None
        candidate = candidate_spec(settings, champion=champion, data=shape_of(images))
    return feature_gate(images, reference, candidate, percentile=rules.percentile, min_cosine=rules.min_cosine)
