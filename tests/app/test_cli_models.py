"""`sluicegate models ls|show|promote|rollback` against a real MLflow registry and metadata store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sluicegate import model_specs
from sluicegate.app.cli.main import app
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.model_versions import alias_history
from sluicegate.settings import Settings
from tasks import registry, tracking
from tests.fixtures.models import register

runner = CliRunner()


def run(*args: str):  # type: ignore[no-untyped-def]
    return runner.invoke(app, list(args), env={"COLUMNS": "200"})


def champion(settings: Settings) -> str | None:
    found = registry.alias_holder(settings.mlflow.url, settings.model.name, "champion")
    return None if found is None else found.model_version


def test_promote_show_rollback_with_who_and_why(platform: Settings) -> None:
    first = register(platform, "v1.0.0-aaaaaaa-1111111", seed=1, tags={registry.TAG_EVAL_GATE: "passed"})
    second = register(platform, "v1.0.1-aaaaaaa-2222222", seed=2, tags={registry.TAG_EVAL_GATE: "passed"})
    failed = register(platform, "v1.0.2-aaaaaaa-3333333", seed=3, tags={registry.TAG_EVAL_GATE: "failed"})

    assert run("models", "promote", "1", "--reason", "first release", "--by", "alice").exit_code == 0
    # By model-version prefix, the way an operator copies it from `models ls`.
    promoted = run("models", "promote", "v1.0.1-aaaa", "--reason", "better on night shift", "--by", "bob")
    assert promoted.exit_code == 0, promoted.output
    assert "v1.0.0-aaaaaaa-1111111 -> " in promoted.output and champion(platform) == second.model_version

    refused = run("models", "promote", failed.registry_version, "--reason", "try it")
    assert refused.exit_code == 2 and "failed the eval gate" in refused.output and "--force" in refused.output
    assert champion(platform) == second.model_version

    listed = run("models", "ls", "--model", platform.model.name, "--json")
    rows = {row["model_version"]: row for row in json.loads(listed.output)}
    assert rows[second.model_version]["aliases"] == ["champion"] and rows[failed.model_version]["aliases"] == []
    table = run("models", "ls", "--model", platform.model.name)
    assert "champion" in table.output and "failed" in table.output

    rolled = run("models", "rollback", "--reason", "latency regression", "--by", "carol")
    assert rolled.exit_code == 0, rolled.output
    assert champion(platform) == first.model_version

    store = MetadataStore(platform.metadata_url)
    with store.session() as session:
        moves = [
            (m.alias, m.previous_model_version, m.model_version, m.actor, m.reason)
            for m in alias_history(session, platform.model.name)
        ]
    store.dispose()
    assert moves == [
        ("champion", second.model_version, first.model_version, "carol", "rollback: latency regression"),
        ("champion", first.model_version, second.model_version, "bob", "better on night shift"),
        ("champion", None, first.model_version, "alice", "first release"),
    ]

    shown = run("models", "show", "champion", "--json")
    detail = json.loads(shown.output)
    assert detail["model_version"] == first.model_version and detail["aliases"] == ["champion"]
    assert [m["actor"] for m in detail["alias_history"]] == ["alice", "bob", "carol"]
    pretty = run("models", "show", first.model_version)
    assert "alias history" in pretty.output and "latency regression" in pretty.output

    again = run("models", "promote", "champion", "--reason", "no-op")
    assert again.exit_code == 0 and "nothing changed" in again.output
    forced = run("models", "promote", failed.model_version, "--reason", "hotfix", "--force")
    assert forced.exit_code == 0 and champion(platform) == failed.model_version
    tracking.client(platform.mlflow.url).delete_registered_model(platform.model.name)


def test_unknown_versions_and_empty_history_are_explained(platform: Settings) -> None:
    missing = run("models", "show", "7")
    assert missing.exit_code == 1 and "has no registered versions" in missing.output
    register(platform, "v1.0.0-bbbbbbb-1111111", seed=1)
    unknown = run("models", "promote", "v9", "--reason", "x")
    assert (
        unknown.exit_code == 1 and "matches no version" in unknown.output and "v1.0.0-bbbbbbb-1111111" in unknown.output
    )
    nothing = run("models", "rollback", "--reason", "x")
    assert nothing.exit_code == 1 and "has no 'champion'" in nothing.output
    run("models", "promote", "1", "--reason", "first")
    first_only = run("models", "rollback", "--reason", "x")
    assert first_only.exit_code == 1 and "is the first champion" in first_only.output
    no_reason = run("models", "promote", "1")
    assert no_reason.exit_code == 2 and "--reason" in no_reason.output
    tracking.client(platform.mlflow.url).delete_registered_model(platform.model.name)


def test_models_ls_lists_every_model_with_its_champion_and_commands_take_the_model(
    platform: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    pcb = register(platform, "v1.0.0-ccccccc-1111111", seed=1, alias="champion")
    digits = model_specs.settings_for_model(platform, platform.model.prefix + "digits")
    other = register(digits, "v1.0.0-ccccccc-2222222", seed=2, alias="champion")
    register(digits, "v1.0.1-ccccccc-3333333", seed=3)
    listed = json.loads(run("models", "ls", "--json").output)
    mine = {row["model"]: row for row in listed if row["model"].startswith(platform.model.prefix)}
    assert {name: row["champion"] for name, row in mine.items()} == {
        platform.model.name: pcb.model_version,
        digits.model.name: other.model_version,
    }
    assert mine[digits.model.name]["latest_registry_version"] == "2"
    # --model picks another model than the default one; the default's champion does not move.
    moved = run("models", "promote", "2", "--model", digits.model.name, "--reason", "newer")
    assert moved.exit_code == 0, moved.output
    assert champion(digits) == "v1.0.1-ccccccc-3333333" and champion(platform) == pcb.model_version
    shown = json.loads(run("models", "show", "champion", "--model", digits.model.name, "--json").output)
    assert shown["model_version"] == "v1.0.1-ccccccc-3333333"
    # With several models and none named, a command asks which one, listing them.
    monkeypatch.delenv("SLUICEGATE_MODEL__NAME")
    ambiguous = run("models", "show", "champion")
    assert ambiguous.exit_code == 2 and "--model" in ambiguous.output and digits.model.name in ambiguous.output
    for settings in (platform, digits):
        tracking.client(settings.mlflow.url).delete_registered_model(settings.model.name)


def test_models_check_validates_every_spec_and_names_the_bad_field(platform: Settings) -> None:
    folder = platform.home / "models"
    empty = run("models", "check")
    assert empty.exit_code == 0 and "no model specs" in empty.output
    folder.mkdir()
    (folder / "pcb-classifier.yaml").write_text("datasets: [pcb]\ntraining: {augment_flips: true}\n")
    good = run("models", "check")
    assert good.exit_code == 0 and "pcb-classifier" in good.output and "training.augment_flips" in good.output
    (folder / "digits.yaml").write_text("training: {epochs: -1}\n")
    bad = run("models", "check")
    assert bad.exit_code == 1 and "digits.yaml" in bad.output and "training.epochs" in bad.output
    (folder / "digits.yaml").write_text("canary: {steps: [5, 50]}\n")
    plan = run("models", "check")
    assert plan.exit_code == 1 and "digits" in plan.output and "must be 100" in plan.output


def test_models_manifests_writes_each_models_overlay_from_its_spec(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    folder.mkdir()
    (folder / "pcb-classifier.yaml").write_text("datasets: [pcb]\nserving: {replicas: 3, cpu: 500m, memory: 2Gi}\n")
    env = {"COLUMNS": "200", "SLUICEGATE_HOME": str(tmp_path)}
    written = runner.invoke(app, ["models", "manifests", "--out", str(tmp_path / "k8s")], env=env)
    assert written.exit_code == 0, written.output
    overlay = (tmp_path / "k8s" / "pcb-classifier" / "kustomization.yaml").read_text()
    assert "500m" in overlay and "2Gi" in overlay
    assert "pcb-classifier" in (tmp_path / "k8s" / "pcb-classifier" / "model.yaml").read_text()
    # A model without a spec gets the default resources; a name Kubernetes refuses is refused by name.
    other = runner.invoke(app, ["models", "manifests", "--out", str(tmp_path / "k8s"), "-m", "digits"], env=env)
    assert other.exit_code == 0 and (tmp_path / "k8s" / "digits" / "kustomization.yaml").exists()
    bad = runner.invoke(app, ["models", "manifests", "--out", str(tmp_path / "k8s"), "-m", "Bad_Name"], env=env)
    assert bad.exit_code == 1 and "Bad_Name" in bad.output
