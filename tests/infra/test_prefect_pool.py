"""The GPU work pool's base job template renders (with Prefect's own templating) to a valid Job."""

import json
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
from prefect.utilities.templating import apply_values

TEMPLATE = Path(__file__).resolve().parents[2] / "infra" / "prefect" / "gpu-training-pool.json"


def test_every_placeholder_is_a_declared_variable() -> None:
    template = json.loads(TEMPLATE.read_text())
    used = set(re.findall(r"\{\{\s*(\w+)\s*\}\}", json.dumps(template["job_configuration"])))
    declared = set(template["variables"]["properties"])
    assert used <= declared, f"undeclared: {used - declared}"
    assert {"gpu_count", "image", "memory"} <= used


def test_rendered_job_requests_a_gpu_and_is_valid() -> None:
    template = json.loads(TEMPLATE.read_text())
    props = template["variables"]["properties"]
    values = {name: spec["default"] for name, spec in props.items() if "default" in spec}
    values |= {
        "name": "pipeline-abc",
        "command": "prefect flow-run execute",
        "labels": {"app": "sluicegate"},
        "env": {"SLUICEGATE_TRAINING__DEVICE": "cuda"},
        "job_watch_timeout_seconds": 600,
    }
    manifest = apply_values(template["job_configuration"]["job_manifest"], values)
    container = manifest["spec"]["template"]["spec"]["containers"][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    # Prefect's worker turns env dicts into name/value lists and args strings into lists; do the same.
    container["env"] = [{"name": k, "value": v} for k, v in container["env"].items()]
    container["args"] = container["args"].split()
    container["resources"]["requests"]["nvidia.com/gpu"] = str(container["resources"]["requests"]["nvidia.com/gpu"])
    container["resources"]["limits"]["nvidia.com/gpu"] = str(container["resources"]["limits"]["nvidia.com/gpu"])
    manifest["metadata"]["name"] = "pipeline-abc-x1"
    del manifest["metadata"]["generateName"]
    kubernetes_validate.validate(manifest, "1.37.0", strict=True)


# -- what the pool's Jobs run as and on ------------------------------------------------------------------


def _service_accounts_in_manifests() -> set[tuple[str, str]]:
    """(namespace, name) of every ServiceAccount the kustomizations under infra/k8s build."""
    import yaml

    from tests.infra.k8s_manifests import K8S, kustomize

    found = set()
    for kustomization in K8S.rglob("kustomization.yaml"):
        if yaml.safe_load(kustomization.read_text()).get("kind") == "Component":
            continue
        for doc in yaml.safe_load_all(kustomize(kustomization.parent)):
            if doc and doc["kind"] == "ServiceAccount":
                found.add((doc["metadata"].get("namespace", ""), doc["metadata"]["name"]))
    return found


def _job_templates() -> list[dict[str, Any]]:
    return [json.loads(path.read_text()) for path in sorted(TEMPLATE.parent.glob("*.json"))]


def test_every_service_account_a_job_template_names_exists_in_a_manifest() -> None:
    import yaml

    wanted = set()
    for template in _job_templates():
        props = template["variables"]["properties"]
        if "service_account_name" in props:
            wanted.add((props["namespace"]["default"], props["service_account_name"]["default"]))
    default_namespace = json.loads(TEMPLATE.read_text())["variables"]["properties"]["namespace"]["default"]
    for deployment in yaml.safe_load((TEMPLATE.parents[2] / "prefect.yaml").read_text())["deployments"]:
        variables = deployment.get("work_pool", {}).get("job_variables") or {}
        if "service_account_name" in variables:
            wanted.add((variables.get("namespace", default_namespace), variables["service_account_name"]))
    assert wanted, "the GPU pool names its ServiceAccount"
    missing = wanted - _service_accounts_in_manifests()
    assert not missing, f"named by a job template but created by no manifest under infra/k8s: {sorted(missing)}"


def test_the_gpu_pool_runs_the_gpu_worker_image() -> None:
    image = json.loads(TEMPLATE.read_text())["variables"]["properties"]["image"]
    assert image["default"].split("/")[-1].split(":")[0] == "worker-gpu"
    assert "docker/worker-gpu.Dockerfile" in image["description"]
    assert (TEMPLATE.parents[2] / "docker" / "worker-gpu.Dockerfile").exists()
