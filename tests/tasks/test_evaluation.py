"""Gate 5's measurements on real exported models through ONNX Runtime, and its reports."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from serving.errors import RepositoryError
from serving.preprocessing import PreprocessSpec, preprocess
from sluicegate.settings import EvalGateSettings
from tasks import eval_report
from tasks.eval_gate import eval_gate, only_latency_failed
from tasks.evaluation import (
    EvalOptions,
    calibration,
    classification_metrics,
    evaluate,
    model_under_test,
)
from tests.fixtures.models import LABELS, SPEC, Slowed, images, resnet, write_model_version

FAST = EvalOptions(latency_iterations=40, warmup_iterations=5)


def test_calibration_error_by_hand() -> None:
    confidence = np.array([0.95, 0.95, 0.65, 0.65], dtype=np.float32)
    correct = np.array([True, False, True, True])
    ece, bins = calibration(confidence, correct, 10)
    # (0.9, 1]: confidence 0.95, accuracy 0.5; (0.6, 0.7]: confidence 0.65, accuracy 1.0; each half the samples.
    assert ece == pytest.approx(0.5 * 0.45 + 0.5 * 0.35, abs=1e-6)
    assert [b.count for b in bins] == [0, 0, 0, 0, 0, 0, 2, 0, 0, 2]
    assert bins[9].accuracy == 0.5 and bins[6].accuracy == 1.0


def test_classification_metrics_by_hand() -> None:
    accuracy, matrix, per_class = classification_metrics(
        ["a", "a", "b", "b", "c"], ["a", "b", "b", "b", "a"], ("a", "b", "c")
    )
    assert accuracy == pytest.approx(3 / 5)
    assert matrix == ((1, 1, 0), (0, 2, 0), (1, 0, 0))
    a, b, c = per_class
    assert (a.precision, a.recall, a.support) == (0.5, 0.5, 2)
    assert b.precision == pytest.approx(2 / 3) and b.recall == 1.0 and b.f1 == pytest.approx(0.8)
    assert (c.precision, c.recall, c.f1, c.support) == (0.0, 0.0, 0.0, 1)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("repo")
    write_model_version(root, "m", "v1.0.0-aaaaaaa-1111111", resnet(1))
    bgr = PreprocessSpec(height=24, width=24, colour="BGR")
    write_model_version(root, "m", "v1.0.0-bbbbbbb-2222222", resnet(2), spec=bgr)
    write_model_version(root, "m", "v1.0.0-ccccccc-1111111", Slowed(resnet(1)))
    return root


def test_both_models_scored_on_the_same_images_each_with_its_own_preprocessing(repo: Path) -> None:
    pictures = images(20, seed=3)
    truth = [LABELS[i % 4] for i in range(19)] + ["scratch"]  # one label neither model has
    candidate = model_under_test("candidate", repo / "m" / "v1.0.0-aaaaaaa-1111111")
    champion = model_under_test("champion", repo / "m" / "v1.0.0-bbbbbbb-2222222")
    cand, champ = evaluate([candidate, champion], pictures, truth, FAST)

    for evaluation, seed, spec in ((cand, 1, SPEC), (champ, 2, champion.spec)):
        with torch.no_grad():
            logits = resnet(seed)(torch.from_numpy(preprocess(pictures, spec))).numpy()
        expected = np.mean([LABELS[i] == t for i, t in zip(logits.argmax(axis=1), truth, strict=True)])
        assert evaluation.accuracy == pytest.approx(expected)
        assert evaluation.samples == 20 and evaluation.unknown_label_samples == 1
        assert evaluation.axis == tuple(sorted((*LABELS, "scratch"))) and sum(map(sum, evaluation.confusion)) == 20
        assert evaluation.runtime == "onnxruntime" and "CPUExecutionProvider" in evaluation.providers
        assert [entry.batch_size for entry in evaluation.latency] == [1, 8]
        assert all(0 < entry.p50_ms <= entry.p95_ms and entry.iterations == 40 for entry in evaluation.latency)
        assert 0 <= evaluation.ece <= 1
    assert champ.model_version == "v1.0.0-bbbbbbb-2222222"


def test_a_deliberately_slower_model_trips_the_latency_rule(repo: Path) -> None:
    """Same weights behind an identity chain of convolutions: equal accuracy, several times the work."""
    slow = model_under_test("candidate", repo / "m" / "v1.0.0-ccccccc-1111111")
    base = model_under_test("champion", repo / "m" / "v1.0.0-aaaaaaa-1111111")
    pictures, truth = images(16, seed=4), [LABELS[i % 4] for i in range(16)]
    rules = EvalGateSettings(min_accuracy_gain=0.0, latency_iterations=40)
    options = EvalOptions(latency_iterations=40, warmup_iterations=5, latency_retries=1)
    cand, champ = evaluate([slow, base], pictures, truth, options, remeasure=lambda e: only_latency_failed(e, rules))

    assert cand.accuracy == champ.accuracy  # identical predictions
    verdict = eval_gate(cand, champ, rules)
    assert not verdict.passed
    assert {c.name for c in verdict.failed} == {"p95 latency @ batch 1", "p95 latency @ batch 8"}
    assert cand.latency_attempts == 2  # the rule tripped, was measured again, and tripped again
    assert cand.latency_at(8).p95_ms > 2 * champ.latency_at(8).p95_ms  # type: ignore[union-attr]


def test_an_altered_model_file_is_refused_before_loading(tmp_path: Path) -> None:
    folder = write_model_version(tmp_path, "m", "v1.0.0-ddddddd-3333333", resnet(3))
    (folder / "model.onnx").write_bytes((folder / "model.onnx").read_bytes()[:-10])
    with pytest.raises(RepositoryError, match=r"model\.onnx was altered"):
        model_under_test("champion", folder)


def test_reports_show_both_models(repo: Path) -> None:
    candidate = model_under_test("candidate", repo / "m" / "v1.0.0-aaaaaaa-1111111")
    champion = model_under_test("champion", repo / "m" / "v1.0.0-bbbbbbb-2222222")
    pictures, truth = images(12, seed=5), [LABELS[i % 4] for i in range(12)]
    evaluations = evaluate([candidate, champion], pictures, truth, FAST)
    verdict = eval_gate(evaluations[0], evaluations[1], EvalGateSettings())

    for png in (eval_report.confusion_png(evaluations), eval_report.calibration_png(evaluations)):
        assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 5_000
    markdown = eval_report.eval_markdown(verdict, evaluations, context="ctx", images={"cm": "http://x/cm.png"})
    assert "| metric | candidate | champion |" in markdown and "![cm](http://x/cm.png)" in markdown
    assert "p95 latency ms @ batch 8" in markdown and "### Confusion matrix: champion" in markdown
    card = eval_report.model_card(
        model_name="m",
        candidate=evaluations[0],
        champion=evaluations[1],
        verdict=verdict,
        lineage={"sluicegate.data_version": "f" * 64, "sluicegate.code_version": "c" * 40},
        dataset="pcb/2026-11-30",
        environment={"python": "3.11", "onnxruntime": "1.2", "gpus": []},
        intended_use="Testing.",
        labels=LABELS,
        train_images=100,
    )
    for section in (
        "## Intended use",
        "## Metrics",
        "## Limitations",
        "## Environment",
        "f" * 64,
        "| onnxruntime | `1.2` |",
    ):
        assert section in card, section
    assert "Classes below 80% recall" in card  # random weights: some class is always missed
