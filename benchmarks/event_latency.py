"""Event latency: S3 PUT of a manifest -> flow-run start, over the real embedded stack.

Starts its own stack (temporary home, free ports), does one warm-up upload, then N uploads one at a
time (each waits for its run to finish, so runs do not compete for the 2 cores), and reports the
percentiles of each hop:

  PUT -> event emitted   the S3 notification, SQS long poll and the bridge (metadata store + POST)
  PUT -> run created     plus Prefect's trigger evaluation
  PUT -> run started     plus the runner's poll and the flow-run subprocess reaching Running

(The uploaded "image" is not a PNG: each run stops at the data gate, which keeps the 20 runs short;
only the hops up to the run's start are measured.)

Target (issue 2): p50 PUT -> run started <= 2 s.
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import tempfile
from datetime import UTC, datetime
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sluicegate import storage
from sluicegate.app import stack
from sluicegate.app.demo.prefect_runs import wait_for_flow_run
from sluicegate.metadata import MetadataStore
from sluicegate.metadata.events import s3_event_emitted_at
from sluicegate.settings import Settings
from tasks.datasets import MANIFEST

TARGET_P50_START = 2.0


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
    run = wait_for_flow_run(settings.prefect.url, key, timeout=120, poll=0.05)
    if run is None or run.start_time is None:
        raise RuntimeError(f"upload {index}: no finished flow run for {key}; see {settings.home / 'logs'}")
    with MetadataStore.checked(settings.metadata_url) as store, store.session() as session:
        emitted = s3_event_emitted_at(session, key)
    assert emitted is not None
    return {
        "PUT -> event emitted": (emitted - put_at).total_seconds(),
        "PUT -> run created": (run.created - put_at).total_seconds(),
        "PUT -> run started": (run.start_time - put_at).total_seconds(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--uploads", type=int, default=20)
    parser.add_argument("--out", type=Path, default=Path("bench-results/event_latency.json"))
    args = parser.parse_args()
    console = Console()
    home = Path(tempfile.mkdtemp(prefix="sluicegate-bench-"))
    settings = Settings(
        home=home,
        storage={"port": free_port()},
        prefect={"port": free_port(), "runner_port": free_port(), "ui": False},
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
    table = Table(title=f"event latency over {len(samples)} uploads (seconds, embedded stack, this machine)")
    for column in ("hop", "p50", "p95", "max", "target", "p50 / target"):
        table.add_column(column, justify="right" if column != "hop" else "left")
    summary = {}
    for hop in samples[0]:
        values = [sample[hop] for sample in samples]
        p50, p95 = percentile(values, 50), percentile(values, 95)
        summary[hop] = {"p50": p50, "p95": p95, "max": max(values), "values": values}
        target = TARGET_P50_START if hop == "PUT -> run started" else None
        table.add_row(
            hop,
            f"{p50:.2f}",
            f"{p95:.2f}",
            f"{max(values):.2f}",
            f"<= {target:.1f}" if target else "-",
            f"{p50 / target:.2f}" if target else "-",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"uploads": len(samples), "hops": summary}, indent=2))
    console.print(f"raw samples: {args.out}")


if __name__ == "__main__":
    main()
