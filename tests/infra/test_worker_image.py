"""The worker image (docker/worker.Dockerfile), without a Docker engine: it lints clean, runs as a
non-root user on the Makefile's CPU torch, every file either Dockerfile copies exists and passes its
.dockerignore, and the pinned requirements cover every runtime dependency within its range."""

from __future__ import annotations

import json
import re
import subprocess
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.infra.compose_file import DOCKER, ROOT, WORKER_DOCKERFILE, pinned
from tests.infra.test_serving_image import hadolint

# -- the worker image ------------------------------------------------------------------------------------


def test_the_worker_dockerfile_lints_clean() -> None:
    result = subprocess.run([hadolint(), "--format", "json", str(WORKER_DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0 and json.loads(result.stdout or "[]") == [], result.stdout


def test_the_worker_image_is_non_root_on_the_cpu_torch_of_the_makefile() -> None:
    text = WORKER_DOCKERFILE.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and not users[-1].startswith(("0", "root"))
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim\S*$", text, flags=re.M)
    torch = re.search(r"^TORCH_SPEC \?= torch==(\S+)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert torch and f"ARG TORCH_VERSION={torch.group(1)}\n" in text
    assert "ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu" in text
    torch_line = text.index('"torch==${TORCH_VERSION}"')
    assert torch_line < text.index("-r requirements.txt") < text.index("--no-deps .")
    assert "pip check" in text


# -- the GPU worker image ----------------------------------------------------------------------------------

GPU_DOCKERFILE = DOCKER / "worker-gpu.Dockerfile"
# The TensorRT in each NVIDIA TensorRT container release (its release notes): an engine built by the GPU
# worker loads in the serving image only with the same TensorRT, so the two images move together.
TENSORRT_OF_RELEASE = {"25.01": "10.8.0.43"}


def test_the_gpu_worker_dockerfile_lints_clean() -> None:
    result = subprocess.run([hadolint(), "--format", "json", str(GPU_DOCKERFILE)], capture_output=True, text=True)
    assert result.returncode == 0 and json.loads(result.stdout or "[]") == [], result.stdout


def test_the_gpu_worker_is_the_worker_on_cuda_torch_and_the_servers_tensorrt() -> None:
    text, cpu = GPU_DOCKERFILE.read_text(), WORKER_DOCKERFILE.read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and not users[-1].startswith(("0", "root"))
    # The same platform: Python, requirements file, code and install steps as the CPU image.
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim\S*$", text, flags=re.M)
    assert copy_sources(GPU_DOCKERFILE) == copy_sources(WORKER_DOCKERFILE)
    assert "COPY docker/worker-requirements.txt ./requirements.txt" in text
    assert re.search(r"^WORKDIR /opt/sluicegate$", text, flags=re.M)
    # CUDA torch at the Makefile's (and the CPU image's) version, from a CUDA 12 index.
    torch = re.search(r"^ARG TORCH_VERSION=(\S+)$", cpu, flags=re.M)
    assert torch and f"ARG TORCH_VERSION={torch.group(1)}\n" in text
    index = re.search(r"^ARG TORCH_INDEX=https://download\.pytorch\.org/whl/cu(\d+)$", text, flags=re.M)
    assert index and index.group(1).startswith("12"), "torch built for CUDA 12, the serving image's"
    # TensorRT pinned to the serving image's, for CUDA 12.
    release = re.search(
        r"^ARG TRT_IMAGE=nvcr\.io/nvidia/tensorrt:(\d+\.\d+)-py3$",
        (DOCKER / "serving.Dockerfile").read_text(),
        flags=re.M,
    )
    assert release, "serving.Dockerfile's base is no longer a pinned TensorRT release"
    assert f"ARG TENSORRT_VERSION={TENSORRT_OF_RELEASE[release.group(1)]}\n" in text
    assert '"tensorrt-cu12==${TENSORRT_VERSION}"' in text
    # torch and TensorRT before the requirements, the code last, and pip check over all of it.
    assert text.index('"torch==${TORCH_VERSION}"') < text.index("-r requirements.txt") < text.index("--no-deps .")
    assert text.index('"tensorrt-cu12==${TENSORRT_VERSION}"') < text.index("-r requirements.txt")
    assert "pip check" in text
    pins = pinned()
    assert not {"torch", "tensorrt", "tensorrt-cu12"} & set(pins), "the requirements must not pin another build"


def copy_sources(dockerfile: Path) -> list[str]:
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    sources: list[str] = []
    for line in re.findall(r"^COPY\s+(.+)$", text, flags=re.M):
        parts = [part for part in line.split() if not part.startswith("--")]
        sources += parts[:-1]
    return sources


def ignored(path: str, patterns: list[str]) -> bool:
    """.dockerignore semantics for the patterns these files use: the last matching line wins; a path is
    excluded with its parent; `*` does not cross `/`; `**/` matches at any depth."""

    def matches(candidate: str, pattern: str) -> bool:
        if pattern.startswith("**/"):
            parts = candidate.split("/")
            return any(matches("/".join(parts[i:]), pattern[3:]) for i in range(len(parts)))
        a, b = candidate.split("/"), pattern.split("/")
        return len(a) == len(b) and all(fnmatchcase(x, y) for x, y in zip(a, b, strict=True))

    parts = path.strip("/").split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for raw in patterns:
        negate = raw.startswith("!")
        pattern = raw.lstrip("!").strip("/")
        if any(matches(prefix, pattern) for prefix in prefixes):
            excluded = not negate
    return excluded


@pytest.mark.parametrize("name", ["worker.Dockerfile", "worker-gpu.Dockerfile", "serving.Dockerfile"])
def test_copy_sources_exist_and_pass_the_dockerignore(name: str) -> None:
    dockerfile = DOCKER / name
    patterns = [
        line.strip()
        for line in (DOCKER / f"{name}.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    sources = copy_sources(dockerfile)
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"{name} copies {source}, which does not exist"
        assert not ignored(source, patterns), f"{name} copies {source}, which its .dockerignore leaves out"
        inner = next((ROOT / source).rglob("*.py"), None) if (ROOT / source).is_dir() else None
        if inner is not None:
            assert not ignored(str(inner.relative_to(ROOT)), patterns), f"{inner} is left out of the context"
    # The filter is live: the venv and the tests never reach the daemon.
    for path in (".venv/bin/python", "tests/infra/test_compose.py", ".git/HEAD", "serving/__pycache__/x.pyc"):
        assert ignored(path, patterns), f"{name}'s context would include {path}"


def test_worker_requirements_pin_every_runtime_dependency_within_its_range() -> None:
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    pins = pinned()
    assert "torch" not in pins, "torch comes from the CPU index, before the requirements"
    for line in project["dependencies"]:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        if name == "torch":
            continue
        assert name in pins, f"{name} (pyproject) is not pinned in docker/worker-requirements.txt"
        assert requirement.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} vs {requirement}"
        for extra in requirement.extras:  # e.g. moto[server], psycopg[binary]: the extra's packages too
            from importlib.metadata import requires

            for dependency in requires(requirement.name) or []:
                dep = Requirement(dependency)
                if dep.marker and dep.marker.evaluate({"extra": extra}) and not dep.marker.evaluate({"extra": ""}):
                    assert canonicalize_name(dep.name) in pins, f"{dep.name} ({requirement.name}[{extra}])"
