"""The data gate on real files: the sample dataset passes, each corruption fails the check it targets."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sluicegate import storage
from sluicegate.settings import DataGateSettings, Settings
from tasks.data_gate import LabelReference, run_data_gate
from tasks.dataset_source import LocalSource, S3Source
from tasks.datasets import manifest_paths
from tasks.image_stats import collect_stats
from tasks.sample_data import LABELS, Corruption, make_sample
from tasks.transfer import push_directory

GATE = DataGateSettings(labels=list(LABELS))

# Which check each corruption must fail (and the only one it may fail).
TARGET = {
    Corruption.MISSING_LABELS: "label present",
    Corruption.SKEWED_LABELS: "label distribution",
    Corruption.MIXED_SIZES: "one image size",
    Corruption.UNDECODABLE: "images decode",
    Corruption.LEAKAGE: "no train/test leakage",
    Corruption.UNKNOWN_LABELS: "known labels",
}


def gate(directory: Path, settings: DataGateSettings = GATE, reference: LabelReference | None = None):  # type: ignore[no-untyped-def]
    source = LocalSource(directory)
    manifest = source.manifest()
    stats = collect_stats(source, manifest_paths(manifest), concurrency=4)
    return run_data_gate(manifest, stats, reference, settings)


@pytest.fixture(scope="module")
def clean(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("clean") / "data"
    make_sample(directory, count=240, seed=3)
    return directory


def test_the_sample_dataset_passes(clean: Path) -> None:
    verdict, validation = gate(clean)
    assert verdict.passed, verdict.reason()
    assert {check.name for check in verdict.checks} >= set(TARGET.values()) | {"manifest sha256 matches"}
    assert verdict.metrics["rows"] == 240 and verdict.metrics["images_decodable"] == 240
    assert validation["success"] is True
    types = {result["expectation_config"]["type"] for result in validation["results"]}
    assert "expect_column_kl_divergence_to_be_less_than" in types
    json.dumps(validation)  # stored as an MLflow artifact: must be JSON


@pytest.mark.parametrize("corruption", list(Corruption), ids=lambda c: c.value)
def test_each_corruption_fails_its_check(corruption: Corruption, tmp_path: Path) -> None:
    make_sample(tmp_path / "data", count=240, seed=3, corrupt=corruption)
    verdict, _ = gate(tmp_path / "data")
    assert not verdict.passed
    assert [check.name for check in verdict.failed] == [TARGET[corruption]]
    failed = verdict.failed[0]
    assert TARGET[corruption] in verdict.reason() and "observed" in verdict.reason()
    assert failed.observed is not None


def test_without_configured_labels_the_reference_is_uniform_over_seen_labels(clean: Path, tmp_path: Path) -> None:
    verdict, _ = gate(clean, DataGateSettings())
    assert verdict.passed and "known labels" not in {c.name for c in verdict.checks}
    assert verdict.metrics["reference"]["source"] == "uniform over the labels seen"
    make_sample(tmp_path / "skewed", count=240, seed=3, corrupt=Corruption.SKEWED_LABELS)
    skewed, _ = gate(tmp_path / "skewed", DataGateSettings())
    assert [c.name for c in skewed.failed] == ["label distribution"]


def test_a_champion_reference_with_other_labels_fails_the_distribution(clean: Path) -> None:
    reference = LabelReference.from_labels(["good"] * 90 + ["bridge"] * 10, "champion v1 (train split)")
    verdict, _ = gate(clean, DataGateSettings(), reference)
    names = {c.name for c in verdict.failed}
    assert "label distribution" in names and "known labels" in names  # insufficient/excess unknown to it
    assert verdict.metrics["reference"]["source"] == "champion v1 (train split)"


def test_thresholds_come_from_settings(tmp_path: Path) -> None:
    make_sample(tmp_path / "data", count=240, seed=3, corrupt=Corruption.MISSING_LABELS)
    lenient, _ = gate(tmp_path / "data", DataGateSettings(labels=list(LABELS), max_missing_fraction=0.5))
    assert lenient.passed, lenient.reason()


def test_the_gate_reads_pinned_versions_from_s3(platform: Settings, clean: Path) -> None:
    pushed = push_directory(platform, clean, "pcb", "gate")
    s3 = storage.s3_client(platform)
    prefix = pushed.manifest_key.rsplit("/", 1)[0] + "/"
    from tasks.datasets import resolve_dataset_version

    resolved, manifest = resolve_dataset_version(s3, platform.storage.bucket, pushed.manifest_key)
    # Overwrite one image after resolution: the gate must still read the pinned, decodable version.
    s3.put_object(Bucket=platform.storage.bucket, Key=prefix + manifest_paths(manifest)[0], Body=b"broken")
    source = S3Source(
        s3, platform.storage.bucket, prefix, manifest_version=resolved.manifest_version_id, versions=resolved.objects
    )
    stats = collect_stats(source, manifest_paths(manifest), concurrency=8)
    verdict, _ = run_data_gate(manifest, stats, None, GATE)
    assert verdict.passed, verdict.reason()
    latest = collect_stats(S3Source(s3, platform.storage.bucket, prefix), manifest_paths(manifest)[:1])
    assert not latest[0].decodable
