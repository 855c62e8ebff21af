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
