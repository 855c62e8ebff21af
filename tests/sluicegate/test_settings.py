import pytest
from pydantic import ValidationError

from sluicegate.settings import Settings


def test_defaults_are_the_embedded_stack(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:  # type: ignore[no-untyped-def]
    for name in list(__import__("os").environ):
        if name.startswith("SLUICEGATE_"):
            monkeypatch.delenv(name)
    monkeypatch.chdir(tmp_path)
    settings = Settings()
    assert settings.home == tmp_path / ".sluicegate"
    assert settings.storage.embedded and settings.storage.url == "http://127.0.0.1:9100"
    assert settings.prefect.embedded and settings.prefect.url == "http://127.0.0.1:4200/api"
    assert settings.mlflow.embedded and settings.metadata_url == f"sqlite:///{tmp_path}/.sluicegate/metadata.db"


def test_external_services_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLUICEGATE_METADATA__URL", "postgresql+psycopg://u:p@db/sluicegate")
    monkeypatch.setenv("SLUICEGATE_STORAGE__ENDPOINT_URL", "https://minio.internal:9000")
    monkeypatch.setenv("SLUICEGATE_PREFECT__API_URL", "https://prefect.internal/api")
    monkeypatch.setenv("SLUICEGATE_MLFLOW__TRACKING_URI", "https://mlflow.internal")
    monkeypatch.setenv("SLUICEGATE_EVENTS__SOURCES", '["webhook"]')
    settings = Settings()
    assert not settings.storage.embedded and settings.storage.url == "https://minio.internal:9000"
    assert not settings.prefect.embedded and not settings.mlflow.embedded
    assert settings.metadata_url.startswith("postgresql+psycopg://")
    assert settings.events.sources == ["webhook"]


def test_to_env_round_trips_through_a_child_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    original = Settings(
        storage={"port": 1234, "secret_access_key": "s3cret"},
        events={"sources": ["sqs"]},
        prefect={"ui": False},
        retrain={"cron": "*/5 * * * *"},
    )
    env = original.to_env()
    assert env["SLUICEGATE_STORAGE__SECRET_ACCESS_KEY"] == "s3cret"
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert Settings() == original


@pytest.mark.parametrize(
    ("name", "value", "match"),
    [
        ("SLUICEGATE_STORAGE__PORT", "nine", "storage.port"),
        ("SLUICEGATE_EVENTS__SOURCES", '["kafka"]', "events.sources"),
        ("SLUICEGATE_PREFECT__RUNNER_POLL_SECONDS", "0", "prefect.runner_poll_seconds"),
        ("SLUICEGATE_STORAGE__NOPE", "1", "storage.nope"),
    ],
)
def test_bad_values_name_the_setting(monkeypatch: pytest.MonkeyPatch, name: str, value: str, match: str) -> None:
    monkeypatch.setenv(name, value)
    with pytest.raises(ValidationError, match=match):
        Settings()
