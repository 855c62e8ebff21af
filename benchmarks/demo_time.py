"""Wall time of the demo and of each pipeline stage on this machine, over the real embedded stack.

Runs `sluicegate demo` (sluicegate/app/demo/run.py) in a throwaway home on free ports, stopping the stack at the
end, and prints the time from each manifest PUT to its run's end, every stage's wall time (from
Prefect's task runs), and the issue's target: the first champion serving within 5 minutes of the first
push.

    .venv/bin/python -m benchmarks.demo_time                         # the demo's sizes (600 / 1500 images)
    .venv/bin/python -m benchmarks.demo_time --first 300 --improved 800
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from sluicegate.app.demo import run as demo
from sluicegate.app.demo.summary import FIRST_CHAMPION_TARGET_S
from sluicegate.app.stack.postgres import free_port
from sluicegate.settings import LOOPBACK, Settings


def bench_settings(home: Path) -> Settings:
    return Settings(
        home=home,
        storage={"port": free_port()},
        prefect={"port": free_port(), "runner_port": free_port(), "ui": False},
        mlflow={"port": free_port()},
        events={"webhook_port": free_port()},
        rollout={"local_grpc": f"{LOOPBACK}:{free_port()}", "local_http": f"http://{LOOPBACK}:{free_port()}"},
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--first", type=int, default=600, help="images in the first dataset version")
    parser.add_argument("--improved", type=int, default=1500, help="images in the improved dataset version")
    parser.add_argument("--out", type=Path, default=Path("bench-results/demo_time.json"))
    args = parser.parse_args()
    console = Console()
    home = Path(tempfile.mkdtemp(prefix="sluicegate-demo-bench-"))
    started = time.time()
    report = demo.run(
        bench_settings(home), console, steps=demo.default_steps(args.first, args.improved), stop_at_end=True
    )
    total = time.time() - started

    table = Table(title="demo wall time on this machine")
    for column in ("measure", "seconds", "target", "ratio to target"):
        table.add_column(column, justify="right" if column != "measure" else "left")
    first = report.seconds_to_champion(0)
    if first is not None:
        table.add_row(
            "first push -> first champion serving",
            f"{first:.0f}",
            f"<= {FIRST_CHAMPION_TARGET_S:.0f}",
            f"{first / FIRST_CHAMPION_TARGET_S:.2f}",
        )
    for outcome in report.outcomes:
        state = outcome.flow_run.state if outcome.flow_run else "no run"
        table.add_row(
            f"{outcome.step.label}: push -> run ended ({state})", f"{outcome.finished_at - outcome.pushed_at:.0f}"
        )
    # The bound on the whole demo (two models, four dataset versions) on 2 cores.
    table.add_row("whole demo (stack start to summary)", f"{total:.0f}", "<= 600", f"{total / 600:.2f}")
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "ok": report.ok,
                "total_seconds": total,
                "first_champion_seconds": first,
                "versions": [
                    {
                        "label": o.step.label,
                        "images": o.step.count,
                        "state": o.flow_run.state if o.flow_run else None,
                        "push_to_end_seconds": o.finished_at - o.pushed_at,
                        "stages": o.stage_seconds(),
                        "canary": o.followed.steps,
                    }
                    for o in report.outcomes
                ],
            },
            indent=2,
        )
    )
    console.print(f"raw figures: {args.out}")
    if not report.ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
