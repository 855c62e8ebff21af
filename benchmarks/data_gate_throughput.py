"""Data-gate throughput: images/s over N images read from the S3 endpoint (moto, over HTTP).

Renders the sample dataset, pushes it to a moto server in its own process, then times the data
gate as the pipeline runs it: image statistics streamed from S3 in parallel (bounded in flight),
then the Great Expectations suite. The peer is the same work done one image at a time (concurrency
1), measured on a slice of the images; the ceiling is the endpoint's own GET rate (no decoding).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from sluicegate import storage
from sluicegate.settings import DataGateSettings, Settings
from tasks.data_gate import run_data_gate
from tasks.dataset_source import S3Source, map_objects
from tasks.datasets import manifest_paths
from tasks.image_stats import collect_stats
from tasks.sample_data import make_sample
from tasks.transfer import push_directory
from tasks.verdicts import GateVerdict


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass(frozen=True)
class Measured:
    """One run's timings; ``sequential_*`` and ``raw_get_s`` cover the first ``sequential_images``."""

    images: int
    render_s: float
    stats_s: float
    gx_s: float
    sequential_images: int
    sequential_s: float
    raw_get_s: float
    verdict: GateVerdict


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=10_000)
    parser.add_argument("--sequential-slice", type=int, default=1_000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("bench-results/data_gate_throughput.json"))
    return parser.parse_args()


@contextlib.contextmanager
def moto_server(port: int) -> Iterator[None]:
    """A moto server in its own process on ``port``, stopped on the way out."""
    moto = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/moto-api/data.json", timeout=1)
                break
            except httpx.HTTPError:
                time.sleep(0.1)
        yield
    finally:
        moto.terminate()
        moto.wait(10)


def measure(settings: Settings, work: Path, args: argparse.Namespace, console: Console) -> Measured:
    """Render and push the sample, then time the gate, the raw-GET ceiling and the sequential peer."""
    storage.provision(settings)
    with console.status(f"rendering {args.images} images..."):
        start = time.perf_counter()
        make_sample(work / "data", count=args.images, seed=1)
        render_s = time.perf_counter() - start
    with console.status("pushing to S3..."):
        pushed = push_directory(settings, work / "data", "bench", "v1")
    prefix = pushed.manifest_key.rsplit("/", 1)[0] + "/"
    source = S3Source(storage.s3_client(settings), settings.storage.bucket, prefix)
    manifest = source.manifest()
    paths = manifest_paths(manifest)

    with console.status(f"data gate, concurrency {args.concurrency}..."):
        start = time.perf_counter()
        stats = collect_stats(source, paths, concurrency=args.concurrency)
        stats_s = time.perf_counter() - start
        start = time.perf_counter()
        verdict, _ = run_data_gate(manifest, stats, None, DataGateSettings())
        gx_s = time.perf_counter() - start
    subset = paths[: args.sequential_slice]
    with console.status(f"ceiling: raw GETs only, {args.concurrency} in flight..."):
        start = time.perf_counter()
        for _ in map_objects(source, subset, lambda _path, data: len(data), args.concurrency):
            pass
        raw_get_s = time.perf_counter() - start
    with console.status(f"peer: one image at a time over {len(subset)} images..."):
        start = time.perf_counter()
        collect_stats(source, subset, concurrency=1)
        sequential_s = time.perf_counter() - start
    return Measured(len(paths), render_s, stats_s, gx_s, len(subset), sequential_s, raw_get_s, verdict)


def report(m: Measured, concurrency: int, console: Console) -> float:
    """Print the table and the verdict; returns the whole gate's images/s."""
    parallel_rate = m.images / m.stats_s
    sequential_rate = m.sequential_images / m.sequential_s
    total_rate = m.images / (m.stats_s + m.gx_s)
    table = Table(title=f"data gate over {m.images} images from the S3 endpoint (this machine)")
    for column in ("what", "seconds", "images/s", "ratio vs peer"):
        table.add_column(column, justify="left" if column == "what" else "right")
    table.add_row(
        "peer: stats one image at a time",
        f"{m.sequential_s:.1f} ({m.sequential_images} img)",
        f"{sequential_rate:.0f}",
        "1.00",
    )
    table.add_row(
        f"stats, {concurrency} in flight",
        f"{m.stats_s:.1f}",
        f"{parallel_rate:.0f}",
        f"{parallel_rate / sequential_rate:.2f}",
    )
    table.add_row(
        f"ceiling: endpoint GETs only, {concurrency} in flight",
        f"{m.raw_get_s:.1f} ({m.sequential_images} img)",
        f"{m.sequential_images / m.raw_get_s:.0f}",
        f"{m.sequential_images / m.raw_get_s / sequential_rate:.2f}",
    )
    table.add_row("GX suite (all expectations)", f"{m.gx_s:.1f}", "-", "-")
    table.add_row("whole gate", f"{m.stats_s + m.gx_s:.1f}", f"{total_rate:.0f}", f"{total_rate / sequential_rate:.2f}")
    console.print(table)
    console.print(f"verdict: {m.verdict.reason()}  (rendering took {m.render_s:.0f} s, not counted)")
    return total_rate


def main() -> None:
    args = parse_args()
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="sluicegate-bench-gate-"))
    port = free_port()
    with moto_server(port):
        settings = Settings(home=work, storage={"port": port})
        m = measure(settings, work, args, console)
    total_rate = report(m, args.concurrency, console)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "images": m.images,
                "stats_seconds": m.stats_s,
                "gx_seconds": m.gx_s,
                "sequential_images": m.sequential_images,
                "sequential_seconds": m.sequential_s,
                "raw_get_seconds": m.raw_get_s,
                "images_per_second": total_rate,
                "passed": m.verdict.passed,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
