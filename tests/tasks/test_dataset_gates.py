"""Gates 1 and 2 composed (tasks/dataset_gates.py), as the pipeline and `sluicegate check` both run them,
on a rendered dataset in a real folder (Great Expectations and the image reads are real)."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.preprocessing import PreprocessSpec
from sluicegate.settings import Settings
from tasks.dataset_gates import DataShape, candidate_spec, check_data, check_features, fit_size, sampled_paths
from tasks.dataset_source import LocalSource
from tasks.datasets import manifest_paths
from tasks.sample_data import Corruption, make_sample


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ds") / "v1"
    make_sample(path, count=90, seed=5)
    return path


def test_the_sample_is_seeded_distinct_and_bounded(folder: Path) -> None:
    manifest = LocalSource(folder).manifest()
    rules = Settings(feature_gate={"sample_size": 25, "seed": 1}).feature_gate
    chosen = sampled_paths(manifest, rules)
    assert chosen == sampled_paths(manifest, rules) and len(set(chosen)) == 25
    assert set(chosen) <= set(manifest_paths(manifest))
    doubled = manifest + b"\n".join(manifest.splitlines()[1:]) + b"\n"  # every row listed twice
    assert sampled_paths(doubled, rules) == chosen
    everything = Settings(feature_gate={"sample_size": 10_000}).feature_gate
    assert sorted(sampled_paths(manifest, everything)) == sorted(set(manifest_paths(manifest)))


def test_a_good_folder_passes_both_gates_and_counts_every_image(folder: Path) -> None:
    settings = Settings()
    source = LocalSource(folder)
    manifest = source.manifest()
    seen: list[object] = []
    outcome = check_data(settings, source, manifest, champion=None, on_image=seen.append)
    assert outcome.verdict.passed, outcome.verdict.reason()
    assert len(seen) == len(manifest_paths(manifest)) and outcome.validation
    assert set(outcome.baseline) == {"r", "g", "b"}  # per channel, one mean per image: the drift baseline
    assert all(len(means) == len(seen) for means in outcome.baseline.values())
    assert outcome.shape == DataShape(64, 64, grey=False)
    candidate = candidate_spec(settings, champion=None, data=outcome.shape)
    assert (candidate.height, candidate.width, candidate.colour) == (32, 32, "RGB")  # shrunk to max_size
    same = check_features(settings, source, manifest, reference=candidate, candidate=candidate)
    assert same.passed and same.metrics["count"] == min(settings.feature_gate.sample_size, len(seen))


def test_a_changed_preprocessing_fails_the_feature_gate(folder: Path) -> None:
    settings = Settings()
    source = LocalSource(folder)
    candidate = candidate_spec(settings, champion=None, data=DataShape(64, 64, grey=False))
    other = PreprocessSpec.from_dict({**candidate.to_dict(), "colour": "BGR"})
    # Without a candidate given, the command line's way: chosen from the sample's shape (RGB, 32x32).
    verdict = check_features(settings, source, source.manifest(), reference=other, follow_reference=False)
    assert not verdict.passed and "cosine" in verdict.reason()
    # Against a champion, the candidate keeps the champion's colour unless the settings pin another one.
    kept = check_features(settings, source, source.manifest(), reference=other)
    assert kept.passed, kept.reason()
    pinned = Settings(preprocessing={"colour": "RGB"})
    verdict = check_features(pinned, source, source.manifest(), reference=other)
    assert not verdict.passed and "cosine" in verdict.reason()


def test_a_corrupt_folder_fails_the_data_gate(tmp_path: Path) -> None:
    make_sample(tmp_path / "bad", count=60, seed=2, corrupt=Corruption("missing-labels"))
    source = LocalSource(tmp_path / "bad")
    outcome = check_data(Settings(), source, source.manifest(), champion=None)
    assert not outcome.verdict.passed and "missing" in outcome.verdict.reason()


def test_a_first_model_fits_its_data_and_later_ones_keep_the_champions_input() -> None:
    settings = Settings()
    grey = candidate_spec(settings, champion=None, data=DataShape(25, 25, grey=True))
    assert (grey.height, grey.width, grey.colour, grey.channels) == (25, 25, "L", 1)  # native, never enlarged
    assert len(grey.mean) == len(grey.std) == 1
    wide = candidate_spec(settings, champion=None, data=DataShape(640, 480, grey=False))
    assert (wide.height, wide.width, wide.colour) == (24, 32, "RGB")  # the longer side to max_size, aspect kept
    assert fit_size(8, 200, 32) == (32, 1)
    # The champion's input carries on, whatever this version's images look like ...
    kept = candidate_spec(settings, champion=grey, data=DataShape(64, 64, grey=False))
    assert kept == grey
    # ... unless the settings (or the model's spec) pin a field.
    pinned = Settings(preprocessing={"height": 40, "width": 40, "max_size": 64})
    bigger = candidate_spec(pinned, champion=grey, data=None)
    assert (bigger.height, bigger.width, bigger.colour) == (40, 40, "L")
    recoloured = candidate_spec(Settings(preprocessing={"colour": "RGB"}), champion=grey, data=None)
    assert recoloured.channels == 3 and len(recoloured.mean) == 3  # the champion's grey statistics do not fit
    assert candidate_spec(Settings(), champion=None, data=None).height == 32
