"""prefect.yaml is the one definition of the deployments; check it with Prefect's own models."""

import pytest
from prefect.events.schemas.events import Resource

from flows.deployments import load_spec, runner_deployments
from flows.events.records import parse_message
from sluicegate.errors import ConfigError
from sluicegate.settings import Settings
from tests.flows.test_event_records import s3_record


def resource_for(key: str) -> Resource:
    import json

    [record] = parse_message(json.dumps({"Records": [s3_record(key)]})).records
    return Resource(record.resource())


def test_both_deployments_are_defined() -> None:
    names = [spec["name"] for spec in load_spec()]
    assert names == ["dataset-pipeline", "scheduled-retrain"]


def test_pipeline_trigger_selects_manifest_keys_only() -> None:
    pipeline, retrain = runner_deployments(Settings())
    [trigger] = pipeline.triggers
    assert trigger.expect == {"s3.object.created"}
    assert trigger.match.matches(resource_for("datasets/pcb/v1/manifest.csv"))
    assert not trigger.match.matches(resource_for("datasets/pcb/v1/images/0001.png"))
    assert not trigger.match.matches(resource_for("datasets/pcb/v1/manifest.csv.tmp"))
    assert trigger.parameters is not None and trigger.parameters["event_id"] == "{{ event.id | string }}"
    assert retrain.schedules and retrain.schedules[0].schedule.cron == "0 3 * * *"


def test_retrain_cron_setting_overrides_the_file() -> None:
    _, retrain = runner_deployments(Settings(retrain={"cron": "*/30 * * * *"}))
    assert retrain.schedules[0].schedule.cron == "*/30 * * * *"


def test_a_bad_entrypoint_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    spec = tmp_path / "prefect.yaml"
    spec.write_text("deployments:\n  - name: x\n    entrypoint: flows/nope.py:missing\n")
    with pytest.raises(ConfigError, match=r"flows/nope\.py:missing"):
        runner_deployments(Settings(), spec)
    spec.write_text("name: x\n")
    with pytest.raises(ConfigError, match="no 'deployments' list"):
        load_spec(spec)
