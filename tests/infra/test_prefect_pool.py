"""The GPU work pool's base job template renders (with Prefect's own templating) to a valid Job."""

import json
import re
from pathlib import Path

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
