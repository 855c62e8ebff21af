"""EntropyMonitor: collapsed output streams are flagged, healthy ones (confident ones included) are not."""

from __future__ import annotations

import threading

import numpy as np
import numpy.typing as npt
import pytest

from serving.observability.entropy import EntropyMonitor, entropy_bits, softmax

CLASSES = 4


def healthy_logits(rng: np.random.Generator, rows: int) -> npt.NDArray[np.float32]:
    """An unsure-to-sure classifier: random logits, so entropy and predicted class vary per row."""
    return rng.normal(0, 2, (rows, CLASSES)).astype(np.float32)


def confident_logits(rng: np.random.Generator, rows: int) -> npt.NDArray[np.float32]:
    """A healthy, very sure classifier: one large logit per row, on varying classes."""
    logits = np.zeros((rows, CLASSES), dtype=np.float32)
    logits[np.arange(rows), rng.integers(0, CLASSES, rows)] = rng.uniform(9, 14, rows)
    return logits


def test_softmax_and_entropy_values() -> None:
    probabilities = softmax([[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0], [np.log(3.0), 0.0, 0.0, 0.0]])
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0)
    bits = entropy_bits(probabilities)
    assert bits[0] == pytest.approx(2.0)  # uniform over 4: log2(4)
    assert bits[1] == 0.0  # one-hot, and no overflow at 1000
    assert bits[2] == pytest.approx(-(0.5 * np.log2(0.5) + 3 * (1 / 6) * np.log2(1 / 6)))
    with pytest.raises(ValueError, match=r"\(rows, classes\)"):
        softmax(np.zeros(4))


@pytest.mark.parametrize(
    "row",
    [pytest.param([8.0, 0.0, 0.0, 0.0], id="one-hot-ish"), pytest.param([0.0, 0.0, 0.0, 0.0], id="uniform")],
)
def test_identical_answers_are_a_collapse(row: list[float]) -> None:
    rng = np.random.default_rng(0)
    monitor = EntropyMonitor()
    collapsed = []
    for _ in range(200):
        jitter = rng.normal(0, 1e-3, (1, CLASSES))  # numerically identical, not bit-identical
        collapsed.append(monitor.observe(np.asarray([row]) + jitter).collapsed)
    assert not any(collapsed[:99])  # fewer than min_rows rows: no verdict
    assert all(collapsed[99:])
    assert monitor.state.std_bits <= 0.05
    # One-hot-ish: one class everywhere. Uniform: the argmax is noise, but no answer is sure.
    assert monitor.state.top_class_share == 1.0 or monitor.state.mean_bits > 1.9


def test_a_stuck_confident_answer_is_a_collapse() -> None:
    """Sure answers, all naming the same class: the one case the class share decides."""
    rng = np.random.default_rng(5)
    monitor = EntropyMonitor()
    logits = np.zeros((300, CLASSES), dtype=np.float32)
    logits[:, 0] = rng.uniform(9, 14, 300)  # as sure as the healthy confident model, always class 0
    for row in logits:
        monitor.observe(row[None, :])
    assert monitor.state.mean_bits < 0.25 and monitor.state.top_class_share == 1.0
    assert monitor.collapsed


def test_a_healthy_stream_is_not_a_collapse() -> None:
    rng = np.random.default_rng(1)
    monitor = EntropyMonitor()
    for _ in range(2500):
        assert not monitor.observe(healthy_logits(rng, 2)).collapsed
    assert monitor.state.std_bits > 0.2 and monitor.state.rows == 500


def test_a_confident_model_is_not_a_collapse_though_its_entropy_std_is_tiny() -> None:
    rng = np.random.default_rng(2)
    monitor = EntropyMonitor()
    for _ in range(1000):
        monitor.observe(confident_logits(rng, 1))
    assert monitor.state.std_bits < 0.05  # the std rule alone would flag this healthy model
    assert monitor.state.top_class_share < 0.5
    assert not monitor.collapsed


def test_a_model_that_collapses_midway_is_flagged_within_one_window() -> None:
    rng = np.random.default_rng(3)
    monitor = EntropyMonitor(window=500)
    for _ in range(1000):
        monitor.observe(healthy_logits(rng, 1))
    assert not monitor.collapsed
    stuck = np.array([[0.0, 9.0, 0.0, 0.0]], dtype=np.float32)
    flagged_after = next((n for n in range(1, 501) if monitor.observe(stuck).collapsed), None)
    assert flagged_after is not None and flagged_after <= 500


def test_rule_two_flags_a_drop_below_the_expected_entropy() -> None:
    rng = np.random.default_rng(4)
    expected = float(entropy_bits(softmax(healthy_logits(rng, 5000))).mean())
    monitor = EntropyMonitor(expected_bits=expected, drop_fraction=0.5)
    for _ in range(600):
        monitor.observe(healthy_logits(rng, 1))
    assert not monitor.collapsed
    for _ in range(600):
        monitor.observe(confident_logits(rng, 1))  # far surer than validation said: flagged by rule 2
    state = monitor.state
    assert state.collapsed and state.mean_bits < 0.5 * expected


def test_summary_for_logs_and_non_finite_rows() -> None:
    monitor = EntropyMonitor(min_rows=1)
    summary = monitor.observe([[5.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0], [np.nan, 0.0, 0.0, 0.0]])
    assert summary.predicted.tolist()[:2] == [0, 0]
    assert summary.confidence[0] == pytest.approx(np.exp(5) / (np.exp(5) + 3))
    assert summary.entropy_bits[1] == pytest.approx(2.0)
    assert monitor.state.rows == 2  # the NaN row is returned, not kept
    assert EntropyMonitor().observe([[1.0, 3.0], [2.0, 0.0]]).min_confidence == pytest.approx(1 / (1 + np.exp(-2)))


def test_concurrent_observers_keep_the_window_consistent() -> None:
    monitor = EntropyMonitor(window=300)

    def send(seed: int) -> None:
        rng = np.random.default_rng(seed)
        for _ in range(400):
            monitor.observe(healthy_logits(rng, 3))

    threads = [threading.Thread(target=send, args=(seed,)) for seed in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert monitor.state.rows == 300 and not monitor.collapsed


def test_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError, match="window"):
        EntropyMonitor(window=0)
    with pytest.raises(ValueError, match="collapse_class_share"):
        EntropyMonitor(collapse_class_share=0)


@pytest.mark.parametrize("shape", [(1, 4), (3, 2), (8, 8), (1, 64), (2, 40)])
def test_min_confidence_small_path_matches_softmax(shape: tuple[int, int]) -> None:
    # Up to 64 logits it is computed on Python floats; above, with numpy; both must give softmax's answer.
    from serving.observability.monitors import min_confidence

    rng = np.random.default_rng(sum(shape))
    for scale in (0.1, 3.0, 80.0):  # 80: exp overflows without the max shift
        logits = (rng.normal(size=shape) * scale).astype(np.float32)
        expected = float(softmax(logits).max(axis=1).min())
        assert min_confidence(logits) == pytest.approx(expected, rel=1e-12)


def test_min_confidence_of_non_finite_or_empty_logits() -> None:
    from serving.observability.monitors import min_confidence

    assert min_confidence(None) is None
    assert min_confidence(np.zeros((0, 3), dtype=np.float32)) is None
    assert min_confidence(np.zeros(4, dtype=np.float32)) is None  # not (rows, classes)
    nan = min_confidence(np.array([[np.nan, 1.0]], dtype=np.float32))
    assert nan is None or not np.isfinite(nan)  # the log writes it as null either way
    assert min_confidence(np.array([[1.0, 1.0]], dtype=np.float32)) == pytest.approx(0.5)
