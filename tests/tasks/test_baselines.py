"""Gate 5's baselines on real data (scikit-learn's digits, written as PNG files and read back through the
loader the flow uses) and their rule in the eval gate's verdict."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from sluicegate.errors import DatasetError
from sluicegate.settings import EvalGateSettings
from tasks import eval_report
from tasks.baselines import (
    Baselines,
    baseline_checks,
    baselines,
    features,
    is_grey,
    load_split_thumbnails,
    majority_label,
    with_baselines,
)
from tasks.dataset_source import LocalSource
from tasks.eval_gate import eval_gate
from tasks.evaluation import load_test_split
from tests.tasks.test_eval_gate import measured

RULES = EvalGateSettings()


def write_digits(folder: Path) -> None:
    """The 1,797 8x8 digits as grey PNGs (0..16 scaled to 0..255) with a seeded, stratified 70/15/15 split."""
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    pixels = np.round(digits.images * 255 / 16).astype(np.uint8)
    labels = [f"d{t}" for t in digits.target]
    index = np.arange(len(labels))
    train, rest = train_test_split(index, train_size=0.7, stratify=labels, random_state=0)
    val, test = train_test_split(rest, train_size=0.5, stratify=[labels[i] for i in rest], random_state=0)
    split = {**dict.fromkeys(train, "train"), **dict.fromkeys(val, "val"), **dict.fromkeys(test, "test")}
    (folder / "images").mkdir(parents=True)
    lines = ["path,label,split"]
    for i in index:
        Image.fromarray(pixels[i]).save(folder / "images" / f"{i}.png")
        lines.append(f"images/{i}.png,{labels[i]},{split[i]}")
    (folder / "manifest.csv").write_text("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def digits(tmp_path_factory: pytest.TempPathFactory) -> Baselines:
    folder = tmp_path_factory.mktemp("digits")
    write_digits(folder)
    source = LocalSource(folder)
    manifest = source.manifest()
    train_images, train_labels = load_split_thumbnails(source, manifest, "train", size=16, concurrency=4)
    test_images, test_labels = load_test_split(source, manifest, limit=5000, concurrency=4)
    assert train_images[0].shape == (16, 16, 3) and test_images[0].shape == (8, 8, 3)
    labels = tuple(sorted(set(train_labels)))
    return baselines(train_images, train_labels, test_images, test_labels, labels, size=16)


def test_digits_linear_baseline_is_strong_and_the_majority_class_is_a_tenth(digits: Baselines) -> None:
    # Published logistic-regression scores on digits are 0.95-0.97; ten balanced classes make the
    # majority class right about one time in ten.
    assert 0.9 <= digits.linear_accuracy <= 1.0
    assert 0.08 <= digits.majority_accuracy <= 0.12
    assert digits.grey and digits.linear_converged
    assert (digits.train_count, digits.test_count, digits.size) == (1257, 270, 16)
    assert digits.majority_label.startswith("d") and digits.linear_seconds > 0


def test_the_baselines_are_deterministic(digits: Baselines, tmp_path: Path) -> None:
    write_digits(tmp_path)
    source = LocalSource(tmp_path)
    train = load_split_thumbnails(source, source.manifest(), "train", size=16, concurrency=2)
    test = load_test_split(source, source.manifest(), limit=5000, concurrency=2)
    again = baselines(*train, *test, tuple(sorted(set(train[1]))), size=16)
    assert (again.linear_accuracy, again.majority_accuracy) == (digits.linear_accuracy, digits.majority_accuracy)


def test_grey_is_detected_only_when_every_channel_is_equal_everywhere() -> None:
    rng = np.random.default_rng(0)
    grey = np.repeat(rng.integers(0, 256, (10, 12, 1), dtype=np.uint8), 3, axis=2)
    tinted = grey.copy()
    tinted[3, 4, 2] ^= 1  # one channel of one pixel off by one
    assert is_grey(grey) and not is_grey(tinted)
    assert features([grey, grey], 4, grey=True).shape == (2, 16)
    assert features([grey, tinted], 4, grey=False).shape == (2, 48)

    labels = ["a", "b"] * 4
    found = baselines([grey] * 7 + [tinted], labels, [grey, grey], ["a", "b"], ("a", "b"), size=4)
    assert not found.grey  # one colour image anywhere: the features keep all three channels
    assert baselines([grey] * 8, labels, [grey, grey], ["a", "b"], ("a", "b"), size=4).grey


def test_majority_ties_follow_the_label_order_not_the_row_order() -> None:
    assert majority_label(["b", "a", "a", "b"], ("a", "b")) == "a"
    assert majority_label(["b", "a", "a", "b"], ("b", "a")) == "b"
    assert majority_label(["c", "b", "c"], ("a", "b")) == "c"


def test_one_train_class_gives_that_class_for_both_baselines() -> None:
    images = [np.full((6, 6, 3), v, dtype=np.uint8) for v in (10, 200, 90)]
    found = baselines(images, ["ok"] * 3, images, ["ok", "bad", "ok"], ("bad", "ok"), size=4)
    assert found.majority_label == "ok"
    assert found.majority_accuracy == found.linear_accuracy == pytest.approx(2 / 3)


def test_the_train_images_are_capped_by_a_seeded_subset() -> None:
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, (5, 5, 3), dtype=np.uint8) for _ in range(40)]
    labels = ["a", "b"] * 20
    first = baselines(images, labels, images[:6], labels[:6], ("a", "b"), size=4, max_train=10)
    again = baselines(images, labels, images[:6], labels[:6], ("a", "b"), size=4, max_train=10)
    assert first.train_count == 10 and first.linear_accuracy == again.linear_accuracy


def test_empty_or_mismatched_splits_are_refused() -> None:
    image = np.zeros((4, 4, 3), dtype=np.uint8)
    with pytest.raises(ValueError, match=r"train: need the same positive number"):
        baselines([], [], [image], ["a"], ("a",), size=4)
    with pytest.raises(ValueError, match=r"test: need the same positive number of images and labels, got 1, 2"):
        baselines([image], ["a"], [image], ["a", "b"], ("a",), size=4)


def test_a_split_without_labelled_rows_is_a_dataset_error(tmp_path: Path) -> None:
    (tmp_path / "manifest.csv").write_text("path,label,split\na.png,x,test\n")
    source = LocalSource(tmp_path)
    with pytest.raises(DatasetError, match=r"no labelled rows with split 'train'"):
        load_split_thumbnails(source, source.manifest(), "train", size=16)


def test_a_model_a_linear_probe_beats_fails_the_gate_and_one_above_passes(digits: Baselines) -> None:
    worse = measured(digits.linear_accuracy - 0.01)
    verdict = with_baselines(eval_gate(worse, None, RULES), worse, digits, RULES)
    assert not verdict.passed
    assert [c.name for c in verdict.failed] == ["beats linear baseline"]
    assert "logistic regression on 16x16 grey pixels" in verdict.reason()

    better = measured(min(1.0, digits.linear_accuracy + RULES.baseline_margin))
    verdict = with_baselines(eval_gate(better, None, RULES), better, digits, RULES)
    assert verdict.passed, verdict.reason()
    assert [c.name for c in verdict.checks] == [
        "accuracy (first model)",
        "beats majority class",
        "beats linear baseline",
    ]
    assert verdict.metrics["baseline_linear_accuracy"] == digits.linear_accuracy
    assert verdict.metrics["baseline_majority_accuracy"] == digits.majority_accuracy
    assert verdict.metrics["candidate_accuracy"] == better.accuracy  # the gate's own metrics are kept


def test_the_baselines_apply_with_a_champion_too() -> None:
    found = Baselines(0.5, "good", 0.95, 1.0, 100, 200, 16, False)
    candidate, champion = measured(0.93), measured(0.90, role="champion")
    verdict = with_baselines(eval_gate(candidate, champion, RULES), candidate, found, RULES)
    assert [c.name for c in verdict.failed] == ["beats linear baseline"]  # it beats the champion, not the probe
    assert (
        verdict.failed[0].threshold == ">= 0.9550 (logistic regression on 16x16 RGB pixels 0.9500 + 0.005, capped at 1)"
    )


def test_a_majority_class_model_fails() -> None:
    found = Baselines(0.5, "good", 0.45, 1.0, 100, 200, 16, False)
    checks = baseline_checks(measured(0.5), found, 0.005)
    assert [c.passed for c in checks] == [False, True]
    assert checks[0].threshold.startswith(">= 0.5050 (majority class 'good' 0.5000")


def test_a_perfect_baseline_is_matched_not_beaten() -> None:
    found = Baselines(0.5, "good", 1.0, 1.0, 100, 200, 16, False)
    assert all(c.passed for c in baseline_checks(measured(1.0), found, 0.005))
    assert [c.name for c in baseline_checks(measured(0.999), found, 0.005) if not c.passed] == ["beats linear baseline"]
    near = replace(found, linear_accuracy=0.998)  # 0.998 + 0.005 caps at 1: only a perfect model passes
    assert not baseline_checks(measured(0.9995), near, 0.005)[1].passed


def test_an_exact_tie_with_the_margin_passes() -> None:
    found = Baselines(0.2, "good", 180 / 200, 1.0, 100, 200, 16, False)
    assert baseline_checks(measured(181 / 200), found, 0.005)[1].passed


def test_the_report_shows_the_baselines_beside_the_models(digits: Baselines) -> None:
    candidate, champion = measured(0.99), measured(0.97, role="champion")
    verdict = with_baselines(eval_gate(candidate, champion, RULES), candidate, digits, RULES)
    markdown = eval_report.eval_markdown(verdict, [candidate, champion], context="ctx", images={}, baselines=digits)
    assert "| metric | candidate | champion | majority class | linear baseline |" in markdown
    assert f"| accuracy | 0.9900 | 0.9700 | {digits.majority_accuracy:.4f} | {digits.linear_accuracy:.4f} |" in markdown
    assert "fit on 1257 train images" in markdown and "16x16 grey pixels" in markdown
    assert "| metric | candidate | champion |\n" in eval_report.eval_markdown(
        verdict, [candidate, champion], context="c", images={}
    )
