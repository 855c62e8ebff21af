"""KServe's own Python client (kserve 0.21) against the server, unchanged: gRPC through
``kserve.InferenceGRPCClient`` and the side port's V2 REST routes through ``kserve.InferenceRESTClient``.

kserve cannot share the project venv (it pins psutil<6 and brings FastAPI, uvicorn, pandas), so
``scripts/kserve-client-venv.sh`` builds a venv of its own and ``kserve_client_probe.py`` runs in it
against the in-process server; its answers are compared with ONNX Runtime run here on the same file.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from serving.server import RunningServer
from tests.serving.conftest import MODEL, SHAPE
from tests.serving.test_server import reference

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "kserve-client-venv.sh"
PROBE = Path(__file__).with_name("kserve_client_probe.py")
ROWS, SEED = 1, 7


@pytest.fixture(scope="module")
def kserve_python() -> Path:
    """The venv python with kserve==0.21.0, built (or reused) by scripts/kserve-client-venv.sh."""
    built = subprocess.run(
        ["bash", str(SCRIPT)], capture_output=True, text=True, timeout=540, env={**os.environ, "PYTHON": sys.executable}
    )
    if built.returncode != 0:
        tail = built.stderr[-3000:]
        # No skip: `make test` builds this venv first (client-venvs); a failure here is a broken set-up.
        pytest.fail(f"{SCRIPT} could not build the kserve client venv (exit {built.returncode}):\n{tail}")
    return Path(built.stdout.strip().splitlines()[-1])


def probe(python: Path, *args: str) -> tuple[int, dict[str, Any]]:
    ran = subprocess.run(
        [
            str(python),
            str(PROBE),
            "--model",
            MODEL,
            "--shape",
            ",".join(map(str, (ROWS, *SHAPE))),
            "--seed",
            str(SEED),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.stdout.strip(), f"probe printed nothing (exit {ran.returncode}):\n{ran.stderr[-3000:]}"
    return ran.returncode, json.loads(ran.stdout.strip().splitlines()[-1])


def given() -> np.ndarray:
    """The probe's input, made the same way (seeded standard normal), checked by hash below."""
    return np.random.default_rng(SEED).standard_normal((ROWS, *SHAPE)).astype(np.float32)


def logits(result: dict[str, Any]) -> np.ndarray:
    assert result["ok"], result
    out = result["value"]["outputs"]["logits"]
    assert out["datatype"] == "FP32"
    return np.asarray(out["data"], dtype=np.float32).reshape(out["shape"])


def test_kserves_grpc_client_gets_onnx_runtimes_answer(kserve_python: Path, server: RunningServer, repo: Path) -> None:
    code, report = probe(kserve_python, "--target", f"127.0.0.1:{server.grpc_port}")
    assert code == 0 and report["ok"], report
    x = given()
    assert report["input_sha256"] == hashlib.sha256(x.tobytes()).hexdigest()
    grpc = report["grpc"]
    assert all(grpc[name]["value"] is True for name in ("server_live", "server_ready", "model_ready")), grpc
    meta = grpc["metadata"]["value"]
    assert meta["name"] == MODEL and set(meta["versions"]) == {"1", "2"}
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": ["-1", "3", "32", "32"]}]
    assert [o["name"] for o in meta["outputs"]] == ["logits"]
    for check in ("infer_raw", "infer_typed"):
        version = grpc[check]["value"]["model_version"]
        assert version in {"1", "2"} and grpc[check]["value"]["id"] == f"kserve-probe-{int(check == 'infer_raw')}"
        np.testing.assert_allclose(logits(grpc[check]), reference(repo, MODEL, version, x), rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def rest(kserve_python: Path, server: RunningServer) -> dict[str, Any]:
    """The probe's REST checks (its exit code is 1 when any of them fails)."""
    _, report = probe(kserve_python, "--rest-url", f"http://127.0.0.1:{server.http_port}")
    assert report["input_sha256"] == hashlib.sha256(given().tobytes()).hexdigest()
    return dict(report["rest"])


def test_kserves_rest_client_on_the_side_port(rest: dict[str, Any], repo: Path) -> None:
    """What KServe's REST client can do on the side port's V2 routes today; the rest is pinned below."""
    assert rest["model_ready"] == {"ok": True, "value": True}, rest
    meta = rest["metadata"]["value"]
    assert meta["inputs"] == [{"name": "input", "datatype": "FP32", "shape": [-1, 3, 32, 32]}]
    # KServe's REST client drops model_version from the answer (InferResponse.from_bytes does not read it)
    # and cannot name a version in its URL, so the answer must match one of the served versions.
    assert rest["infer_json"]["value"]["id"] == "kserve-probe-0"
    got, x = logits(rest["infer_json"]), given()
    served = [v for v in meta["versions"] if np.allclose(got, reference(repo, MODEL, v, x), rtol=1e-5, atol=1e-5)]
    assert len(served) == 1, f"the REST answer {got} matches no served version of {MODEL} (or several)"


def test_kserves_rest_client_health_and_binary_infer(rest: dict[str, Any], repo: Path) -> None:
    """KServe's REST client's defaults: JSON health bodies and binary tensor data (Triton's extension)."""
    assert all(rest[name]["ok"] for name in ("server_live", "server_ready", "infer_binary")), rest
    got, x = logits(rest["infer_binary"]), given()
    assert any(np.allclose(got, reference(repo, MODEL, v, x), rtol=1e-5, atol=1e-5) for v in ("1", "2"))
