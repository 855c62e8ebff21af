"""The rollout flow with the real services (MLflow, Prefect, the metadata store) and a real local model
server: the first version is deployed directly, the next one goes through the canary and takes the
``champion`` alias (rows, steps and the Prefect artifact recorded); a canary that cannot be judged is
rolled back, the ``challenger`` alias restored, and the flow run fails with the reason."""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton
from sqlalchemy import select

from flows.rollout import RolloutFailed, rollout
from serving.server import RunningServer, start
from serving.settings import ServingSettings
from sluicegate.metadata import Deployment, MetadataStore
from sluicegate.metadata.model_versions import alias_history, record_model_version
from sluicegate.settings import Settings
from tasks import registry
from tasks.dataset_gates import candidate_spec
from tests.fixtures.models import register

TOKEN = "flow-test-token"


@pytest.fixture
def server(platform: Settings, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[RunningServer]:
    repo = tmp_path / "serving-repo"
    repo.mkdir()
    running = start(
        ServingSettings(repository=str(repo), grpc_port=0, http_port=0, cache_dir=tmp_path / "cache", admin_token=TOKEN)
    )
    env = {
        "ADMIN_TOKEN": TOKEN,
        "LOCAL_REPOSITORY": str(repo),
        "LOCAL_GRPC": f"127.0.0.1:{running.grpc_port}",
        "LOCAL_HTTP": f"http://127.0.0.1:{running.http_port}",
        "STEPS": "[50, 100]",
        "HOLD_SECONDS": "1.5",
        "ANALYSIS_INTERVAL_SECONDS": "0.5",
        "MIN_REQUESTS": "5",
        # Two untrained models of one architecture on a shared 2-core machine: only gross differences.
        "MAX_P95_INCREASE": "2.0",
        "MIN_P95_DELTA_SECONDS": "0.05",
    }
    for name, value in env.items():
        monkeypatch.setenv(f"SLUICEGATE_ROLLOUT__{name}", value)
    try:
        yield running
    finally:
        running.stop(grace=2)


def record(settings: Settings, version: registry.RegistryVersion) -> None:
    store = MetadataStore(settings.metadata_url)
    try:
        with store.session() as session:
            record_model_version(
                session,
                model_name=settings.model.name,
                version=version.model_version,
                mlflow_run_id=version.run_id or "run",
                code_version="unknown",
                data_version="0" * 64,
                artifacts={},
                environment={},
                mlflow_model_version=version.registry_version,
            )
    finally:
        store.dispose()


class Traffic:
    def __init__(self, server: RunningServer, settings: Settings) -> None:
        self.stop, self.errors, self.sent = threading.Event(), [], 0
        self.client = triton.InferenceServerClient(f"127.0.0.1:{server.grpc_port}")
        spec = candidate_spec(settings, champion=None, data=None)  # what tests.fixtures.models.register uses
        x = np.zeros((1, spec.channels, spec.height, spec.width), dtype=np.float32)
        self.given = triton.InferInput("input", list(x.shape), "FP32")
        self.given.set_data_from_numpy(x)
        self.model = settings.model.name
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            try:
                self.client.infer(self.model, [self.given])
                self.sent += 1
            except Exception as exc:
                self.errors.append(str(exc))

    def __enter__(self) -> Traffic:
        self.thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        self.thread.join(30)


def test_first_version_deploys_then_a_canary_takes_champion(platform: Settings, server: RunningServer) -> None:
    first = register(platform, "v0.0.1-aaaaaaa-1111111", seed=0, alias="champion")
    second = register(platform, "v0.0.2-bbbbbbb-2222222", seed=1, alias="challenger")
    for version in (first, second):
        record(platform, version)

    result = rollout(platform.model.name, first.model_version, first.registry_version)
    assert result["status"] == "promoted" and "first version" in result["reason"]
    with Traffic(server, platform) as traffic:
        result = rollout(platform.model.name, second.model_version, second.registry_version)
    assert result["status"] == "promoted", result
    assert traffic.errors == [] and traffic.sent > 0

    holder = registry.alias_holder(platform.mlflow.url, platform.model.name, registry.CHAMPION)
    assert holder is not None and holder.registry_version == second.registry_version
    assert holder.tags.get("sluicegate.rollout") == "promoted"
    store = MetadataStore(platform.metadata_url)
    try:
        with store.session() as session:
            moved = alias_history(session, platform.model.name, registry.CHAMPION)[0]
            assert moved.actor.startswith("rollout:") and moved.registry_version == second.registry_version
            deployments = session.scalars(select(Deployment).order_by(Deployment.id)).all()
            assert [d.status for d in deployments] == ["promoted", "promoted"]
            steps = deployments[1].steps
            assert [(s.step_index, s.canary_weight, s.decision) for s in steps] == [(0, 50, "pass")]
            assert steps[0].observed["canary"]["requests"] >= 5
    finally:
        store.dispose()
    assert server.dataplane.weights(platform.model.name) == {second.model_version: 100}


def test_an_undecidable_canary_is_rolled_back_and_the_challenger_restored(
    platform: Settings, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    stable = register(platform, "v0.0.1-aaaaaaa-1111111", seed=0, alias="champion")
    earlier = register(platform, "v0.0.2-bbbbbbb-2222222", seed=1, alias="challenger")
    candidate = register(platform, "v0.0.3-ccccccc-3333333", seed=2, alias="challenger")
    for version in (stable, earlier, candidate):
        record(platform, version)
    rollout(platform.model.name, stable.model_version, stable.registry_version)
    # No traffic and a high bar: the step stays inconclusive, then fails.
    monkeypatch.setenv("SLUICEGATE_ROLLOUT__MIN_REQUESTS", "1000000")
    monkeypatch.setenv("SLUICEGATE_ROLLOUT__MAX_INCONCLUSIVE", "0")

    with pytest.raises(RolloutFailed, match="rolled back: step 0 \\(50%\\) failed: still inconclusive"):
        rollout(platform.model.name, candidate.model_version, candidate.registry_version)

    challenger = registry.alias_holder(platform.mlflow.url, platform.model.name, registry.CHALLENGER)
    assert challenger is not None and challenger.registry_version == earlier.registry_version
    champion = registry.alias_holder(platform.mlflow.url, platform.model.name, registry.CHAMPION)
    assert champion is not None and champion.registry_version == stable.registry_version
    tags = registry.get_version(platform.mlflow.url, platform.model.name, candidate.registry_version).tags
    assert tags.get("sluicegate.rollout") == "rolled_back"
    assert server.dataplane.weights(platform.model.name) == {stable.model_version: 100}
    store = MetadataStore(platform.metadata_url)
    try:
        with store.session() as session:
            last = session.scalars(select(Deployment).order_by(Deployment.id.desc())).first()
            assert last is not None and last.status == "rolled_back" and "inconclusive" in (last.reason or "")
    finally:
        store.dispose()


def test_operators_see_abort_and_promote_a_canary_from_the_cli(platform: Settings, server: RunningServer) -> None:
    import json

    from typer.testing import CliRunner

    from sluicegate.app.cli.main import app
    from tasks.rollout.config import platform_from_settings

    first = register(platform, "v0.0.1-aaaaaaa-1111111", seed=0, alias="champion")
    second = register(platform, "v0.0.2-bbbbbbb-2222222", seed=1, alias="challenger")
    for version in (first, second):
        record(platform, version)
    rollout(platform.model.name, first.model_version, first.registry_version)
    cli = CliRunner()

    def run(*args: str) -> str:
        result = cli.invoke(app, ["rollout", *args], env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        return result.output

    moving = platform_from_settings(
        Settings(), fetch=lambda m, v, t: registry.download_version(platform.mlflow.url, second, t.parent.parent)
    )
    moving.start_canary(platform.model.name, second.model_version)
    moving.set_weight(platform.model.name, 20)
    status = json.loads(run("status", "--json"))
    assert status["state"]["canary_version"] == second.model_version and status["state"]["canary_weight"] == 20
    assert status["steps"] == []  # the first deployment had no canary steps
    assert "rolled back" in run("abort")
    assert server.dataplane.weights(platform.model.name) == {first.model_version: 100}
    assert json.loads(run("status", "--json"))["state"]["canary_version"] is None

    moving.start_canary(platform.model.name, second.model_version)
    assert f"promoted: stable {second.model_version}" in run("promote")
    assert server.dataplane.weights(platform.model.name) == {second.model_version: 100}
    assert f"stable {second.model_version}" in run("status")


def test_a_paused_rollout_waits_for_resume(
    platform: Settings, server: RunningServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    import time

    from typer.testing import CliRunner

    from sluicegate.app.cli.main import app

    first = register(platform, "v0.0.1-aaaaaaa-1111111", seed=0, alias="champion")
    second = register(platform, "v0.0.2-bbbbbbb-2222222", seed=1, alias="challenger")
    for version in (first, second):
        record(platform, version)
    rollout(platform.model.name, first.model_version, first.registry_version)
    monkeypatch.setenv("SLUICEGATE_ROLLOUT__PAUSE_BEFORE", "[50]")
    outcome: dict[str, object] = {}

    def roll() -> None:
        try:
            outcome["result"] = rollout(platform.model.name, second.model_version, second.registry_version)
        except Exception as exc:  # reported by the assertions below
            outcome["error"] = exc

    with Traffic(server, platform):
        # The test's Prefect settings live in a context variable, which a new thread does not inherit.
        thread = threading.Thread(target=contextvars.copy_context().run, args=(roll,), daemon=True)
        thread.start()
        resumed, deadline, last = "", time.monotonic() + 120, None
        while time.monotonic() < deadline and not resumed:
            time.sleep(1)
            assert server.dataplane.weights(platform.model.name).get(second.model_version, 0) == 0, "moved while paused"
            result = CliRunner().invoke(app, ["rollout", "resume"], env={"COLUMNS": "200"})
            resumed = result.output if result.exit_code == 0 else ""
            last = (result.exit_code, result.output[-800:], repr(result.exception))
        assert resumed, f"the rollout never paused: {outcome} {last}"
        thread.join(180)
    assert "error" not in outcome, outcome
    assert outcome["result"]["status"] == "promoted"  # type: ignore[index]


def test_the_pipeline_runs_the_canary_as_a_subflow_after_the_eval_gate(
    platform: Settings, server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With rollout.after_pipeline, a first model goes from the S3 manifest to serving 100 % and champion."""
    from flows.pipeline import pipeline
    from tests.flows.test_evaluate import push_sample

    key = push_sample(platform, tmp_path / "data", "v1")
    monkeypatch.setenv("SLUICEGATE_ROLLOUT__AFTER_PIPELINE", "true")

    result = pipeline(bucket=platform.storage.bucket, key=key, trigger="manual")

    assert result["status"] == "succeeded" and result["challenger"] is True
    champion = registry.alias_holder(platform.mlflow.url, platform.model.name, registry.CHAMPION)
    assert champion is not None and champion.registry_version == result["registry_version"]
    assert server.dataplane.weights(platform.model.name) == {result["model_version"]: 100}
    store = MetadataStore(platform.metadata_url)
    try:
        with store.session() as session:
            deployment = session.scalars(select(Deployment)).one()
            assert deployment.status == "promoted" and deployment.model_version.version == result["model_version"]
    finally:
        store.dispose()
