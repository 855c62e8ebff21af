"""A real server over real sockets, serving real exported models, for the serving tests."""

from __future__ import annotations

import json
from collections.abc import Generator, Iterator
from pathlib import Path

import numpy as np
import pytest

from serving.server import RunningServer, start
from serving.settings import ServingSettings
from tests.fixtures.models import LABELS, Slowed, resnet, write_model_version
from tests.serving.process import ServerProcess

MODEL = "pcb"
SHAPE = (3, 32, 32)


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``pcb`` v1 and v2 (different weights), ``slow`` (a deliberately slower model with a short queue),
    ``engine`` (a model.plan that cannot load on this host, with its ONNX next to it) and ``broken``
    (a model.onnx that is not ONNX, with rules.json as the last resort)."""
    root = tmp_path_factory.mktemp("repo")
    batching = {"max_batch_size": 8, "max_queue_delay_us": 0, "max_queue_size": 256}
    write_model_version(root, MODEL, "1", resnet(1), batching=batching)
    write_model_version(root, MODEL, "2", resnet(2), batching=batching)
    write_model_version(
        root, "slow", "1", Slowed(resnet(3), layers=40, hidden=256), batching={**batching, "max_queue_size": 4}
    )
    write_model_version(
        root,
        "engine",
        "1",
        resnet(4),
        batching=batching,
        extra_files={"model.plan": b"not an engine"},
        platform="tensorrt",
    )
    rules = {"format": 1, "output": "logits", "classes": len(LABELS), "answer": 0, "reason": "route to manual review"}
    write_model_version(
        root,
        "broken",
        "1",
        resnet(5),
        batching=batching,
        extra_files={"model.onnx": b"not an onnx file", "rules.json": json.dumps(rules).encode()},
    )
    return root


@pytest.fixture(scope="module")
def server(repo: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    settings = ServingSettings(
        repository=str(repo),
        grpc_port=0,
        http_port=0,
        cache_dir=tmp_path_factory.mktemp("cache"),
        admin_token="s3cret",
        probe_interval_s=0,
    )
    running = start(settings)
    assert running.wait_ready(120), running.dataplane.index()
    yield running
    running.stop(grace=5)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A failed test that used a server process (a fixture) shows that server's log: a worker that died
    says why there (exit status, faulthandler's stacks), and on CI the log is gone with the machine."""
    report: pytest.TestReport = yield
    if report.failed:
        for value in getattr(item, "funcargs", {}).values():
            if isinstance(value, ServerProcess):
                title = f"server log {value.log.name} (last 6000 characters)"
                report.sections.append((title, value.log_text()[-6000:]))
    return report


def batch(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, *SHAPE)).astype(np.float32)
