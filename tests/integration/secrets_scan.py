"""Where a planted secret could surface after a whole demo: every file the stack wrote under its home
(logs, Prefect's and MLflow's databases, artifacts), Prefect's flow-run logs, states and deployments over
its API, MLflow's run params and tags, every table of the metadata store, the model server's repository
index and metrics, and the console. Returns the places a secret was found, so a failure names them."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import httpx
from sqlalchemy import MetaData, create_engine, select

from sluicegate.settings import Settings

MAX_FILE = 256 * 2**20


def scan(settings: Settings, secrets: Iterable[str], *, console: str, keepers: Iterable[Path] = ()) -> list[str]:
    """``keepers``: files whose job is to hold a secret (the stack's generated admin token, mode 0600)."""
    wanted = [s for s in secrets if s]
    assert wanted and all(len(s) >= 8 for s in wanted), "plant distinctive secrets"
    found: list[str] = []

    def check(where: str, text: str | bytes) -> None:
        for secret in wanted:
            needle: str | bytes = secret.encode() if isinstance(text, bytes) else secret
            if needle in text:  # type: ignore[operator]
                found.append(f"{where}: {secret[:3]}...")

    check("console", console)
    kept = set(keepers)
    for path in sorted(Path(settings.home).rglob("*")):
        if path in kept:
            continue
        if path.is_file() and not path.is_symlink() and path.stat().st_size <= MAX_FILE:
            check(str(path.relative_to(settings.home)), path.read_bytes())
    for where, text in _prefect(settings.prefect.url):
        check(where, text)
    for where, text in _mlflow(settings.mlflow.url):
        check(where, text)
    for where, text in _metadata(settings.metadata_url):
        check(where, text)
    for where, text in _server(settings.rollout.local_http):
        check(where, text)
    return found


def _paged(client: httpx.Client, path: str, body: dict[str, object] | None = None) -> list[dict[str, object]]:
    rows: list[dict[str, object]] = []
    while True:
        response = client.post(path, json={**(body or {}), "limit": 200, "offset": len(rows)})
        response.raise_for_status()
        page = response.json()
        rows += page
        if len(page) < 200:
            return rows


def _prefect(api: str) -> Iterable[tuple[str, str]]:
    with httpx.Client(base_url=api.rstrip("/") + "/", timeout=30) as client:
        yield "prefect logs", str(_paged(client, "logs/filter"))
        yield "prefect flow runs", str(_paged(client, "flow_runs/filter"))
        yield "prefect task runs", str(_paged(client, "task_runs/filter"))
        yield "prefect deployments", str(_paged(client, "deployments/filter"))
        yield "prefect artifacts", str(_paged(client, "artifacts/filter"))
        yield "prefect variables", str(_paged(client, "variables/filter"))


def _mlflow(url: str) -> Iterable[tuple[str, str]]:
    with httpx.Client(base_url=url.rstrip("/") + "/api/2.0/mlflow/", timeout=30) as client:
        experiments = client.post("experiments/search", json={"max_results": 1000}).json().get("experiments", [])
        ids = [e["experiment_id"] for e in experiments]
        runs = client.post("runs/search", json={"experiment_ids": ids, "max_results": 1000}).json()
        yield "mlflow runs", str(runs)
        models = client.get("registered-models/search", params={"max_results": 1000}).json()
        yield "mlflow registered models", str(models)


def _metadata(url: str) -> Iterable[tuple[str, str]]:
    engine = create_engine(url)
    try:
        tables = MetaData()
        tables.reflect(engine)
        with engine.connect() as connection:
            for table in tables.sorted_tables:
                yield f"metadata table {table.name}", str(connection.execute(select(table)).all())
    finally:
        engine.dispose()


def _server(http: str) -> Iterable[tuple[str, str]]:
    with httpx.Client(base_url=http.rstrip("/"), timeout=30) as client:
        yield "server /metrics", client.get("/metrics").text
        index = client.post("/v2/repository/index")
        yield "server repository index", index.text
