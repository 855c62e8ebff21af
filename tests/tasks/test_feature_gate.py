"""The feature gate on real images: random noise plus structured ones (gradients, checkerboards), 64..200 px."""

from __future__ import annotations

import numpy as np
import pytest

from serving.preprocessing import PreprocessSpec, preprocess
from tasks.feature_gate import CHUNK, feature_gate, sample_indices

BASE = PreprocessSpec()


def noise(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)


def gradient(height: int, width: int) -> np.ndarray:
    rows = np.linspace(0, 255, height)[:, None] * np.ones((1, width))
    cols = np.ones((height, 1)) * np.linspace(0, 255, width)[None, :]
    return np.stack([rows, cols, (rows + cols) / 2], axis=-1).astype(np.uint8)


def checkerboard(height: int, width: int, cell: int) -> np.ndarray:
    yy, xx = np.mgrid[:height, :width]
    on = ((yy // cell + xx // cell) % 2) * 255
    return np.stack([on, 255 - on, np.full_like(on, 60)], axis=-1).astype(np.uint8)


@pytest.fixture
def images() -> list[np.ndarray]:
    return [
        noise(64, 64, 0),
        noise(100, 80, 1),
        noise(200, 150, 2),
        gradient(64, 64),
        gradient(120, 200),
        checkerboard(96, 96, 8),
        checkerboard(200, 200, 5),
    ]


def nearest_candidate(chunk: list[np.ndarray]) -> np.ndarray:
    """A candidate implementation under test: nearest-neighbour resize instead of bilinear, same normalisation."""
    resized = []
    for image in chunk:
        rows = np.arange(BASE.height) * image.shape[0] // BASE.height
        cols = np.arange(BASE.width) * image.shape[1] // BASE.width
        resized.append(image[rows][:, cols])
    return preprocess(np.stack(resized), BASE)


def test_identical_specs_pass_with_cosine_one(images: list[np.ndarray]) -> None:
    verdict = feature_gate(images, BASE, PreprocessSpec())
    assert verdict.passed, verdict.reason()
    (check,) = verdict.checks
    assert check.name == "cosine p5" and check.threshold == ">= 0.999"
    assert check.observed == pytest.approx(1.0, abs=1e-12)
    assert verdict.gate == "feature"
    assert verdict.metrics["count"] == len(images)
    assert verdict.metrics["cosine_min"] == pytest.approx(1.0, abs=1e-12)
    assert verdict.metrics["champion_spec"] == verdict.metrics["candidate_spec"] == BASE.to_dict()


def test_a_shifted_mean_fails(images: list[np.ndarray]) -> None:
    # Cosine ignores length but not direction. Shifting the mean by 0.05 (in [0, 1] units) adds the same
    # constant to every value of a channel; relative to features of size ~1 that turns the vector
    # clearly (measured p5 ~0.968), which is the point: the model would see offset inputs.
    shifted = PreprocessSpec(mean=(0.535, 0.506, 0.456))
    verdict = feature_gate(images, BASE, shifted)
    assert not verdict.passed
    assert verdict.checks[0].observed < 0.99
    assert "images below 0.999; lowest: image" in verdict.checks[0].detail


def test_a_different_normalisation_fails(images: list[np.ndarray]) -> None:
    # mean=std=0.5 maps [0, 1] to [-1, 1]: per channel that is a different scale *and* shift than
    # ImageNet's, so the direction changes (measured p5 ~0.953), unlike a pure rescale (next test).
    verdict = feature_gate(images, BASE, PreprocessSpec(mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5)))
    assert not verdict.passed
    assert verdict.checks[0].observed < 0.99


def test_a_uniform_rescale_is_invisible_to_cosine(images: list[np.ndarray]) -> None:
    # Doubling std on every channel halves every feature: same direction, cosine 1. This documents the
    # gate's blind spot (DESIGN defines it by cosine); the eval gate sees what such a change does to accuracy.
    doubled = PreprocessSpec(std=tuple(2 * s for s in BASE.std))
    verdict = feature_gate(images, BASE, doubled)
    assert verdict.passed
    assert verdict.checks[0].observed == pytest.approx(1.0, abs=1e-12)


def test_bgr_against_rgb_fails(images: list[np.ndarray]) -> None:
    verdict = feature_gate(images, BASE, PreprocessSpec(colour="BGR"))
    assert not verdict.passed
    assert verdict.checks[0].observed < 0.9
    assert verdict.reason().startswith("feature gate failed: cosine p5 observed ")


def test_a_changed_interpolation_fails(images: list[np.ndarray]) -> None:
    verdict = feature_gate(images, BASE, BASE, candidate_fn=nearest_candidate)
    assert not verdict.passed
    assert verdict.metrics["candidate_fn"] == "nearest_candidate"
    assert verdict.checks[0].observed < 0.5  # measured ~0.12: noise and fine checkerboards alias badly
    # A 64x64 image is not resized at all, so on it alone the two implementations agree.
    assert feature_gate([gradient(64, 64)], BASE, BASE, candidate_fn=nearest_candidate).passed


def test_a_faithful_candidate_implementation_passes(images: list[np.ndarray]) -> None:
    verdict = feature_gate(images, BASE, BASE, candidate_fn=lambda chunk: preprocess(chunk, BASE))
    assert verdict.passed, verdict.reason()


def test_different_output_sizes_fail_on_shape(images: list[np.ndarray]) -> None:
    verdict = feature_gate(images, BASE, PreprocessSpec(height=96, width=96))
    assert not verdict.passed
    (check,) = verdict.checks
    assert check.name == "output shape"
    assert "(3, 64, 64)" in check.detail and "(3, 96, 96)" in check.detail
    assert "cosine_min" not in verdict.metrics  # nothing was computed


def test_a_candidate_implementation_of_another_shape_fails_on_shape(images: list[np.ndarray]) -> None:
    verdict = feature_gate(images, BASE, BASE, candidate_fn=lambda chunk: preprocess(chunk, PreprocessSpec(width=32)))
    assert [c.name for c in verdict.checks] == ["output shape"]
    assert "(3, 64, 32)" in verdict.checks[0].detail


GREY = PreprocessSpec(colour="L", mean=(0.45,), std=(0.225,))


@pytest.mark.parametrize(
    ("champion", "candidate", "counts"),
    [
        (BASE, GREY, "has 1 channel(s) (colour 'L'), the champion's 3 (colour 'RGB')"),
        (GREY, PreprocessSpec(colour="BGR"), "has 3 channel(s) (colour 'BGR'), the champion's 1 (colour 'L')"),
    ],
    ids=["grey-candidate", "grey-champion"],
)
def test_specs_of_different_channel_counts_are_not_comparable(
    images: list[np.ndarray], champion: PreprocessSpec, candidate: PreprocessSpec, counts: str
) -> None:
    verdict = feature_gate(images, champion, candidate)
    assert not verdict.passed
    (check,) = verdict.checks
    assert check.name == "channels"
    assert f"the candidate's preprocessing {counts}: their features are not comparable" in check.detail
    assert "a new model; push it under a new dataset name, or set its model spec's preprocessing.colour" in (
        check.detail
    )
    assert f"preprocessing.colour to {champion.colour!r}" in check.detail
    assert verdict.reason().startswith("feature gate failed: channels observed candidate ")
    assert "cosine_min" not in verdict.metrics  # nothing was computed
    assert verdict.metrics["candidate_spec"] == candidate.to_dict()
    # Even a candidate implementation under test cannot make the two comparable.
    assert feature_gate(images, champion, candidate, candidate_fn=lambda c: preprocess(c, champion)).checks == (check,)


def test_grey_specs_are_compared_like_any_other(images: list[np.ndarray]) -> None:
    assert feature_gate(images, GREY, PreprocessSpec(colour="L", mean=(0.45,), std=(0.225,))).passed
    shifted = feature_gate(images, GREY, PreprocessSpec(colour="L", mean=(0.6,), std=(0.225,)))
    assert not shifted.passed and shifted.checks[0].name == "cosine p5"
    resized = feature_gate(images, GREY, PreprocessSpec(height=32, colour="L", mean=(0.45,), std=(0.225,)))
    assert resized.checks[0].name == "output shape" and "(1, 64, 64)" in resized.checks[0].detail


def test_the_first_model_passes_and_is_recorded(images: list[np.ndarray]) -> None:
    verdict = feature_gate(images, None, BASE)
    assert verdict.passed
    (check,) = verdict.checks
    assert (check.name, check.observed, check.threshold, check.passed) == ("first model", "no champion", "-", True)
    assert verdict.metrics["candidate_spec"] == BASE.to_dict()


def test_an_empty_sample_fails_rather_than_passing_silently() -> None:
    verdict = feature_gate([], BASE, BASE)
    assert not verdict.passed
    assert verdict.checks[0].name == "sample size"


def test_cosines_span_chunks_and_the_worst_image_is_named() -> None:
    # 64x64 images are identical under both resizes; one large noise image past the first chunk is not.
    images = [gradient(64, 64)] * (CHUNK + 40)
    images[CHUNK + 10] = noise(200, 200, 7)
    verdict = feature_gate(images, BASE, BASE, candidate_fn=nearest_candidate, percentile=0.0)
    assert verdict.metrics["count"] == CHUNK + 40
    assert not verdict.passed
    assert verdict.checks[0].name == "cosine p0"
    assert f"1 of {CHUNK + 40} images below 0.999; lowest: image {CHUNK + 10} (" in verdict.checks[0].detail
    # At the default 5th percentile one bad image in 104 does not move the gate.
    assert feature_gate(images, BASE, BASE, candidate_fn=nearest_candidate).passed


def test_settings_out_of_range_are_refused(images: list[np.ndarray]) -> None:
    with pytest.raises(ValueError, match=r"percentile must be in \[0, 100\], got 101"):
        feature_gate(images, BASE, BASE, percentile=101)
    with pytest.raises(ValueError, match=r"min_cosine must be in \[-1, 1\], got 2"):
        feature_gate(images, BASE, BASE, min_cosine=2)


def test_sample_indices_are_deterministic_distinct_and_bounded() -> None:
    first = sample_indices(10_000, 1000, seed=42)
    assert first == sample_indices(10_000, 1000, seed=42)
    assert len(first) == len(set(first)) == 1000
    assert first == sorted(first) and first[0] >= 0 and first[-1] < 10_000
    assert first != sample_indices(10_000, 1000, seed=43)
    assert set(sample_indices(10_000, 500, seed=42)) <= set(first)  # a smaller sample is part of a larger one
    assert sample_indices(5, 1000, seed=42) == [0, 1, 2, 3, 4]
    assert sample_indices(0, 10, seed=1) == []
    with pytest.raises(ValueError, match="n >= 0 and k >= 0"):
        sample_indices(-1, 3, seed=0)
