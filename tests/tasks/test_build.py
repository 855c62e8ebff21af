"""Gates 3 and 4 composed (tasks/build.py), as the pipeline and `sluicegate train` both run them: a small
rendered dataset read through a real folder source, a real (short) training run, a real ONNX export
checked by ONNX Runtime, and a version folder the server's own verifier accepts."""

from __future__ import annotations

from pathlib import Path

import pytest

from serving.model_format import DEFAULT_BATCHING, read_config, verify_version
from sluicegate import ids
from sluicegate.errors import ConfigError, DatasetError
from sluicegate.settings import Settings
from tasks import build
from tasks.dataset_gates import DataShape, candidate_spec
from tasks.dataset_source import LocalSource, open_location
from tasks.sample_data import make_sample

CODE = ids.CodeVersion(commit="a" * 40, dirty=False)


@pytest.fixture(scope="module")
def settings(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    home = tmp_path_factory.mktemp("home")
    return Settings(
        home=home,
        training={"epochs": 2, "width": 4, "batch_size": 32},
        conversion={"tensorrt": "off", "parity_batch": 8, "profile": (1, 4, 16)},
        model={"name": "pcb", "semver": "2.3.4", "repository": home / "repository"},
    )


@pytest.fixture(scope="module")
def packaged(settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, build.Trained]:
    folder = tmp_path_factory.mktemp("data") / "v1"
    make_sample(folder, count=120, seed=3)
    source = open_location(str(folder), lambda: pytest.fail("a folder needs no S3 client"))
    assert isinstance(source, LocalSource)
    manifest = source.manifest()
    spec = candidate_spec(settings, champion=None, data=DataShape(64, 64, grey=False))
    data = build.load_training_data(settings, source, manifest, spec)
    trained = build.train_candidate(settings, data, tmp_path_factory.mktemp("work"))
    assert build.gate_training(settings, trained, []).metrics["model_name"] == "pcb"
    converted = build.convert(settings, trained)
    assert converted.verdict.passed, converted.verdict.reason()
    assert [c.name for c in converted.verdict.checks][-1] == "tensorrt engine"
    version = build.free_version(build.repository_root(settings), settings, CODE, ids.data_version(manifest), "run-1")
    lineage = {"sluicegate.mlflow_run_id": "run-1", "sluicegate.model_version": version}
    written = build.package(
        settings,
        build.repository_root(settings),
        version=version,
        trained=trained,
        converted=converted,
        baseline={"mean": [0.5, 0.5, 0.5]},
        lineage=lineage,
    )
    return written, trained


def test_the_version_folder_is_what_the_server_loads(packaged: tuple[Path, build.Trained]) -> None:
    folder, trained = packaged
    verify_version(folder)
    config = read_config(folder)
    assert folder.name == config.version and config.version.startswith("v2.3.4-aaaaaaa-")
    assert config.platform == "onnxruntime"
    assert config.batching == {**DEFAULT_BATCHING, "max_batch_size": 16}
    assert config.labels == list(trained.result.labels)
    assert config.inputs[0]["shape"] == [-1, 3, trained.spec.height, trained.spec.width]
    assert {"model.onnx", "checkpoint.safetensors"} <= {p.name for p in folder.iterdir()}


def test_a_rerun_finds_its_own_version_and_another_build_gets_the_next_patch(
    settings: Settings, packaged: tuple[Path, build.Trained]
) -> None:
    folder, _ = packaged
    data = read_config(folder).version.rsplit("-", 1)[1]
    assert build.find_packaged(settings, CODE, data, "run-1") == folder
    other = build.free_version(build.repository_root(settings), settings, CODE, data, "run-2")
    assert other.startswith("v2.3.5-") and build.find_packaged(settings, CODE, data, "run-2") is None


def test_a_damaged_version_is_not_reused(settings: Settings, packaged: tuple[Path, build.Trained]) -> None:
    folder, _ = packaged
    data = read_config(folder).version.rsplit("-", 1)[1]
    onnx = folder / "model.onnx"
    original = onnx.read_bytes()
    try:
        onnx.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert build.find_packaged(settings, CODE, data, "run-1") is None
    finally:
        onnx.write_bytes(original)


@pytest.mark.parametrize("semver", ["1.0", "1.0.x", "v1.0.0", "1..0"])
def test_a_bad_semver_names_the_setting(semver: str) -> None:
    with pytest.raises(ConfigError, match=r"model\.semver: .* MAJOR\.MINOR\.PATCH"):
        build.version_name(Settings(model={"semver": semver}), CODE, "b" * 64)


def test_a_location_that_is_neither_folder_nor_uri_is_named(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"LOCATION: .*missing is neither a folder"):
        open_location(str(tmp_path / "missing"), lambda: pytest.fail("no S3 client for a path"))
