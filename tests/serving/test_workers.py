"""The server with two worker processes behind one supervisor (serving/supervisor.py): the V2 protocol on
the shared ports, admin changes that reach every worker whichever one the kernel handed the call to,
metrics summed over the workers, a killed worker restarted with the current state, SIGTERM, and the
usable-CPU count that sets the default."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import onnxruntime as ort
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from serving.cpus import cgroup_quota, parse_cpu_max, usable_cpus
from serving.proto import admin_pb2, admin_pb2_grpc
from serving.proto import grpc_service_pb2 as pb
from serving.proto import grpc_service_pb2_grpc as pb_grpc
from serving.scheduling import thread_policies
from serving.supervisor import signal_name
from tests.fixtures.models import resnet, write_model_version
from tests.serving.conftest import batch
from tests.serving.process import ROOT, ServerProcess

TOKEN = "workers-admin-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
# Connections the tests open: the kernel spreads connections over the workers by a hash of the client's
# port, so with 32 both workers get some except with probability 2**-31.
CHANNELS = 32


@pytest.fixture(scope="module")
def small_repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pcb`` v1 and v2 (different weights) and ``aux`` (the model the load/unload tests move)."""
    root = tmp_path_factory.mktemp("workers-repo")
    batching = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}
    write_model_version(root, "pcb", "1", resnet(1), batching=batching)
    write_model_version(root, "pcb", "2", resnet(2), batching=batching)
    write_model_version(root, "aux", "1", resnet(3), batching=batching)
    return root


@pytest.fixture(scope="module")
def server(small_repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    tmp = tmp_path_factory.mktemp("workers")
    env = {"WORKERS": "2", "RUNTIME_DIR": str(tmp / "run"), "ADMIN_TOKEN": TOKEN}
    process = ServerProcess(small_repo, tmp, env)
    process.wait_workers(2)
    yield process
    process.stop()


@pytest.fixture
def channels(server: ServerProcess) -> Iterator[list[grpc.Channel]]:
    # A local subchannel pool per channel: by default gRPC shares one connection between channels to the
    # same target, and one connection is one worker.
    opened = [
        grpc.insecure_channel(f"127.0.0.1:{server.grpc_port}", options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(CHANNELS)
    ]
    yield opened
    for channel in opened:
        channel.close()


def inference(channel: grpc.Channel) -> Any:
    return pb_grpc.GRPCInferenceServiceStub(channel)  # type: ignore[no-untyped-call]


def admin(channel: grpc.Channel) -> Any:
    return admin_pb2_grpc.TrafficAdminStub(channel)  # type: ignore[no-untyped-call]


def infer_request(model: str, x: np.ndarray, version: str = "") -> pb.ModelInferRequest:
    request = pb.ModelInferRequest(model_name=model, model_version=version)
    request.inputs.add(name="input", datatype="FP32", shape=list(x.shape))
    request.raw_input_contents.append(x.tobytes())
    return request


def logits(response: pb.ModelInferResponse) -> np.ndarray:
    shape = tuple(response.outputs[0].shape)
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(shape)


def requests_total(server: ServerProcess, model: str, version: str, code: str = "OK") -> float:
    text = server.http("GET", "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        if family.name == "sluicegate_inference_requests":
            for sample in family.samples:
                labels = sample.labels
                if sample.name.endswith("_total") and (labels["model"], labels["version"], labels["code"]) == (
                    model,
                    version,
                    code,
                ):
                    return float(sample.value)
    return 0.0


def test_v2_protocol_on_every_worker_with_summed_metrics(
    server: ServerProcess, channels: list[grpc.Channel], small_repo: Path
) -> None:
    x = batch(2, seed=7)
    expected = ort.InferenceSession(str(small_repo / "pcb" / "2" / "model.onnx")).run(None, {"input": x})[0]
    before_metric = requests_total(server, "pcb", "2")
    before = {w["pid"]: w["requests"].get("pcb/2", 0) for w in server.workers()}
    for channel in channels:
        stub = inference(channel)
        assert stub.ServerLive(pb.ServerLiveRequest(), timeout=10).live
        assert stub.ServerReady(pb.ServerReadyRequest(), timeout=10).ready
        meta = stub.ModelMetadata(pb.ModelMetadataRequest(name="pcb"), timeout=10)
        assert list(meta.versions) == ["1", "2"] and meta.inputs[0].name == "input"
        answer = stub.ModelInfer(infer_request("pcb", x), timeout=30)
        assert answer.model_version == "2"  # no weights: the newest version
        np.testing.assert_allclose(logits(answer), expected, rtol=1e-4, atol=1e-5)
    served = {w["pid"]: w["requests"]["pcb/2"] - before.get(w["pid"], 0) for w in server.workers()}
    assert len(served) == 2 and all(count > 0 for count in served.values()), served  # both workers answered
    assert sum(served.values()) == CHANNELS
    # /metrics from whichever worker answers counts both workers' requests.
    assert requests_total(server, "pcb", "2") - before_metric == CHANNELS
    families = {f.name: f for f in text_string_to_metric_families(server.http("GET", "/metrics").text)}
    assert [s.value for s in families["sluicegate_server_ready"].samples] == [1.0]  # the minimum over workers
    levels = [s for s in families["sluicegate_runtime_fallback_level"].samples if s.labels["model"] == "pcb"]
    assert {s.labels["pid"] for s in levels} == set(map(str, served))  # one series per worker


def test_unload_and_load_through_one_connection_reach_every_worker(
    server: ServerProcess, channels: list[grpc.Channel]
) -> None:
    inference(channels[0]).RepositoryModelUnload(
        pb.RepositoryModelUnloadRequest(model_name="aux"), metadata=AUTH, timeout=60
    )
    assert [("aux" in w["models"]) for w in server.workers()] == [False, False]
    for channel in channels:
        stub = inference(channel)
        assert not stub.ModelReady(pb.ModelReadyRequest(name="aux"), timeout=10).ready
        with pytest.raises(grpc.RpcError) as refused:
            stub.ModelInfer(infer_request("aux", batch(1, seed=1)), timeout=10)
        assert refused.value.code() in {grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE}
    # The unloaded version's series leave the aggregate too (multiprocess files keep them: filtered).
    assert 'model="aux"' not in server.http("GET", "/metrics", timeout=10).text
    # Loaded again over REST, through one HTTP connection.
    answer = server.http(
        "POST", "/v2/repository/models/aux/load", json={}, headers={"authorization": f"Bearer {TOKEN}"}, timeout=60
    )
    assert answer.status_code == 200, answer.text
    assert [w["models"].get("aux") for w in server.workers()] == [["1"], ["1"]]
    assert all(w["ready"] for w in server.workers())
    for channel in channels:
        assert inference(channel).ModelReady(pb.ModelReadyRequest(name="aux"), timeout=10).ready


def test_traffic_weights_are_the_same_on_every_worker(server: ServerProcess, channels: list[grpc.Channel]) -> None:
    admin(channels[0]).SetTrafficWeights(
        admin_pb2.SetTrafficWeightsRequest(model_name="pcb", weights={"1": 100, "2": 0}), metadata=AUTH, timeout=30
    )
    assert [w["weights"]["pcb"] for w in server.workers()] == [{"1": 100, "2": 0}] * 2
    for channel in channels:
        got = admin(channel).GetTrafficWeights(admin_pb2.GetTrafficWeightsRequest(model_name="pcb"), timeout=10)
        assert dict(got.weights) == {"1": 100, "2": 0}
        answer = inference(channel).ModelInfer(infer_request("pcb", batch(1, seed=3)))
        assert answer.model_version == "1"  # every worker routes by the weights set through one of them
    # Over REST, and a refused change (a version that is not loaded) changes no worker.
    put = server.http(
        "PUT",
        "/v2/models/pcb/traffic",
        json={"weights": {"1": 0, "2": 5}},
        headers={"authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    assert put.status_code == 200, put.text
    bad = server.http(
        "PUT", "/v2/models/pcb/traffic", json={"weights": {"9": 5}}, headers={"authorization": f"Bearer {TOKEN}"}
    )
    assert bad.status_code == 404, bad.text
    assert [w["weights"]["pcb"] for w in server.workers()] == [{"1": 0, "2": 5}] * 2
    server.http(
        "PUT", "/v2/models/pcb/traffic", json={"weights": {"2": 1}}, headers={"authorization": f"Bearer {TOKEN}"}
    ).raise_for_status()


def test_killed_worker_restarts_with_current_models_weights_and_counts(
    server: ServerProcess, channels: list[grpc.Channel]
) -> None:
    stub = inference(channels[0])
    stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="aux"), metadata=AUTH, timeout=60)
    admin(channels[0]).SetTrafficWeights(
        admin_pb2.SetTrafficWeightsRequest(model_name="pcb", weights={"1": 3, "2": 7}), metadata=AUTH, timeout=30
    )
    counted = requests_total(server, "pcb", "2")
    victim = server.workers()[1]["pid"]
    os.kill(victim, signal.SIGSEGV)  # as a crash in native code would: faulthandler prints, nothing cleans up
    server.wait_workers(2, exclude_pids=frozenset({victim}))
    workers = server.workers()
    assert victim not in {w["pid"] for w in workers}
    assert [sorted(w["models"]) for w in workers] == [["pcb"], ["pcb"]]  # aux stays unloaded on the new one
    assert [w["weights"]["pcb"] for w in workers] == [{"1": 3, "2": 7}] * 2
    # The dead worker's requests stay counted; the supervisor logged the restart, the worker its stacks.
    assert requests_total(server, "pcb", "2") == counted
    assert f"(pid {victim}) exited with -11 (SIGSEGV); restarting" in server.log_text()
    assert "Fatal Python error: Segmentation fault" in server.log_text()
    stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="aux"), metadata=AUTH, timeout=60)
    admin(channels[0]).SetTrafficWeights(
        admin_pb2.SetTrafficWeightsRequest(model_name="pcb", weights={"2": 1}), metadata=AUTH, timeout=30
    )


def test_sigterm_stops_every_worker_and_exits_zero(small_repo: Path, tmp_path: Path) -> None:
    process = ServerProcess(small_repo, tmp_path, {"WORKERS": "2", "RUNTIME_DIR": str(tmp_path / "run")})
    try:
        process.wait_workers(2)
        pids = [w["pid"] for w in process.workers()]
        process.proc.send_signal(signal.SIGTERM)
        assert process.proc.wait(60) == 0, process.log_text()[-3000:]
        assert not [pid for pid in pids if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        assert process.log_text().count('"server stopped"') == 2
    finally:
        process.stop()


def test_a_worker_that_cannot_start_fails_the_server(tmp_path: Path) -> None:
    env = {**os.environ, "SLUICEGATE_SERVING__WORKERS": "2", "SLUICEGATE_SERVING__RUNTIME_DIR": str(tmp_path)}
    args = [sys.executable, "-m", "serving", "--grpc-port", "0", "--http-port", "0"]  # no repository
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "could not start" in done.stderr


def test_a_port_another_server_listens_on_is_refused(small_repo: Path, tmp_path: Path) -> None:
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        env = {**os.environ, "SLUICEGATE_SERVING__WORKERS": "2", "SLUICEGATE_SERVING__RUNTIME_DIR": str(tmp_path)}
        args = [sys.executable, "-m", "serving", "--repo", str(small_repo), "--grpc-port", str(port)]
        done = subprocess.run(
            [*args, "--http-port", "0"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60
        )
    assert done.returncode != 0
    assert f"127.0.0.1:{port} is already served by another process" in done.stderr


def test_supervisor_and_workers_run_every_thread_with_the_batch_policy(server: ServerProcess) -> None:
    """The default ``cpu_policy``: chosen in main() before any thread starts, inherited by the workers."""
    processes = [server.ps, *server.ps.children(recursive=True)]
    assert len(processes) == 3  # the supervisor and its two workers
    for process in processes:
        policies = thread_policies(Path(f"/proc/{process.pid}/task"))
        assert len(policies) >= (1 if process is server.ps else 10)  # a worker: gRPC, ORT, telemetry threads
        assert set(policies.values()) == {os.SCHED_BATCH}, (process.pid, policies)


def test_cpu_count_follows_the_cgroup_quota(tmp_path: Path) -> None:
    (tmp_path / "kubepods" / "pod1").mkdir(parents=True)
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "kubepods" / "cpu.max").write_text("250000 100000\n")  # the pod: 2.5 CPUs
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("max 100000\n")  # the container: no own limit
    proc = tmp_path / "proc-cgroup"
    proc.write_text("0::/kubepods/pod1\n")
    assert cgroup_quota(tmp_path, proc) == 2.5
    assert usable_cpus(tmp_path, proc) == min(3, len(os.sched_getaffinity(0)))
    (tmp_path / "kubepods" / "pod1" / "cpu.max").write_text("50000 100000\n")  # half a CPU: still one worker
    assert usable_cpus(tmp_path, proc) == 1
    assert parse_cpu_max(tmp_path / "cpu.max") is None
    proc.write_text("1:cpu:/\n")  # cgroup v1 only: the affinity alone
    assert usable_cpus(tmp_path, proc) == len(os.sched_getaffinity(0))


def test_a_change_a_sibling_refuses_is_an_error_naming_that_worker(
    server: ServerProcess, channels: list[grpc.Channel]
) -> None:
    from serving.siblings import Change, call, sibling_sockets

    assert server.runtime_dir is not None
    secret = (server.runtime_dir / "secret").read_text()
    (_, second) = sibling_sockets(server.runtime_dir)[1]
    # Worker 1 alone loses aux (as a sibling would tell it), so a weights change for aux fails there only.
    call(second, "Apply", Change("unload", "aux").encode(), secret, timeout=60)
    try:
        outcomes = set()
        for channel in channels:
            try:
                admin(channel).SetTrafficWeights(
                    admin_pb2.SetTrafficWeightsRequest(model_name="aux", weights={"1": 5}), metadata=AUTH, timeout=30
                )
                outcomes.add("OK")
            except grpc.RpcError as exc:
                outcomes.add(f"{exc.code().name}: {exc.details()}")
        # On worker 0 the change applies, then worker 1 refuses it; on worker 1 it is refused at once.
        assert any(o.startswith("INTERNAL") and "failed on worker 1: NOT_FOUND" in o for o in outcomes), outcomes
        assert any(o.startswith("NOT_FOUND") for o in outcomes), outcomes
        assert "OK" not in outcomes
    finally:
        call(second, "Apply", Change("load", "aux").encode(), secret, timeout=60)
        # Through the front door, so the shared state forgets the half-applied weights too.
        stub = inference(channels[0])
        stub.RepositoryModelUnload(pb.RepositoryModelUnloadRequest(model_name="aux"), metadata=AUTH, timeout=60)
        stub.RepositoryModelLoad(pb.RepositoryModelLoadRequest(model_name="aux"), metadata=AUTH, timeout=60)
    assert [w["models"].get("aux") for w in server.workers()] == [["1"], ["1"]]


def test_an_exit_by_signal_is_logged_with_the_signal_name() -> None:
    assert [signal_name(code) for code in (-9, -11, -6)] == [" (SIGKILL)", " (SIGSEGV)", " (SIGABRT)"]
    assert [signal_name(code) for code in (0, 1, None, -999)] == ["", "", "", ""]
