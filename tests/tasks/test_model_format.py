"""The serving model repository on real files: a real ONNX export, a safetensors checkpoint, ONNX Runtime."""

from __future__ import annotations

import dataclasses
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from serving.model_format import (
    DEFAULT_BATCHING,
    ModelConfig,
    RepositoryError,
    pickle_refusal,
    read_config,
    verify_version,
    write_version,
)
from sluicegate.ids import sha256_file
from tasks.conversion import export_onnx
from tests.tasks.test_conversion import HW, images, trained_tiny_net


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return trained_tiny_net(seed=7)


@pytest.fixture(scope="module")
def sources(model: torch.nn.Module, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from safetensors.torch import save_file

    folder = tmp_path_factory.mktemp("sources")
    export_onnx(model, images(2), folder / "exported.onnx")
    save_file(dict(model.state_dict()), str(folder / "weights.safetensors"))
    return {"model.onnx": folder / "exported.onnx", "checkpoint.safetensors": folder / "weights.safetensors"}


def config(version: str = "v1.0.0-abc1234-def5678", **changes: object) -> ModelConfig:
    base = ModelConfig(
        name="pcb-classifier",
        version=version,
        platform="onnxruntime",
        inputs=[{"name": "input", "datatype": "FP32", "shape": [-1, 3, HW, HW]}],
        outputs=[{"name": "logits", "datatype": "FP32", "shape": [-1, 3]}],
        labels=["good", "bridge", "missing"],
        preprocessing={"height": HW, "width": HW, "colour": "RGB", "mean": [0.5] * 3, "std": [0.25] * 3},
        batching=dict(DEFAULT_BATCHING),
        drift_baseline={"channel_means": [0.1, 0.2, 0.3], "quantiles": [[0.0, 0.5, 1.0]] * 3},
        lineage={"data_version": "d" * 64, "code_version": "abc1234", "mlflow_run_id": "run-1"},
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_write_then_verify_round_trips(tmp_path: Path, sources: dict[str, Path]) -> None:
    path = write_version(tmp_path, config(), sources)
    assert path == tmp_path / "pcb-classifier" / "v1.0.0-abc1234-def5678"
    assert sorted(p.name for p in path.iterdir()) == [
        "SHA256SUMS",
        "checkpoint.safetensors",
        "config.json",
        "model.onnx",
    ]
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no staging folder left
    lines = (path / "SHA256SUMS").read_text().splitlines()
    assert lines == [f"{sha256_file(path / n)}  {n}" for n in ("checkpoint.safetensors", "config.json", "model.onnx")]
    assert verify_version(path) == config() == read_config(path) == read_config(path / "config.json")


def test_the_stored_model_gives_the_source_models_logits(
    tmp_path: Path, sources: dict[str, Path], model: torch.nn.Module
) -> None:
    import onnxruntime as ort

    path = write_version(tmp_path, config(), sources)
    loaded = verify_version(path)
    session = ort.InferenceSession(str(path / loaded.model_file), providers=["CPUExecutionProvider"])
    batch = images(9, seed=11)
    (logits,) = session.run([loaded.outputs[0]["name"]], {loaded.inputs[0]["name"]: batch})
    with torch.no_grad():
        expected = model.eval()(torch.from_numpy(batch)).numpy()
    assert logits.shape == (9, len(loaded.labels))
    np.testing.assert_allclose(logits, expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["model.onnx", "config.json", "checkpoint.safetensors"])
def test_an_altered_file_is_named(tmp_path: Path, sources: dict[str, Path], name: str) -> None:
    path = write_version(tmp_path, config(), sources)
    data = bytearray((path / name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (path / name).write_bytes(bytes(data))
    with pytest.raises(RepositoryError, match=rf"{name} was altered .*re-publish"):
        verify_version(path)


def test_a_missing_file_is_named(tmp_path: Path, sources: dict[str, Path]) -> None:
    path = write_version(tmp_path, config(), sources)
    (path / "checkpoint.safetensors").unlink()
    with pytest.raises(RepositoryError, match=r"checkpoint\.safetensors listed in SHA256SUMS but missing"):
        verify_version(path)


def test_an_extra_file_is_refused(tmp_path: Path, sources: dict[str, Path]) -> None:
    path = write_version(tmp_path, config(), sources)
    (path / "notes.txt").write_text("hello")
    with pytest.raises(RepositoryError, match=r"notes\.txt not listed in SHA256SUMS \(extra\)"):
        verify_version(path)


def test_a_version_without_sums_is_refused(tmp_path: Path, sources: dict[str, Path]) -> None:
    path = write_version(tmp_path, config(), sources)
    (path / "SHA256SUMS").unlink()
    with pytest.raises(RepositoryError, match="has no SHA256SUMS"):
        verify_version(path)


def test_pickles_are_refused_in_a_version(tmp_path: Path, sources: dict[str, Path]) -> None:
    path = write_version(tmp_path, config(), sources)
    (path / "weights.bin").write_bytes(pickle.dumps({"w": [1.0, 2.0]}, protocol=4))
    with pytest.raises(RepositoryError, match=r"weights\.bin is a pickle \(protocol 4"):
        verify_version(path)


def test_pickles_are_refused_on_write(tmp_path: Path, sources: dict[str, Path], model: torch.nn.Module) -> None:
    saved = tmp_path / "state.bin"
    torch.save(model.state_dict(), saved)  # a zip holding data.pkl
    with pytest.raises(RepositoryError, match=r"extra\.bin is a zip holding pickles"):
        write_version(tmp_path / "repo", config(), {**sources, "extra.bin": saved})
    with pytest.raises(RepositoryError, match=r"model\.pt has a pickle suffix"):
        write_version(tmp_path / "repo", config(), {**sources, "model.pt": sources["model.onnx"]})
    raw = tmp_path / "raw"
    raw.write_bytes(pickle.dumps([1, 2, 3], protocol=2))
    with pytest.raises(RepositoryError, match="protocol 2"):
        write_version(tmp_path / "repo", config(), {**sources, "raw.dat": raw})
    assert not (tmp_path / "repo" / "pcb-classifier" / config().version).exists()


def test_a_safetensors_header_that_starts_like_a_pickle_is_allowed(tmp_path: Path) -> None:
    header = b'{"__metadata__":{}}'.ljust(0x0280, b" ")  # length 640: bytes 80 02, like pickle protocol 2
    file = tmp_path / "w.safetensors"
    file.write_bytes(len(header).to_bytes(8, "little") + header)
    assert file.read_bytes()[:2] == b"\x80\x02"
    assert pickle_refusal(file.name, file) == ""


def test_writing_the_same_version_twice_is_a_no_op(tmp_path: Path, sources: dict[str, Path]) -> None:
    first = write_version(tmp_path, config(), sources)
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in first.iterdir()}
    second = write_version(tmp_path, config(), sources)
    assert second == first
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in second.iterdir()} == before
    assert sorted(p.name for p in first.parent.iterdir()) == [first.name]


def test_different_content_for_an_existing_version_is_refused(tmp_path: Path, sources: dict[str, Path]) -> None:
    path = write_version(tmp_path, config(), sources)
    changed = config(labels=["good", "bridge", "tombstone"])
    with pytest.raises(RepositoryError, match="already exists with different content: versions are immutable"):
        write_version(tmp_path, changed, sources)
    assert verify_version(path) == config()
    assert write_version(tmp_path, config(version="v1.0.1-abc1234-def5678"), sources).name == "v1.0.1-abc1234-def5678"


def test_a_damaged_existing_version_is_not_silently_accepted(tmp_path: Path, sources: dict[str, Path]) -> None:
    path = write_version(tmp_path, config(), sources)
    (path / "model.onnx").write_bytes(b"not a model")
    with pytest.raises(RepositoryError, match=r"model\.onnx was altered"):
        write_version(tmp_path, config(), sources)


def test_the_platforms_model_file_is_required(tmp_path: Path, sources: dict[str, Path]) -> None:
    with pytest.raises(RepositoryError, match=r"platform 'tensorrt' loads model\.plan"):
        write_version(tmp_path, config(platform="tensorrt"), sources)
    with pytest.raises(RepositoryError, match="platform 'triton' must be one of"):
        config(platform="triton")


def test_config_names_must_be_path_safe() -> None:
    with pytest.raises(RepositoryError, match=r"ModelConfig\.version '\.\./x'"):
        config(version="../x")


def test_a_config_moved_to_another_folder_is_refused(tmp_path: Path, sources: dict[str, Path]) -> None:
    path = write_version(tmp_path, config(), sources)
    moved = path.rename(path.parent / "v9.9.9-abc1234-def5678")
    with pytest.raises(RepositoryError, match="not the folder it is in"):
        verify_version(moved)


def test_read_config_refuses_unknown_formats(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"format": 99, "name": "m"}')
    with pytest.raises(RepositoryError, match="config format 99"):
        read_config(tmp_path)
