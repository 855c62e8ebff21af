"""Gate 5 inside the pipeline against real services: the candidate against a registered champion, the
challenger alias, the reports (MLflow plots and model card, Prefect artifacts) and the recorded moves."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from flows.evaluate import CONFUSION_PNG, artifact_url
from flows.pipeline import pipeline
from sluicegate.errors import GateFailed
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.model_versions import alias_history
from sluicegate.settings import Settings
from tasks import registry, tracking
from tasks.sample_data import make_sample
from tasks.transfer import push_directory
from tests.fixtures.models import move, register


def holder(settings: Settings, alias: str) -> str | None:
    found = registry.alias_holder(settings.mlflow.url, settings.model.name, alias)
    return None if found is None else found.registry_version


def push_sample(settings: Settings, folder: Path, label: str, count: int = 240) -> str:
    make_sample(folder, count=count, seed=7)
    return push_directory(settings, folder, "pcb", label).manifest_key


def test_a_better_candidate_becomes_challenger_and_a_worse_one_leaves_the_champion(
    platform: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = push_sample(platform, tmp_path / "data", "v1")
    # The candidate must also beat a linear probe on 16x16 thumbnails (about 0.64 on this sample), which
    # the wiring tests' two-epoch, width-8 network does not: width 16 and 30 epochs do, within a minute.
    wider = platform.model_copy(update={"training": platform.training.model_copy(update={"width": 16})})
    weak = register(wider, "v0.0.1-0000000-0000000", seed=0, alias="champion")
    monkeypatch.setenv("SLUICEGATE_TRAINING__EPOCHS", "30")
    monkeypatch.setenv("SLUICEGATE_TRAINING__WIDTH", "16")
    # Same architecture and width: the latency rule has its own test with a deliberately slower model;
    # here a loose ratio keeps scheduler noise of a 30-call measurement from deciding the outcome.
    monkeypatch.setenv("SLUICEGATE_EVAL_GATE__MAX_LATENCY_RATIO", "1.5")
    # The default margin over the baselines (the wiring fixture switches them off for random images).
    monkeypatch.setenv("SLUICEGATE_EVAL_GATE__BASELINE_MARGIN", "0.005")

    result = pipeline(bucket=platform.storage.bucket, key=key, trigger="manual")

    assert result["challenger"] is True
    assert holder(platform, "challenger") == result["registry_version"]
    assert holder(platform, "champion") == weak.registry_version  # the champion moves only after a canary
    flow_run_id = assert_recorded_as_challenger(platform, result)
    client = tracking.client(platform.mlflow.url)
    assert_eval_artifacts(platform, client, result, flow_run_id, tmp_path)
    candidate = registry.get_version(platform.mlflow.url, platform.model.name, result["registry_version"])
    assert candidate.tags[registry.TAG_EVAL_GATE] == "passed"

    # The good candidate wins its canary (simulated here): champion. A barely trained one must now lose.
    move(platform, candidate, "champion", "canary passed (simulated)")
    monkeypatch.setenv("SLUICEGATE_TRAINING__EPOCHS", "1")
    monkeypatch.setenv("SLUICEGATE_TRAINING__LEARNING_RATE", "1e-6")
    # A few near-still steps make a flat loss curve whose batch-to-batch noise, normalised to [0, 1], trips
    # the train gate's smoothness check before the eval gate is reached; the train gate has its own tests.
    monkeypatch.setenv("SLUICEGATE_TRAIN_GATE__MAX_ROUGHNESS", "1.0")
    with pytest.raises(GateFailed, match=r"eval gate failed: accuracy vs champion observed .*; beats linear baseline"):
        pipeline(bucket=platform.storage.bucket, key=key, trigger="manual")
    assert holder(platform, "champion") == candidate.registry_version
    assert holder(platform, "challenger") == candidate.registry_version
    worse = registry.list_versions(platform.mlflow.url, platform.model.name)[0]
    assert worse.registry_version != candidate.registry_version and worse.tags[registry.TAG_EVAL_GATE] == "failed"
    client.delete_registered_model(platform.model.name)


def assert_recorded_as_challenger(platform: Settings, result: dict[str, Any]) -> str | None:
    """The store's newest alias move made the run's model challenger, with the eval gate's reason, and
    the eval gate's row passed against the weak champion; returns the run's Prefect flow-run id."""
    store = MetadataStore(platform.metadata_url)
    with store.session() as session:
        moves = alias_history(session, platform.model.name)
        latest = moves[0]
        assert (latest.alias, latest.registry_version, latest.previous_registry_version) == (
            "challenger",
            result["registry_version"],
            None,
        )
        assert latest.actor.startswith("pipeline:") and latest.pipeline_run_id == result["pipeline_run_id"]
        assert latest.reason.startswith("eval gate passed: accuracy ") and "v0.0.1-0000000-0000000" in latest.reason
        from sluicegate.metadata.gates import gate_results_for_run

        row = {g.gate: g for g in gate_results_for_run(session, result["pipeline_run_id"])}["eval"]
        assert row.passed and row.metrics["metrics"]["champion_version"] == "v0.0.1-0000000-0000000"
        assert row.metrics["metrics"]["candidate_accuracy"] >= row.metrics["metrics"]["champion_accuracy"] + 0.005
        # The baselines were fit on the run's train split (70% of 240) and the candidate beat them.
        assert row.metrics["metrics"]["baseline_train_images"] == 168
        assert row.metrics["metrics"]["candidate_accuracy"] >= row.metrics["metrics"]["baseline_linear_accuracy"]
        assert {"beats majority class", "beats linear baseline"} <= {c["name"] for c in row.metrics["checks"]}
        flow_run_id = session.get(
            __import__("sluicegate.metadata", fromlist=["x"]).PipelineRun, result["pipeline_run_id"]
        ).prefect_flow_run_id  # type: ignore[union-attr]
    store.dispose()
    return flow_run_id  # type: ignore[no-any-return]


def assert_eval_artifacts(
    platform: Settings, client: Any, result: dict[str, Any], flow_run_id: str | None, tmp_path: Path
) -> None:
    """The eval gate's reports, plots and metrics in MLflow, the model card, and its Prefect artifacts."""
    run_id = result["mlflow_run_id"]
    names = {a.path for a in client.list_artifacts(run_id, "gates/eval")}
    assert {CONFUSION_PNG, "gates/eval/calibration.png", "gates/eval/report.md", "gates/eval/evaluations.json"} <= names
    card = Path(client.download_artifacts(run_id, "model_card.md", str(tmp_path))).read_text()
    assert result["model_version"] in card and result["data_version"] in card and "## Limitations" in card
    metrics = client.get_run(run_id).data.metrics
    assert {"eval.candidate.accuracy", "eval.champion.accuracy", "eval.candidate.p95_ms_b8"} <= set(metrics)
    assert {"baseline_linear_accuracy", "baseline_majority_accuracy", "baseline_linear_seconds"} <= set(metrics)
    assert 0.5 <= metrics["baseline_linear_accuracy"] <= 1 and "linear baseline" in card  # 0.64 measured
    image = httpx.get(artifact_url(platform.mlflow.url, run_id, CONFUSION_PNG))
    assert image.status_code == 200 and image.content.startswith(b"\x89PNG")
    found = httpx.post(
        f"{platform.prefect.url}/artifacts/filter", json={"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}}
    ).json()
    by_key = {a["key"]: a for a in found}
    assert "| metric | candidate | champion | majority class | linear baseline |" in by_key["eval-gate-pcb"]["data"]
    assert by_key["eval-confusion-matrix-pcb"]["type"] == "image"


def test_the_first_model_must_clear_the_floor(
    platform: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = push_sample(platform, tmp_path / "data", "first", count=120)
    monkeypatch.setenv("SLUICEGATE_EVAL_GATE__FIRST_MODEL_MIN_ACCURACY", "0.99")
    monkeypatch.setenv("SLUICEGATE_TRAINING__EPOCHS", "1")
    monkeypatch.setenv("SLUICEGATE_TRAINING__LEARNING_RATE", "1e-6")
    with pytest.raises(GateFailed, match=r"accuracy \(first model\) observed .* \(required >= 0\.99"):
        pipeline(bucket=platform.storage.bucket, key=key, trigger="manual")
    assert holder(platform, "challenger") is None and holder(platform, "champion") is None
    (only,) = registry.list_versions(platform.mlflow.url, platform.model.name)
    assert only.tags[registry.TAG_EVAL_GATE] == "failed"
    tracking.client(platform.mlflow.url).delete_registered_model(platform.model.name)


def test_a_champion_whose_files_are_broken_fails_the_gate_with_the_fix(
    platform: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key = push_sample(platform, tmp_path / "data", "broken-champion", count=60)
    client = tracking.client(platform.mlflow.url)
    run = client.create_run(tracking.experiment_id(client, platform.mlflow.experiment))
    client.log_text(run.info.run_id, "not a model", "model/config.json")
    client.create_registered_model(platform.model.name)
    version = client.create_model_version(
        platform.model.name, source=f"{run.info.artifact_uri}/model", run_id=run.info.run_id
    )
    move(platform, registry.get_version(platform.mlflow.url, platform.model.name, version.version), "champion", "t")
    with pytest.raises(
        GateFailed, match=r"champion evaluable observed RepositoryError: .*config\.json is not valid JSON"
    ):
        pipeline(bucket=platform.storage.bucket, key=key, trigger="manual")
    assert holder(platform, "champion") == version.version and holder(platform, "challenger") is None
    client.delete_registered_model(platform.model.name)
