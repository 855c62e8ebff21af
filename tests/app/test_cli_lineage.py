"""`sluicegate lineage` against a real MLflow server and a SQLite metadata store, and with MLflow down."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluicegate.app.cli.main import app
from sluicegate.settings import Settings
from tests.fixtures import lineage as history
from tests.fixtures.services import free_port

runner = CliRunner()


def settings_for(home: Path, mlflow: str, monkeypatch: pytest.MonkeyPatch) -> Settings:
    settings = Settings(
        home=home,
        mlflow={"tracking_uri": mlflow, "experiment": f"lineage-{home.name}"},
        metadata={"url": f"sqlite:///{home / 'metadata.db'}"},
        model={"name": history.MODEL},
    )
    for name, value in settings.to_env().items():
        monkeypatch.setenv(name, value)
    return settings


def run(*args: str, stdin: str | None = None):  # type: ignore[no-untyped-def]
    return runner.invoke(app, ["lineage", *args], input=stdin, env={"COLUMNS": "220"})


def test_walks_with_mlflow_from_alias_request_and_data(
    tmp_path: Path, mlflow_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = settings_for(tmp_path, mlflow_url, monkeypatch)
    seeded = history.seed(settings.metadata_url, mlflow_url, settings.mlflow.experiment)
    history.write_request_log(settings.home / "logs" / "serving.log")

    shown = run("champion", "--json")
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output)
    assert doc["format"] == "sluicegate.lineage/1" and doc["kind"] == "model" and doc["mlflow"]["reachable"]
    model = doc["model"]
    assert model["model"]["version"] == history.FIRST and model["model"]["aliases"] == ["champion"]
    assert model["model"]["aliases_source"] == "mlflow"
    training = model["training_run"]
    assert training["run_id"] == seeded.mlflow_run_ids[0] and training["best_val_accuracy"] == pytest.approx(0.8)
    assert training["url"].startswith(mlflow_url) and training["params"] == {"training.epochs": "3"}
    assert model["dataset"]["objects"] is None and model["pipeline_run"]["trigger_event"]["event_id"] == seeded.event_id
    assert set(doc) == {"format", "kind", "query", "mlflow", "request", "model", "data", "notes"}

    by_number = json.loads(run("2", "--json").output)
    assert by_number["model"]["model"]["version"] == history.SECOND and by_number["model"]["model"]["aliases"] == []

    tree = run(history.SERVER_REQUEST_ID)  # found in <home>/logs/serving.log by default
    assert tree.exit_code == 0, tree.output
    for expected in (history.FIRST, "best val accuracy 0.8000", "NVIDIA H200", "promoted", "champion -> this"):
        assert expected in tree.output
    assert f"input {history.INPUT_DIGEST}" in tree.output  # the digest is shown with its algorithm
    assert "3 objects" in tree.output and "manifest-ver-1" in tree.output

    piped = run(history.CLIENT_REQUEST_ID, "--logs", "-", stdin=(tmp_path / "logs" / "serving.log").read_text())
    assert piped.exit_code == 0 and "<stdin>:3" in piped.output and history.SECOND in piped.output

    data = json.loads(run(history.DATA[:12], "--json", "--objects").output)
    assert data["kind"] == "data" and data["data"]["champion"] == history.FIRST
    assert [o["path"] for o in data["data"]["dataset"]["objects"]] == sorted(history.OBJECTS)
    statuses = {m["version"]: m["deployments"][0]["status"] for m in data["data"]["models"]}
    assert statuses == {history.FIRST: "promoted", history.SECOND: "rolled_back"}


def test_errors_and_mlflow_down(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = settings_for(tmp_path, f"http://127.0.0.1:{free_port()}", monkeypatch)  # nothing listens
    history.seed(settings.metadata_url)

    down = run(history.FIRST)
    assert down.exit_code == 0, down.output
    assert "was not reachable" in down.output and "promoted" in down.output and "pipeline run 1" in down.output

    unknown = run("order-43")
    assert unknown.exit_code == 1 and "nothing matches 'order-43'" in unknown.output and "--logs" in unknown.output
    ambiguous = run("v1.0")
    assert ambiguous.exit_code == 1 and "ambiguous" in ambiguous.output
    missing = run("order-42", "--logs", str(tmp_path / "nowhere"))
    assert missing.exit_code == 1 and "does not exist" in missing.output

    folder = tmp_path / "collected"
    history.write_request_log(folder / "pcb-stable.txt")
    found = run("order-42", "--logs", str(folder), "--kind", "request", "--json")
    assert found.exit_code == 0, found.output
    doc = json.loads(found.output)
    assert doc["request"]["model_version"] == history.SECOND and doc["mlflow"]["reachable"] is False
    forced = run(history.FIRST, "--kind", "data")
    assert forced.exit_code == 1 and "is not 7 to 64 hex" in forced.output
