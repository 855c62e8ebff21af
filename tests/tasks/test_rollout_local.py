"""The canary on one machine: a real model server, the local platform moving its version weights, the
metrics read from its /metrics, and two client threads sending steady traffic throughout.

A good candidate goes through every step (5, 20, 50 %) and is promoted; a slower one (a 40 ms batching
delay) and an erroring one (outputs twice the rows it was given) are
rolled back at the first step. The steady client never sees a failed request caused by the rollout
itself: none at all with a good or slow canary, and with the erroring canary none after the rollback.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import tritonclient.grpc as triton

from serving.server import RunningServer, start
from serving.settings import ServingSettings
from sluicegate.app.stack.services import Part
from tasks.rollout.local import ClientTls, LocalPlatform
from tasks.rollout.metrics import ScrapeSource
from tasks.rollout.plan import RolloutPlan, Thresholds
from tasks.rollout.platform import PlatformError
from tasks.rollout.runner import Hooks, run_rollout
from tests.fixtures import tls as tls_fixture
from tests.fixtures.models import SPEC, Doubled, resnet, write_model_version
from tests.fixtures.tls import make_pki

MODEL = "pcb"
TOKEN = "rollout-test-token"
BATCHING = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Every candidate version, built once, waiting to be fetched into the served repository."""
    staging = tmp_path_factory.mktemp("staging")
    write_model_version(staging, MODEL, "1", resnet(1), batching=BATCHING)
    write_model_version(staging, MODEL, "2", resnet(2), batching=BATCHING)
    # Injected latency without burning CPU: a candidate shipped with a 40 ms batching delay makes every
    # lone request wait for company (a real misconfiguration), while the two cores stay free for the rest.
    slow_batching = {**BATCHING, "max_queue_delay_us": 40_000}
    write_model_version(staging, MODEL, "3-slow", resnet(2), batching=slow_batching)
    write_model_version(staging, MODEL, "4-errors", Doubled(resnet(2)), batching=BATCHING)
    return staging


@dataclass
class Served:
    server: RunningServer
    platform: LocalPlatform
    repo: Path


@pytest.fixture
def served(staged: Path, tmp_path: Path) -> Iterator[Served]:
    repo = tmp_path / "repo"
    shutil.copytree(staged / MODEL / "1", repo / MODEL / "1")

    def fetch(model: str, version: str, target: Path) -> None:
        shutil.copytree(staged / model / version, target)

    settings = ServingSettings(
        repository=str(repo), grpc_port=0, http_port=0, cache_dir=tmp_path / "cache", admin_token=TOKEN
    )
    server = start(settings)
    try:
        assert server.wait_ready(120)
        platform = LocalPlatform(
            repo, f"127.0.0.1:{server.grpc_port}", f"http://127.0.0.1:{server.http_port}", TOKEN, fetch=fetch
        )
        platform.adopt(MODEL, "1")
        yield Served(server, platform, repo)
    finally:
        server.stop(grace=5, delay=0)  # nothing routes to a test server: no not-ready delay


@dataclass
class SteadyClient:
    """Two threads sending single-image requests without a version, as production traffic does."""

    target: str
    answers: list[tuple[float, str | None]] = field(default_factory=list)  # (time, version or None: failed)
    errors: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def start(self) -> None:
        for seed in range(2):
            thread = threading.Thread(target=self._run, args=(seed,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _run(self, seed: int) -> None:
        client = triton.InferenceServerClient(self.target)
        rng = np.random.default_rng(seed)
        while not self._stop.is_set():
            x = rng.normal(size=(1, 3, SPEC.height, SPEC.width)).astype(np.float32)
            given = triton.InferInput("input", list(x.shape), "FP32")
            given.set_data_from_numpy(x)
            try:
                answer = client.infer(MODEL, [given])
                self.answers.append((time.monotonic(), answer.get_response().model_version))
            except Exception as exc:  # every failure is what the test is about
                self.answers.append((time.monotonic(), None))
                self.errors.append(str(exc))


def plan() -> RolloutPlan:
    # Looser latency bounds than production's: server, client threads and both versions share two cores
    # and one GIL here, so two equal models' p95s over a few dozen requests differ by a few ms. The slow
    # candidate is 10+ ms slower, far outside them.
    thresholds = Thresholds(max_p95_increase=0.5, min_p95_delta_s=0.010)
    return RolloutPlan(hold_s=2.0, analysis_interval_s=0.5, min_requests=20, max_inconclusive=10, thresholds=thresholds)


def roll(served: Served, version: str) -> tuple[object, SteadyClient, list[dict[str, object]]]:
    client = SteadyClient(f"127.0.0.1:{served.server.grpc_port}")
    rows: list[dict[str, object]] = []
    source = ScrapeSource([f"http://127.0.0.1:{served.server.http_port}/metrics"])
    client.start()
    try:
        time.sleep(0.5)  # traffic before the canary starts, as in production
        outcome = run_rollout(
            MODEL, version, platform=served.platform, source=source, plan=plan(), hooks=Hooks(on_step=rows.append)
        )
        time.sleep(0.5)
    finally:
        client.stop()
    return outcome, client, rows


def test_a_good_candidate_goes_through_every_step_and_is_promoted(served: Served) -> None:
    outcome, client, rows = roll(served, "2")
    assert outcome.status == "promoted", outcome  # type: ignore[attr-defined]
    judged = {row["canary_weight"]: row for row in rows}
    assert sorted(judged) == [5, 20, 50]
    assert all(row["decision"] == "pass" for row in judged.values())
    assert client.errors == []
    versions = [v for _, v in client.answers]
    assert "1" in versions and "2" in versions
    assert versions[-1] == "2"  # after the promotion everything goes to the new version
    state = served.platform.state(MODEL)
    assert (state.stable_version, state.canary_version, state.previous_stable_version) == ("2", None, "1")
    assert not (served.repo / MODEL / "1").exists()  # retired after the promotion


@pytest.mark.parametrize("bad", ["3-slow", "4-errors"])
def test_a_bad_candidate_is_rolled_back_at_the_first_step(served: Served, bad: str) -> None:
    outcome, client, rows = roll(served, bad)
    assert outcome.status == "rolled_back", outcome  # type: ignore[attr-defined]
    assert {row["canary_weight"] for row in rows} == {5}  # the first step failed; no traffic moved on
    assert rows[-1]["decision"] == "fail" and outcome.detected_after_s is not None  # type: ignore[attr-defined]
    failed = rows[-1]["checks"]
    which = "latency" if bad == "3-slow" else "errors"
    assert failed[which]["passed"] is False, failed  # type: ignore[index]
    state = served.platform.state(MODEL)
    assert (state.stable_version, state.canary_version, state.canary_weight) == ("1", None, 0)
    assert not (served.repo / MODEL / bad).exists()
    rolled_back_at = max(t for t, v in client.answers if v == bad) if any(v == bad for _, v in client.answers) else 0
    if bad == "3-slow":
        assert client.errors == []
    else:
        assert all(v is None or v == "1" for _, v in client.answers)  # the erroring canary never answered
        assert client.errors, "the erroring canary served no traffic: the test injected nothing"
        last_error = max(t for t, v in client.answers if v is None)
        answered_after = [v for t, v in client.answers if t > last_error]
        assert answered_after and set(answered_after) == {"1"}  # after the rollback: only stable, no failures
    assert rolled_back_at <= max(t for t, _ in client.answers)


def test_a_rerun_after_a_crash_resumes_from_the_platform_state(served: Served) -> None:
    """A run that died after starting the canary at 20 %: the next run continues from 20 % and promotes."""
    served.platform.start_canary(MODEL, "2")
    served.platform.set_weight(MODEL, 20)
    outcome, client, rows = roll(served, "2")
    assert outcome.status == "promoted"  # type: ignore[attr-defined]
    assert min(row["canary_weight"] for row in rows) == 20  # 5 % had passed before the "crash"
    assert {row["canary_weight"] for row in rows if row["decision"] == "pass"} == {20, 50}
    assert client.errors == []


def test_another_canary_in_progress_is_refused(served: Served) -> None:
    served.platform.start_canary(MODEL, "2")
    source = ScrapeSource([f"http://127.0.0.1:{served.server.http_port}/metrics"])
    with pytest.raises(PlatformError, match="another version"):
        run_rollout(MODEL, "3-slow", platform=served.platform, source=source, plan=plan())
    served.platform.rollback(MODEL)
    assert served.platform.state(MODEL).canary_version is None


@pytest.fixture
def tls_served(staged: Path, tmp_path: Path) -> Iterator[tuple[RunningServer, tls_fixture.Pki, Path]]:
    """A mutual-TLS server on a repository holding version 1, not yet adopted."""
    pki = make_pki(tmp_path / "pki")
    repo = tmp_path / "repo"
    shutil.copytree(staged / MODEL / "1", repo / MODEL / "1")
    settings = ServingSettings(
        repository=str(repo),
        grpc_port=0,
        http_port=0,
        cache_dir=tmp_path / "cache",
        admin_token=TOKEN,
        tls_cert_file=pki.server.cert,
        tls_key_file=pki.server.key,
        tls_client_ca_file=pki.ca,
    )
    server = start(settings)
    try:
        assert server.wait_ready(120)
        yield server, pki, repo
    finally:
        server.stop(grace=5, delay=0)


def test_the_platform_drives_a_mutual_tls_server(
    tls_served: tuple[RunningServer, tls_fixture.Pki, Path], staged: Path
) -> None:
    server, pki, repo = tls_served
    tls = ClientTls(pki.ca, pki.client.cert, pki.client.key)
    grpc_target, http_url = f"127.0.0.1:{server.grpc_port}", f"https://127.0.0.1:{server.http_port}"

    def fetch(model: str, version: str, target: Path) -> None:
        shutil.copytree(staged / model / version, target)

    platform = LocalPlatform(repo, grpc_target, http_url, TOKEN, fetch=fetch, tls=tls)
    # The gRPC half (repository load with the token, readiness polling) over mutual TLS.
    shutil.copytree(staged / MODEL / "2", repo / MODEL / "2")
    platform._load(MODEL)
    platform._wait_ready(MODEL, "2")
    assert server.dataplane.model_ready(MODEL, "2")
    # Without the client certificate the handshake fails and the platform says which server refused.
    stranger = LocalPlatform(
        repo, grpc_target, http_url, TOKEN, tls=ClientTls(pki.ca, pki.stranger.cert, pki.stranger.key)
    )
    with pytest.raises(PlatformError, match="could not"):
        stranger._load(MODEL)
    state = platform.adopt(MODEL, "1")  # weights go over HTTPS with the client certificate
    assert (state.stable_version, state.canary_weight) == ("1", 0)


def test_tls_needs_an_https_side_port_url(tmp_path: Path) -> None:
    with pytest.raises(PlatformError, match="https"):
        LocalPlatform(tmp_path, "127.0.0.1:1", "http://127.0.0.1:2", TOKEN, tls=ClientTls(tmp_path / "ca.crt"))


def serving_part(parts: list[Part]) -> Part:
    return next(part for part in parts if part.name == "serving")


def test_the_rollout_tls_settings_reach_the_platform_and_the_stack_server(tmp_path: Path) -> None:
    from sluicegate.app.stack.services import parts
    from sluicegate.settings import Settings
    from tasks.rollout.local import client_tls

    pki = make_pki(tmp_path / "pki")
    rollout = {
        "local_http": "https://127.0.0.1:8000",
        "tls_ca_file": str(pki.ca),
        "tls_client_cert_file": str(pki.client.cert),
        "tls_client_key_file": str(pki.client.key),
        "local_tls_cert_file": str(pki.server.cert),
        "local_tls_key_file": str(pki.server.key),
        "admin_token": TOKEN,
    }
    settings = Settings(home=tmp_path / "home", rollout=rollout)
    assert client_tls(settings.rollout) == ClientTls(pki.ca, pki.client.cert, pki.client.key)
    env = serving_part(parts(settings)).env
    assert env["SLUICEGATE_SERVING__TLS_CERT_FILE"] == str(pki.server.cert)
    assert env["SLUICEGATE_SERVING__TLS_KEY_FILE"] == str(pki.server.key)
    assert env["SLUICEGATE_SERVING__TLS_CLIENT_CA_FILE"] == str(pki.ca)  # a client certificate: mutual TLS
    plain = Settings(home=tmp_path / "home")
    assert client_tls(plain.rollout) is None
    assert not any("TLS" in name for name in serving_part(parts(plain)).env)
    with pytest.raises(ValueError, match="https"):
        Settings(home=tmp_path / "home", rollout={"tls_ca_file": str(pki.ca)})
