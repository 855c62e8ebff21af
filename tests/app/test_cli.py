from pathlib import Path

from typer.testing import CliRunner

from sluicegate.app.cli.main import app


def test_db_commands_on_postgres(fresh_postgres_url: str, tmp_path: Path) -> None:
    runner = CliRunner()
    env = {"SLUICEGATE_METADATA__URL": fresh_postgres_url, "SLUICEGATE_HOME": str(tmp_path)}
    behind = runner.invoke(app, ["db", "current"], env=env)
    assert behind.exit_code == 1 and "at empty" in behind.output
    assert runner.invoke(app, ["db", "upgrade"], env=env).exit_code == 0
    current = runner.invoke(app, ["db", "current"], env=env)
    assert current.exit_code == 0 and "expects 0002" in " ".join(current.output.split())
    assert runner.invoke(app, ["db", "downgrade", "0001"], env=env).exit_code == 0
    older = runner.invoke(app, ["db", "current"], env=env)
    assert older.exit_code == 1 and "at 0001, code expects 0002" in " ".join(older.output.split())
    assert runner.invoke(app, ["db", "downgrade", "base"], env=env).exit_code == 0
    assert runner.invoke(app, ["db", "current"], env=env).exit_code == 1


def test_unreachable_store_is_a_clean_error_naming_the_url(tmp_path: Path) -> None:
    env = {"SLUICEGATE_METADATA__URL": "postgresql+psycopg://u:secret@127.0.0.1:1/x", "SLUICEGATE_HOME": str(tmp_path)}
    result = CliRunner().invoke(app, ["db", "upgrade"], env=env)
    assert result.exit_code == 1
    assert "127.0.0.1:1" in result.output and "secret" not in result.output


def test_invalid_settings_name_the_variable(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["config"], env={"SLUICEGATE_STORAGE__PORT": "nine"})
    assert result.exit_code == 2 and "storage.port" in result.output


def test_rollout_errors_are_one_line_with_exit_code_1(tmp_path: Path) -> None:
    """A configuration error (no admin token) and a PlatformError (no canary) are ours: no traceback."""
    env = {
        "SLUICEGATE_HOME": str(tmp_path),
        "SLUICEGATE_ROLLOUT__LOCAL_HTTP": "http://127.0.0.1:1",
        "SLUICEGATE_ROLLOUT__LOCAL_GRPC": "127.0.0.1:1",
    }
    no_token = CliRunner().invoke(app, ["rollout", "promote", "--model", "pcb"], env=env)
    assert no_token.exit_code == 1 and isinstance(no_token.exception, SystemExit), no_token.exception
    assert no_token.output.startswith("error: SLUICEGATE_ROLLOUT__ADMIN_TOKEN is unset")
    env["SLUICEGATE_ROLLOUT__ADMIN_TOKEN"] = "not-printed"
    no_canary = CliRunner().invoke(app, ["rollout", "promote", "--model", "pcb"], env=env)
    assert no_canary.exit_code == 1 and isinstance(no_canary.exception, SystemExit), no_canary.exception
    assert no_canary.output == "error: model 'pcb' has no canary to promote\n"
