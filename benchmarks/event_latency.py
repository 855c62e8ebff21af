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

The embedded Prefect server keeps its database in SQLite, where creating a run sometimes fails with
`database is locked` and Prefect's own client retries 2 s later (README, "Measured"). The server logs those
errors here (`PREFECT_API_LOG_RETRYABLE_ERRORS`), and the report counts them: a slow "run created" next
to a count of 0 would be something else. `PREFECT_API_DATABASE_CONNECTION_URL` in the environment puts
the server on that database instead (PostgreSQL: `postgresql+asyncpg://...`).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from flows.pipeline import BODY_STARTED
from sluicegate import storage
from sluicegate.app import stack
from sluicegate.app.demo.prefect_runs import wait_for_flow_run
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.events import s3_event_emitted_at
from sluicegate.settings import Settings
from tasks.datasets import MANIFEST

BODY = "PUT -> flow body"
TARGETS = {BODY: {"p50": 1.0, "p95": 2.0}}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


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


def sqlite_retries(server_log: Path) -> dict[str, int]:
    """Prefect's retryable database errors in its server log: all of them, and those creating a flow run
    (each made its request wait for the client's 2 s back-off)."""
    text = server_log.read_text(errors="replace") if server_log.exists() else ""
    chunks = text.split(RETRYABLE)[1:]  # each error's traceback runs up to the next one
    return {"all": len(chunks), "creating a flow run": sum("INSERT INTO flow_run " in c for c in chunks)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uploads", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench-results/event_latency.json"))
    parser.add_argument("--cold", action="store_true", help="Prefect's own runner: a fresh interpreter per run")
    args = parser.parse_args()
    # Read by the embedded Prefect server (the stack passes the environment on): see sqlite_retries.
    os.environ.setdefault("PREFECT_API_LOG_RETRYABLE_ERRORS", "true")
    console = Console()
    home = Path(tempfile.mkdtemp(prefix="sluicegate-bench-"))
    settings = Settings(
        home=home,
        storage={"port": free_port()},
        prefect={"port": free_port(), "runner_port": free_port(), "ui": False, "runner_warm": not args.cold},
        mlflow={"port": free_port()},
        events={"webhook_port": free_port()},
        stack={"serving": False},  # the event path only
    )
    samples: list[dict[str, float]] = []
    with console.status("starting the embedded stack..."), stack.running(settings):
        one_upload(settings, 0)  # warm-up: first imports and database pages; not counted
        for index in range(1, args.uploads + 1):
            console.log(f"upload {index}/{args.uploads}")
            samples.append(one_upload(settings, index))
        retries = sqlite_retries(settings.home / "logs" / "prefect.log")
    database = (
        "PostgreSQL" if os.environ.get("PREFECT_API_DATABASE_CONNECTION_URL", "").startswith("postgres") else "SQLite"
    )
    runner = "Prefect's runner (cold)" if args.cold else "warm runner"
    table = Table(title=f"event latency over {len(samples)} uploads, {runner} (seconds, embedded stack, this machine)")
    for column in ("hop", "p50", "p95", "max", "target", "verdict"):
        table.add_column(column, justify="right" if column != "hop" else "left")
    summary: dict[str, dict[str, object]] = {}
    for hop in samples[0]:
        values = [sample[hop] for sample in samples]
        observed = {"p50": percentile(values, 50), "p95": percentile(values, 95)}
        target = TARGETS.get(hop)
        verdict = "-"
        if target is not None:
            verdict = "PASS" if all(observed[q] <= bound for q, bound in target.items()) else "MISS"
        summary[hop] = {**observed, "max": max(values), "target": target, "verdict": verdict, "values": values}
        table.add_row(
            hop,
            f"{observed['p50']:.2f}",
            f"{observed['p95']:.2f}",
            f"{max(values):.2f}",
            ", ".join(f"{q} <= {bound:.1f}" for q, bound in target.items()) if target else "-",
            verdict,
        )
    console.print(table)
    console.print(
        f"Prefect's database: {database}; its retryable errors during the run (each a 2 s client back-off): "
        f"{retries['all']}, {retries['creating a flow run']} of them creating a flow run"
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "uploads": len(samples),
        "runner": runner,
        "prefect_database": database,
        "prefect_retryable_errors": retries,
    }
    args.out.write_text(json.dumps({**report, "hops": summary}, indent=2))
    console.print(f"raw samples: {args.out}")


if __name__ == "__main__":
    main()
