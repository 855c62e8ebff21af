"""`sluicegate dataset ...` and `sluicegate check ...` against real files and the S3 endpoint."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from serving.preprocessing import PreprocessSpec
from sluicegate.app.cli.main import app
from sluicegate.settings import Settings
from tests.fixtures.platform import settings_env

runner = CliRunner()


def run(args: list[str], settings: Settings | None = None, **env: str):  # type: ignore[no-untyped-def]
    full = {**(settings_env(settings) if settings else {}), **env}
    return runner.invoke(app, args, env=full)


def test_make_sample_then_check_data_locally(tmp_path: Path) -> None:
    made = run(["dataset", "make-sample", str(tmp_path / "ok"), "--count", "80", "--seed", "2"])
    assert made.exit_code == 0, made.output
    labels = '["good", "bridge", "insufficient", "excess"]'
    ok = run(
        ["check", "data", str(tmp_path / "ok"), "--report", str(tmp_path / "r.json")],
        SLUICEGATE_DATA_GATE__LABELS=labels,
    )
    assert ok.exit_code == 0, ok.output
    assert "data gate: passed" in ok.output
    assert json.loads((tmp_path / "r.json").read_text())["verdict"]["passed"] is True

    run(["dataset", "make-sample", str(tmp_path / "bad"), "--count", "80", "--corrupt", "unknown-labels"])
    bad = run(["check", "data", str(tmp_path / "bad")], SLUICEGATE_DATA_GATE__LABELS=labels)
    assert bad.exit_code == 1 and "known labels" in bad.output


def test_make_sample_rejects_an_unknown_corruption(tmp_path: Path) -> None:
    result = run(["dataset", "make-sample", str(tmp_path / "x"), "--corrupt", "smudged"])
    assert result.exit_code == 2 and "missing-labels" in result.output


def test_check_features_against_a_spec_file(tmp_path: Path) -> None:
    run(["dataset", "make-sample", str(tmp_path / "d"), "--count", "40"])
    first = run(["check", "features", str(tmp_path / "d")])
    assert first.exit_code == 0 and "first model" in first.output
    spec = PreprocessSpec(height=32, width=32, colour="BGR").to_dict()
    (tmp_path / "bgr.json").write_text(json.dumps(spec))
    changed = run(["check", "features", str(tmp_path / "d"), "--against", str(tmp_path / "bgr.json")])
    assert changed.exit_code == 1 and "cosine p5" in changed.output
    same = run(
        ["check", "features", str(tmp_path / "d"), "--against", str(tmp_path / "bgr.json")],
        SLUICEGATE_PREPROCESSING__COLOUR="BGR",
    )
    assert same.exit_code == 0, same.output


def test_push_ls_pull_and_check_from_s3(platform: Settings, tmp_path: Path) -> None:
    run(["dataset", "make-sample", str(tmp_path / "d"), "--count", "40"])
    pushed = run(["dataset", "push", str(tmp_path / "d"), "--name", "pcb", "--version", "v1"], platform)
    assert pushed.exit_code == 0, pushed.output
    assert "data version" in pushed.output
    listed = run(["dataset", "ls"], platform)
    assert listed.exit_code == 0 and "pcb" in listed.output and "v1" in listed.output
    pulled = run(["dataset", "pull", "pcb", "v1", str(tmp_path / "copy")], platform)
    assert pulled.exit_code == 0, pulled.output
    assert (tmp_path / "copy" / "manifest.csv").read_bytes() == (tmp_path / "d" / "manifest.csv").read_bytes()
    assert len(list((tmp_path / "copy" / "images").iterdir())) == 40
    remote = run(["check", "data", f"s3://{platform.storage.bucket}/datasets/pcb/v1/"], platform)
    assert remote.exit_code == 0, remote.output
    missing = run(["dataset", "pull", "pcb", "nope", str(tmp_path / "none")], platform)
    assert missing.exit_code == 1 and "does not exist" in missing.output


def test_train_writes_a_verified_repository_version(tmp_path: Path) -> None:
    from serving.model_format import verify_version

    run(["dataset", "make-sample", str(tmp_path / "d"), "--count", "120", "--seed", "4"])
    result = run(
        ["train", str(tmp_path / "d"), "--out", str(tmp_path / "repo")],
        SLUICEGATE_TRAINING__EPOCHS="2",
        SLUICEGATE_TRAINING__WIDTH="8",
        SLUICEGATE_HOME=str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    # The model is named after the dataset (the folder, for a local one) unless --model says otherwise.
    [version_dir] = list((tmp_path / "repo" / "d").iterdir())
    config = verify_version(version_dir)
    assert config.platform == "onnxruntime" and config.labels == ["bridge", "excess", "good", "insufficient"]
    assert config.inputs[0]["shape"] == [-1, 3, 32, 32]  # the sample's RGB 64x64, shrunk to max_size
    assert "TensorRT engine: skipped" in result.output


def test_make_digits_writes_real_grey_scans_and_train_fits_them(tmp_path: Path) -> None:
    from serving.model_format import verify_version

    made = run(["dataset", "make-digits", str(tmp_path / "pair"), "--size", "20", "--classes", "3,8"])
    assert made.exit_code == 0, made.output
    rows = (tmp_path / "pair" / "manifest.csv").read_text().splitlines()[1:]
    assert {row.split(",")[1] for row in rows} == {"3", "8"} and {row.split(",")[2] for row in rows} == {
        "train",
        "val",
        "test",
    }
    bad = run(["dataset", "make-digits", str(tmp_path / "none"), "--classes", "3,x"])
    assert bad.exit_code == 2 and "--classes" in bad.output
    result = run(
        ["train", str(tmp_path / "pair"), "--out", str(tmp_path / "repo"), "--model", "threes-and-eights"],
        SLUICEGATE_TRAINING__EPOCHS="2",
        SLUICEGATE_HOME=str(tmp_path),
    )
    assert result.exit_code == 0, result.output
    [version_dir] = list((tmp_path / "repo" / "threes-and-eights").iterdir())
    config = verify_version(version_dir)
    # One grey channel at the scans' written size: nothing enlarged, nothing converted to RGB.
    assert config.inputs[0]["shape"] == [-1, 1, 20, 20] and config.preprocessing["colour"] == "L"
    assert config.labels == ["3", "8"]


def test_train_with_an_absurd_learning_rate_fails_the_train_gate(tmp_path: Path) -> None:
    run(["dataset", "make-sample", str(tmp_path / "d"), "--count", "120", "--seed", "4"])
    result = run(
        ["train", str(tmp_path / "d"), "--out", str(tmp_path / "repo")],
        SLUICEGATE_TRAINING__EPOCHS="4",
        SLUICEGATE_TRAINING__PATIENCE="4",
        SLUICEGATE_TRAINING__WIDTH="8",
        SLUICEGATE_TRAINING__LEARNING_RATE="1000",
        SLUICEGATE_HOME=str(tmp_path),
    )
    assert result.exit_code == 1 and "train gate: FAILED" in result.output
    assert not (tmp_path / "repo").exists()
