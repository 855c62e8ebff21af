"""Event latency: S3 PUT of a manifest -> the flow body starting, over the real embedded stack.

Starts its own stack (temporary home, free ports), does one warm-up upload, then N uploads one at a
time (each waits for its run to finish, so runs do not compete for the 2 cores), and reports the
percentiles of each hop:

  PUT -> event emitted   the S3 notification, SQS long poll and the bridge (metadata store + POST)
  PUT -> run created     plus Prefect's trigger evaluation
  PUT -> run started     plus the runner's poll and the flow-run process reaching Running
  PUT -> flow body       plus the engine's setup: the pipeline's first log line (`BODY_STARTED`)

(The uploaded "image" is not a PNG: each run stops at the data gate, which keeps the 20 runs short;
only the hops up to the run's start are measured.)

Targets (issue 19): PUT -> flow body p50 <= 1.0 s and p95 <= 2.0 s. `--cold` measures Prefect's own
runner instead (a fresh interpreter per run), for the comparison in the same session.

The measurement runs twice by default, once per database of the Prefect server (`--database`):
  PostgreSQL  a throwaway cluster (initdb/pg_ctl, sluicegate.app.stack.postgres): what our full deployment
              runs (docker/compose.yaml) and what Prefect advises beyond a laptop;
  SQLite      the server's default file, what `sluicegate up` runs so that it needs no database server.
On SQLite, creating a run sometimes fails with `database is locked` and the server's own client retries
2 s later (README, "Measured"). The server logs those errors here (`PREFECT_API_LOG_RETRYABLE_ERRORS`),
and the report counts them per database: a slow "run created" next to a count of 0 would be something else.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from flows.pipeline import BODY_STARTED
from sluicegate import storage
from sluicegate.app import stack
from sluicegate.app.demo.prefect_runs import wait_for_flow_run
from sluicegate.app.stack.postgres import free_port, throwaway_cluster
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.events import s3_event_emitted_at
from sluicegate.settings import Settings
from tasks.datasets import MANIFEST

BODY = "PUT -> flow body"
TARGETS = {BODY: {"p50": 1.0, "p95": 2.0}}


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    return statistics.quantiles(ordered, n=100, method="inclusive")[int(q) - 1]


def one_upload(settings: Settings, index: int) -> dict[str, float]:
    s3 = storage.s3_client(settings)
    prefix = f"{settings.storage.datasets_prefix}bench/run-{index:03d}/"
    s3.put_object(Bucket=settings.storage.bucket, Key=prefix + "images/0.png", Body=b"\x89PNG-bench")
    key = prefix + MANIFEST
    put_at = datetime.now(UTC)
    s3.put_object(Bucket=settings.storage.bucket, Key=key, Body=b"path,label,split\nimages/0.png,good,train\n")
    run = wait_for_flow_run(settings.prefect.url, key, timeout=120, poll=0.5)
    if run is None or run.start_time is None:
        raise RuntimeError(f"upload {index}: no finished flow run for {key}; see {settings.home / 'logs'}")
    with MetadataStore.checked(settings.metadata_url) as store, store.session() as session:
        emitted = s3_event_emitted_at(session, key)
    assert emitted is not None
    body = body_started_at(settings.prefect.url, run.id)
    return {
        "PUT -> event emitted": (emitted - put_at).total_seconds(),
        "PUT -> run created": (run.created - put_at).total_seconds(),
        "PUT -> run started": (run.start_time - put_at).total_seconds(),
        BODY: (body - put_at).total_seconds(),
    }


def body_started_at(api_url: str, flow_run_id: str, timeout: float = 30) -> datetime:
    """The time of the run's ``BODY_STARTED`` log line; the run ships its logs in batches, so wait for it."""
    deadline = time.monotonic() + timeout
    query = {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
    while time.monotonic() < deadline:
        response = httpx.post(f"{api_url.rstrip('/')}/logs/filter", json=query, timeout=10)
        response.raise_for_status()
        for record in response.json():
            if record["message"].startswith(BODY_STARTED):
                return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00"))
        time.sleep(0.2)
    raise RuntimeError(f"flow run {flow_run_id} logged no {BODY_STARTED!r} line within {timeout:.0f} s")


RETRYABLE = "Encountered retryable exception in request"


def retryable_errors(server_log: Path, after: int = 0) -> dict[str, int]:
    """Prefect's retryable database errors in its server log past byte ``after``: all of them, and those
    creating a flow run (each made its request wait for the client's 2 s back-off)."""
    data = server_log.read_bytes()[after:] if server_log.exists() else b""
    chunks = data.decode(errors="replace").split(RETRYABLE)[1:]  # each error's traceback runs up to the next
    return {"all": len(chunks), "creating a flow run": sum("INSERT INTO flow_run " in c for c in chunks)}


def log_size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


DATABASES = ("postgresql", "sqlite")
DATABASE_NAMES = {"postgresql": "PostgreSQL", "sqlite": "SQLite"}
DATABASE_URL = "PREFECT_API_DATABASE_CONNECTION_URL"


@contextmanager
def prefect_database(database: str) -> Iterator[None]:
    """The Prefect server's database for one measurement, through Prefect's own variable (the stack hands
    its environment on): a database in a throwaway PostgreSQL cluster, or the server's default SQLite file
    under the stack's home."""
    inherited = os.environ.pop(DATABASE_URL, None)
    try:
        if database == "sqlite":
            yield
            return
        with throwaway_cluster() as cluster:
            cluster.create_database("prefect")
            os.environ[DATABASE_URL] = cluster.url("prefect", driver="asyncpg")
            try:
                yield
            finally:
                del os.environ[DATABASE_URL]
    finally:
        if inherited is not None:
            os.environ[DATABASE_URL] = inherited


def measure(uploads: int, *, cold: bool, console: Console) -> tuple[list[dict[str, float]], dict[str, int]]:
    """One warm-up and ``uploads`` counted uploads through a fresh embedded stack; the samples and the
    server's retryable database errors."""
    home = Path(tempfile.mkdtemp(prefix="sluicegate-bench-"))
    settings = Settings(
        home=home,
        storage={"port": free_port()},
        prefect={"port": free_port(), "runner_port": free_port(), "ui": False, "runner_warm": not cold},
        mlflow={"port": free_port()},
        events={"webhook_port": free_port()},
        stack={"serving": False},  # the event path only
    )
    samples: list[dict[str, float]] = []
    with console.status("starting the embedded stack..."), stack.running(settings):
        one_upload(settings, 0)  # warm-up: first imports and database pages; not counted
        server_log = settings.home / "logs" / "prefect.log"
        counted_from = log_size(server_log)  # the warm-up's own errors are not counted either
        for index in range(1, uploads + 1):
            console.log(f"upload {index}/{uploads}")
            samples.append(one_upload(settings, index))
        retries = retryable_errors(server_log, after=counted_from)
    return samples, retries


def summarise(samples: list[dict[str, float]]) -> dict[str, dict[str, object]]:
    """Per hop: p50, p95, max, the target and its verdict, the values."""
    summary: dict[str, dict[str, object]] = {}
    for hop in samples[0]:
        values = [sample[hop] for sample in samples]
        observed = {"p50": percentile(values, 50), "p95": percentile(values, 95)}
        target = TARGETS.get(hop)
        verdict = "-"
        if target is not None:
            verdict = "PASS" if all(observed[q] <= bound for q, bound in target.items()) else "MISS"
        summary[hop] = {**observed, "max": max(values), "target": target, "verdict": verdict, "values": values}
    return summary


def hop_table(title: str, summary: dict[str, dict[str, object]]) -> Table:
    table = Table(title=title)
    for column in ("hop", "p50", "p95", "max", "target", "verdict"):
        table.add_column(column, justify="right" if column != "hop" else "left")
    for hop, row in summary.items():
        target = row["target"]
        table.add_row(
            hop,
            f"{row['p50']:.2f}",
            f"{row['p95']:.2f}",
            f"{row['max']:.2f}",
            ", ".join(f"{q} <= {bound:.1f}" for q, bound in target.items()) if isinstance(target, dict) else "-",
            str(row["verdict"]),
        )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uploads", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench-results/event_latency.json"))
    parser.add_argument("--cold", action="store_true", help="Prefect's own runner: a fresh interpreter per run")
    parser.add_argument(
        "--database",
        choices=(*DATABASES, "both"),
        default="both",
        help="the Prefect server's database: a throwaway PostgreSQL cluster, its default SQLite file, or both "
        "in turn (default)",
    )
    args = parser.parse_args()
    # Read by the embedded Prefect server (the stack passes the environment on): see retryable_errors.
    os.environ.setdefault("PREFECT_API_LOG_RETRYABLE_ERRORS", "true")
    console = Console()
    if os.environ.get(DATABASE_URL):
        console.print(f"{DATABASE_URL} is set: ignored here, each run names its own database (--database)")
    runner = "Prefect's runner (cold)" if args.cold else "warm runner"
    runs: dict[str, dict[str, object]] = {}
    for database in DATABASES if args.database == "both" else (args.database,):
        name = DATABASE_NAMES[database]
        with prefect_database(database):
            samples, retries = measure(args.uploads, cold=args.cold, console=console)
        summary = summarise(samples)
        console.print(
            hop_table(
                f"event latency over {len(samples)} uploads, {runner}, Prefect on {name} "
                "(seconds, embedded stack, this machine)",
                summary,
            )
        )
        console.print(
            f"Prefect on {name}: retryable database errors during the counted uploads "
            f"(each a 2 s client back-off): {retries['all']}, "
            f"{retries['creating a flow run']} of them creating a flow run"
        )
        runs[database] = {"prefect_database": name, "prefect_retryable_errors": retries, "hops": summary}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"uploads": args.uploads, "runner": runner, "runs": runs}, indent=2))
    console.print(f"raw samples: {args.out}")


if __name__ == "__main__":
    main()
