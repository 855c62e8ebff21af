"""DriftMonitor and channel_means: the served features match how the training baseline was measured,
a dark stream alarms quickly, and a healthy stream stays quiet (with the multiple-testing story told)."""

from __future__ import annotations

import io
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import numpy.typing as npt
import pytest
from PIL import Image
from scipy.stats import ks_2samp

from serving.observability.drift import (
    DriftMonitor,
    DriftReport,
    baseline_features,
    channel_means,
    ks_two_sample,
    rgb_baseline,
)
from serving.preprocessing import PreprocessSpec, preprocess
from tasks.image_stats import channel_baseline, image_stats

# Per-image channel means of a "training set": brightness varies per image, channels differ.
CENTRES = {"r": 120.0, "g": 110.0, "b": 95.0}
SPREAD = 25.0


def healthy(rng: np.random.Generator, count: int) -> dict[str, npt.NDArray[np.float64]]:
    return {name: np.clip(rng.normal(centre, SPREAD, count), 0, 255) for name, centre in CENTRES.items()}


def baseline(seed: int = 0, size: int = 2000) -> dict[str, list[float]]:
    return {name: values.tolist() for name, values in healthy(np.random.default_rng(seed), size).items()}


def dark(rng: np.random.Generator, count: int) -> dict[str, npt.NDArray[np.float64]]:
    return {name: np.clip(rng.normal(6.0, 2.0, count), 0, 255) for name in CENTRES}


def png(image: npt.NDArray[np.uint8]) -> bytes:
    out = io.BytesIO()
    Image.fromarray(image).save(out, format="PNG")
    return out.getvalue()


def photos(count: int, size: int, seed: int) -> list[npt.NDArray[np.uint8]]:
    """Smooth images (a gradient plus a per-image tint): what a camera sees, unlike per-pixel noise."""
    rng = np.random.default_rng(seed)
    ramp = np.linspace(0, 1, size)[:, None] * np.linspace(0.5, 1, size)[None, :]
    out = []
    for _ in range(count):
        tint = rng.uniform(20, 200, 3)
        image = ramp[..., None] * tint + rng.normal(0, 3, (size, size, 3)) + 20
        out.append(np.clip(image, 0, 255).astype(np.uint8))
    return out


@pytest.mark.parametrize("colour", ["RGB", "BGR"])
@pytest.mark.parametrize(("size", "tolerance"), [(32, 1e-3), (48, 1.0)])
def test_channel_means_match_the_training_baseline_computation(colour: str, size: int, tolerance: float) -> None:
    """Same size: exact; resized 48 -> 32: within a grey level (the baseline is measured before resize)."""
    images = photos(6, size, seed=3)
    spec = PreprocessSpec(height=32, width=32, colour=colour, mean=(0.5, 0.4, 0.3), std=(0.2, 0.25, 0.3))  # type: ignore[arg-type]
    expected = channel_baseline([image_stats(f"{i}.png", png(image)) for i, image in enumerate(images)])
    served = channel_means(preprocess(np.stack(images), spec), spec.to_dict())
    assert set(served) == {"r", "g", "b"}
    for name in ("r", "g", "b"):
        np.testing.assert_allclose(served[name], expected[name], atol=tolerance)


def test_channel_means_refuses_bad_input() -> None:
    spec = PreprocessSpec().to_dict()
    with pytest.raises(ValueError, match=r"\(N, 3, H, W\)"):
        channel_means(np.zeros((2, 4, 8, 8), dtype=np.float32), spec)
    with pytest.raises(ValueError, match="'mean' and 'std'"):
        channel_means(np.zeros((2, 3, 8, 8), dtype=np.float32), {"colour": "RGB"})
    with pytest.raises(ValueError, match="colour"):
        channel_means(np.zeros((2, 3, 8, 8), dtype=np.float32), {**spec, "colour": "HSV"})


def test_rgb_baseline_reads_channel_baseline_and_rejects_other_shapes() -> None:
    assert rgb_baseline({"r": [1, 2], "g": [3.0], "b": [4]}) == {"r": [1.0, 2.0], "g": [3.0], "b": [4.0]}
    assert rgb_baseline({}) is None
    assert rgb_baseline({"channel_means": [0.1, 0.2, 0.3]}) is None
    assert rgb_baseline({"r": [], "g": [1], "b": [1]}) is None


def test_a_dark_stream_alarms_within_300_requests_of_a_full_healthy_window() -> None:
    rng = np.random.default_rng(1)
    monitor = DriftMonitor(baseline())
    for _ in range(1000):
        monitor.observe(healthy(rng, 1))
    assert not monitor.alarm
    alarmed_at = next((n for n in range(1, 301) if monitor.observe(dark(rng, 1)) and monitor.alarm), None)
    assert alarmed_at is not None and alarmed_at <= 300, monitor.report
    assert all(test.statistic > 0.15 and test.p_value < 0.01 for test in monitor.report.features.values())


def test_a_dark_stream_from_the_start_alarms_at_the_first_test() -> None:
    rng = np.random.default_rng(2)
    monitor = DriftMonitor(baseline())
    reports = [report for _ in range(300) if (report := monitor.observe(dark(rng, 1))) is not None]
    assert len(reports) == 1 and reports[0].alarm and reports[0].window_size == 300


def test_dark_tensors_through_channel_means_alarm() -> None:
    spec = PreprocessSpec(height=16, width=16)
    images = photos(400, 16, seed=4)
    monitor = DriftMonitor(channel_baseline([image_stats("x.png", png(image)) for image in images]))
    for start in range(0, 400, 8):  # healthy requests of 8 images
        monitor.observe(channel_means(preprocess(np.stack(images[start : start + 8]), spec), spec.to_dict()))
    assert monitor.report.features and not monitor.alarm
    darkness = np.full((8, 16, 16, 3), 4, dtype=np.uint8)
    for _ in range(40):
        monitor.observe(channel_means(preprocess(darkness, spec), spec.to_dict()))
    assert monitor.alarm


def test_healthy_streams_stay_quiet_though_p_alone_would_alarm() -> None:
    """5,000 in-distribution requests per seed, a test every 100 (about 47 tests x 3 features). The
    p-value alone (ks_threshold=0) trips by chance on several seeds; the default pair never does, and
    the largest KS statistic seen stays far below 0.15 (module docstring: drift.py)."""
    chance_alarms = 0
    largest = 0.0
    for seed in range(6):
        rng = np.random.default_rng(100 + seed)
        reference = baseline(seed=200 + seed)
        monitor = DriftMonitor(reference)
        p_only = DriftMonitor(reference, ks_threshold=0.0)
        tripped = False
        for _ in range(5000):
            features = healthy(rng, 1)
            report = monitor.observe(features)
            tripped |= bool((p_report := p_only.observe(features)) and p_report.alarm)
            assert not monitor.alarm, monitor.report
            if report is not None:
                largest = max(largest, *(test.statistic for test in report.features.values()))
        chance_alarms += tripped
    assert chance_alarms >= 2, "p < 0.01 alone should trip by chance on a healthy stream"
    assert largest < 0.12


def test_the_window_holds_the_latest_values_and_tests_like_scipy() -> None:
    reference = baseline()
    monitor = DriftMonitor(reference, window=250, test_every=50, min_samples=50)
    rng = np.random.default_rng(5)
    sent = [healthy(rng, count) for count in (7, 300, 1, 64, 13, 90, 33)]  # wraps, and one call > window
    report: DriftReport | None = None
    for features in sent:
        report = monitor.observe(features) or report
    assert report is not None and report is monitor.report and report.window_size == 250
    assert monitor.observed == sum(len(f["r"]) for f in sent) == 508
    assert report.observed == 475  # tests at 50, 100, ... whenever a call crosses the next mark
    # The last test ran at the latest crossing; recompute it from the values sent up to then.
    values = {name: np.concatenate([f[name] for f in sent]) for name in CENTRES}
    for name, test in report.features.items():
        window = values[name][: report.observed][-250:]
        expected = ks_2samp(window, reference[name], method="asymp")
        assert test.statistic == pytest.approx(expected.statistic)
        assert test.p_value == pytest.approx(expected.pvalue)


def test_observe_is_thread_safe_and_tests_on_the_executor() -> None:
    reports: list[DriftReport] = []
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="drift") as executor:
        monitor = DriftMonitor(baseline(), executor=executor, on_report=reports.append)

        def send(seed: int) -> None:
            rng = np.random.default_rng(seed)
            for _ in range(500):
                assert monitor.observe(healthy(rng, 2)) is None  # never tested inline with an executor

        threads = [threading.Thread(target=send, args=(seed,)) for seed in range(8)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    assert monitor.observed == 8000
    assert reports and monitor.report in reports
    assert not monitor.alarm


def test_bad_baselines_and_features_are_refused() -> None:
    with pytest.raises(ValueError, match="empty"):
        DriftMonitor({})
    with pytest.raises(ValueError, match="finite"):
        DriftMonitor({"r": [1.0, float("nan")]})
    monitor = DriftMonitor(baseline())
    with pytest.raises(ValueError, match=r"\['b'\] missing"):
        monitor.observe({"r": [1.0], "g": [1.0]})
    with pytest.raises(ValueError, match="disagree"):
        monitor.observe({"r": [1.0], "g": [1.0, 2.0], "b": [1.0]})


@pytest.mark.parametrize(("n", "m", "shift"), [(1000, 1500, 0.0), (300, 80, 0.4), (1, 5, 0.0), (250, 250, 2.0)])
def test_ks_two_sample_is_scipys_asymptotic_test(n: int, m: int, shift: float) -> None:
    rng = np.random.default_rng(n + m)
    sample, reference = rng.normal(shift, 1, n), rng.normal(0, 1, m)
    sample[: n // 10] = np.round(sample[: n // 10], 1)  # ties, which the step functions must count right
    reference[: m // 10] = np.round(reference[: m // 10], 1)
    statistic, p_value = ks_two_sample(sample, np.sort(reference))
    expected = ks_2samp(sample, reference, method="asymp")
    assert statistic == pytest.approx(expected.statistic, abs=1e-12)
    assert p_value == pytest.approx(expected.pvalue, rel=1e-9, abs=1e-300)


def test_grey_means_match_the_luma_of_the_training_baseline() -> None:
    """Colour "L": the one served feature, ``l``, is the per-image mean luma, and baseline_features
    derives the same values from channel_baseline's r/g/b lists (of colour images too)."""
    images = photos(6, 32, seed=5)
    spec = PreprocessSpec(height=32, width=32, colour="L", mean=(0.45,), std=(0.25,))
    stats = [image_stats(f"{i}.png", png(image)) for i, image in enumerate(images)]
    expected = baseline_features(channel_baseline(stats), spec.to_dict())
    assert expected is not None and set(expected) == {"l"}
    served = channel_means(preprocess(np.stack(images), spec), spec.to_dict())
    assert set(served) == {"l"}
    np.testing.assert_allclose(served["l"], expected["l"], atol=1e-3)


def test_baseline_features_follow_the_colour() -> None:
    rgb = {"r": [10.0, 20.0], "g": [30.0, 40.0], "b": [50.0, 60.0]}
    grey = PreprocessSpec(colour="L", mean=(0.5,), std=(0.25,)).to_dict()
    assert baseline_features(rgb, PreprocessSpec().to_dict()) == rgb
    assert baseline_features(rgb, {}) == rgb  # no colour: the 3-channel contract
    luma = baseline_features(rgb, grey)
    assert luma is not None
    np.testing.assert_allclose(luma["l"], [0.299 * 10 + 0.587 * 30 + 0.114 * 50, 0.299 * 20 + 0.587 * 40 + 0.114 * 60])
    assert baseline_features({**rgb, "l": [1, 2, 3]}, grey) == {"l": [1.0, 2.0, 3.0]}  # its own grey sample wins
    assert baseline_features({}, grey) is None
    assert baseline_features({"r": [1.0], "g": [1.0, 2.0], "b": [1.0]}, grey) is None  # not pairable per image


def test_grey_channel_means_refuses_a_batch_of_the_wrong_channels() -> None:
    grey = PreprocessSpec(colour="L", mean=(0.5,), std=(0.25,)).to_dict()
    with pytest.raises(ValueError, match=r"\(N, 1, H, W\) batch for colour L, got shape \(2, 3, 8, 8\)"):
        channel_means(np.zeros((2, 3, 8, 8), dtype=np.float32), grey)
    with pytest.raises(ValueError, match=r"need 1 value\(s\) \(grey\)"):
        channel_means(np.zeros((2, 1, 8, 8), dtype=np.float32), {**grey, "mean": [0.5, 0.5, 0.5]})


def test_tests_are_spaced_by_min_interval_and_a_due_test_runs_after_it() -> None:
    now = [0.0]
    monitor = DriftMonitor(
        baseline(), window=200, test_every=50, min_samples=50, min_interval_s=1.0, clock=lambda: now[0]
    )
    rng = np.random.default_rng(3)
    tested: list[float] = []
    for step in range(40):  # 40 requests of 25 images, 1/8 s apart: by count alone a test every 2 requests
        now[0] = step / 8
        if monitor.observe(healthy(rng, 25)) is not None:
            tested.append(now[0])
    assert tested == [1 / 8, 9 / 8, 17 / 8, 25 / 8, 33 / 8], "one test a second"
    with pytest.raises(ValueError, match="min_interval_s"):
        DriftMonitor(baseline(), min_interval_s=-1.0)


def test_a_window_of_images_per_interval_is_admitted_spread_over_it() -> None:
    now = [0.0]
    monitor = DriftMonitor(baseline(), window=100, min_interval_s=1.0, clock=lambda: now[0])
    admitted = 0
    for step in range(400):  # 8 images every 5 ms: 1,600 images/s for two seconds
        now[0] = step * 0.005
        admitted += 8 * monitor.admit(8)
    # The full window at start, then 100 a second: 300 of 3,200, and the rest counted as skipped.
    assert 290 <= admitted <= 310 and monitor.skipped == 3200 - admitted
    late = []
    for step in range(400, 600):
        now[0] = step * 0.005
        if monitor.admit(8):
            late.append(step)
    gaps = np.diff(late)
    assert gaps.min() >= 15 and gaps.max() <= 17, "one batch of 8 every 80 ms, not a burst per second"
    assert monitor.admit(1000) is False  # larger than the window: only when the bucket is full
    now[0] += 1.0
    assert monitor.admit(1000) is True
    every = DriftMonitor(baseline(), window=100)  # no interval: every image (tests drive drift by count)
    assert all(every.admit(64) for _ in range(100)) and every.skipped == 0


def test_monitors_featurize_only_the_admitted_batches_and_see_every_answer() -> None:
    from serving.observability.entropy import EntropyMonitor
    from serving.observability.metrics import ServerMetrics
    from serving.observability.monitors import VersionMonitors
    from serving.observability.pipeline import TelemetryPipeline

    now = [0.0]
    drift = DriftMonitor(baseline(), window=50, min_samples=10, min_interval_s=1.0, clock=lambda: now[0])
    pipeline = TelemetryPipeline()
    identity = {"colour": "RGB", "mean": [0.0, 0.0, 0.0], "std": [1.0, 1.0, 1.0]}
    monitors = VersionMonitors(
        "m", "1", ServerMetrics(), pipeline, entropy=EntropyMonitor(1000, min_rows=10), logits="y",
        drift=drift, image_input="x", preprocessing=identity,
    )  # fmt: skip
    try:
        for _ in range(20):  # 160 images at one instant: the window's 50 (rounded to whole batches)
            monitors.on_batch({"x": np.full((8, 3, 4, 4), 0.5, dtype=np.float32)}, {"y": np.zeros((8, 2))})
        assert pipeline.flush(10)
    finally:
        pipeline.close()
    assert drift.observed == 48 and drift.skipped == 112
    assert monitors.entropy.state.rows == 160


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_channel_means_equal_the_float64_mean(dtype: type) -> None:
    rng = np.random.default_rng(5)
    batch = rng.normal(0.2, 1.3, (9, 3, 37, 53)).astype(dtype)
    spec = {"colour": "BGR", "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}
    means = channel_means(batch, spec)
    plain = batch.astype(np.float64).mean(axis=(2, 3))
    for channel, name in enumerate(("b", "g", "r")):
        rgb = "rgb".index(name)
        expected = (plain[:, channel] * spec["std"][rgb] + spec["mean"][rgb]) * 255
        # Float32 accumulation (BLAS): within a thousandth of a grey level of the float64 mean.
        np.testing.assert_allclose(means[name], expected, rtol=0, atol=1e-3)
