"""`sluicegate demo`: the whole chain on the embedded stack, in three dataset versions.

1. a first dataset version lands in S3; its event runs the pipeline; every gate passes; the model is
   served by the local model server and becomes champion;
2. a second, different dataset (scikit-learn's real handwritten digits, grey) lands: with no
   configuration it trains a model of its own (its name, labels, size and colour from the data), which
   is served beside the first;
3. a corrupt version (skewed labels) of the first is stopped by the data gate; both champions keep serving;
4. an improved (larger) version passes the eval gate against the champion and goes through the canary
   (5% -> 20% -> 50% -> 100%) to champion while a client sends traffic.

The PCB sample's model has a model spec (written to the specs folder unless one exists): its name, and
an augmentation policy that turns and flips, since solder joints keep their class at any orientation.

It ends with a summary table and the UI links, and leaves the stack running until `sluicegate down`.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sluicegate.app import stack
from sluicegate.app.demo.prefect_runs import FlowRun
from sluicegate.app.demo.report import DemoReport, Outcome, Step
from sluicegate.app.demo.traffic import Traffic, load_inputs
from sluicegate.app.demo.watch import Followed, TaskRun, follow
from sluicegate.errors import SluicegateError
from sluicegate.metadata import MetadataStore
from sluicegate.settings import Settings

DEMO_MARKER = "demo-settings"
PCB_MODEL = "pcb-classifier"
PCB_SPEC = """\
# Written by `sluicegate demo`: the PCB sample's model (`sluicegate models check` validates it).
datasets: [pcb]
intended_use: >-
  Classifying solder-joint crops of printed circuit boards from automated optical inspection into the
  dataset's defect classes, as a screening aid whose rejects a person reviews.
training:
  # A joint keeps its class at any orientation on the board: flips and quarter turns are safe here
  # (they are not for digits, where a 6 turned over is a 9).
  augment_flips: true
  augment_quarter_turns: true
serving: {replicas: 2, cpu: "1", memory: 1Gi}
"""


def demo_settings(settings: Settings) -> Settings:
    """The user's settings with what the demo needs: the canary runs after the eval gate, with steps held
    for seconds rather than minutes, and enough traffic per step from the demo client to decide."""
    data = settings.model_dump()
    rollout = dict(data["rollout"])
    rollout.update(after_pipeline=True, hold_seconds=6.0, analysis_interval_seconds=2.0, min_requests=20)
    # A first model is judged on an absolute floor; the sizes below are chosen to clear it.
    return Settings(**{**data, "rollout": rollout, "stack": {**data["stack"], "serving": True}})


def default_steps(first: int = 600, improved: int = 1500) -> list[Step]:
    return [
        Step("v1-first", first, seed=101),
        Step("v1-digits", 0, seed=0, dataset="digits", kind="digits"),
        Step("v2-corrupt", first, seed=202, corrupt=True, expect="FAILED"),
        Step("v3-improved", improved, seed=303),
    ]


def write_pcb_spec(settings: Settings) -> Path | None:
    """The PCB model's spec, unless the specs folder already has one for it (a user's file is theirs)."""
    from sluicegate import model_specs

    folder = model_specs.specs_folder(settings)
    if PCB_MODEL in model_specs.load_specs(folder):
        return None
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{PCB_MODEL}.yaml"
    path.write_text(PCB_SPEC, encoding="utf-8")
    return path


def model_settings(settings: Settings, dataset: str) -> Settings:
    """``settings`` as the model of ``dataset`` sees them."""
    from sluicegate import model_specs

    choice = model_specs.model_for_dataset(settings, dataset)
    return model_specs.settings_for_model(settings, choice.name, choice.spec)


def run(
    settings: Settings,
    console: Console,
    *,
    steps: list[Step] | None = None,
    stop_at_end: bool = False,
    timeout: float = 900,
) -> DemoReport:
    """Run the demo; returns what happened (``ok`` when every version ended as expected)."""
    settings = demo_settings(settings)
    report = DemoReport(prefect_ui=settings.prefect.url.removesuffix("/api"), mlflow_ui=settings.mlflow.url)
    written = write_pcb_spec(settings)
    _start(settings, console)
    if written is not None:
        console.print(f"model spec {written}: dataset pcb trains model {PCB_MODEL} (flips and turns allowed)")
    try:
        with MetadataStore.checked(settings.metadata_url) as store:
            report.ok = True
            for number, step in enumerate(steps or default_steps(), start=1):
                console.rule(f"[bold]{number + 1}. dataset version {step.label}")
                outcome = _one_version(settings, store, console, step, timeout)
                report.outcomes.append(outcome)
                if outcome.flow_run is None or outcome.flow_run.state != step.expect:
                    report.ok = False
                    state = outcome.flow_run.state if outcome.flow_run else "no flow run"
                    console.print(f"[red]expected {step.expect}, got {state}; logs in {settings.home / 'logs'}[/red]")
                    break
            from sluicegate.app.demo.summary import print_summary

            print_summary(console, report, settings, store)
    finally:
        if stop_at_end:
            stack.down(settings)
            console.print("the stack is stopped")
        else:
            console.print("the stack is still running: [bold]sluicegate down[/bold] stops it")
    return report


def _start(settings: Settings, console: Console) -> None:
    console.rule("[bold]1. the embedded stack")
    paths = stack.Paths(settings.home)
    marker = paths.run / DEMO_MARKER
    if stack.supervisor_alive(paths) and not _started_by_demo(paths, marker):
        raise SluicegateError(
            f"a stack started without the demo's settings is running from {settings.home}; "
            "the demo starts its own (canary after the pipeline): run `sluicegate down` first"
        )
    with console.status("starting S3+SQS, Prefect, MLflow, the model server, the event bridge and the runner..."):
        state, started = stack.up(settings)
    marker.write_text(str(state.supervisor_pid))  # this supervisor runs with the demo's settings
    console.print(
        f"stack {'started' if started else 'already running'}: "
        + ", ".join(f"{name} {part.url}" for name, part in state.parts.items())
    )


def _started_by_demo(paths: stack.Paths, marker: Path) -> bool:
    state = stack.read_state(paths)
    try:
        return state is not None and int(marker.read_text()) == state.supervisor_pid
    except (OSError, ValueError):
        return False


def _one_version(settings: Settings, store: MetadataStore, console: Console, step: Step, timeout: float) -> Outcome:
    from tasks import registry

    directory = _render(settings, console, step)
    settings = model_settings(settings, step.dataset)
    console.print(f"dataset {step.dataset} trains model [bold]{settings.model.name}[/bold]")
    traffic = _traffic(settings, directory, console) if not step.corrupt and _champion(settings) else None
    try:
        if traffic is not None:
            traffic.__enter__()
        data7, pushed_at = _push(settings, console, directory, step)
        followed = _follow(settings, store, console, step, pushed_at, timeout)
        finished_at = time.time()
    finally:
        if traffic is not None:
            traffic.__exit__(None, None, None)
    holder = registry.alias_holder(settings.mlflow.url, settings.model.name, registry.CHAMPION)
    outcome = Outcome(step, data7, pushed_at, followed, finished_at, traffic=traffic.report if traffic else None)
    if holder is not None and holder.model_version.endswith(data7):
        outcome.champion_after = holder.model_version
        console.print(f"[green]champion[/green]: {holder.describe()}, serving 100% on {settings.rollout.local_grpc}")
    elif holder is not None:
        console.print(f"champion unchanged: {holder.describe()} keeps serving")
    if traffic is not None:
        sent = traffic.report
        shares = ", ".join(f"{version}: {count}" for version, count in sorted(sent.by_version.items()))
        console.print(f"client: {sent.sent} requests during the run ({shares}); {len(sent.errors)} failed")
    return outcome


def _render(settings: Settings, console: Console, step: Step) -> Path:
    from tasks.real_datasets import write_digits
    from tasks.sample_data import Corruption, make_sample

    directory = settings.home / "demo" / f"{step.label}-{int(time.time())}"
    if step.kind == "digits":
        with console.status("writing scikit-learn's handwritten digits as 64x64 grey PNGs"):
            written = write_digits(directory, size=64, seed=step.seed)
        console.print(f"{sum(written.labels.values())} real scans, labels 0-9, splits {written.splits}")
        return directory
    corruption = Corruption.SKEWED_LABELS if step.corrupt else None
    with Progress(
        TextColumn(f"rendering {step.count} PCB images"), BarColumn(), MofNCompleteColumn(), console=console
    ) as bar:
        task = bar.add_task("render", total=step.count)
        advance = lambda _: bar.advance(task)  # noqa: E731
        make_sample(directory, count=step.count, seed=step.seed, corrupt=corruption, on_image=advance)
    return directory


def _push(settings: Settings, console: Console, directory: Path, step: Step) -> tuple[str, float]:
    from tasks.transfer import push_directory

    files = sum(1 for path in directory.rglob("*") if path.is_file())
    with Progress(TextColumn("uploading to S3"), BarColumn(), MofNCompleteColumn(), console=console) as bar:
        task = bar.add_task("upload", total=files)
        pushed = push_directory(settings, directory, step.dataset, step.label, on_file=lambda _: bar.advance(task))
    pushed_at = time.time()  # the manifest is uploaded last: its PUT is the dataset version's event
    what = " (labels skewed on purpose)" if step.corrupt else ""
    console.print(f"pushed s3://{pushed.bucket}/{pushed.manifest_key}{what}: data version {pushed.data_version[:7]}")
    return pushed.data_version[:7], pushed_at


def _follow(
    settings: Settings, store: MetadataStore, console: Console, step: Step, pushed_at: float, timeout: float
) -> Followed:
    key = f"{settings.storage.datasets_prefix}{step.dataset}/{step.label}/manifest.csv"

    def elapsed() -> str:
        return f"+{time.time() - pushed_at:6.1f} s"

    def on_state(run: FlowRun) -> None:
        message = f": {run.state_message}" if run.final and run.state_message else ""
        console.print(f"  {elapsed()}  flow run [cyan]{run.name}[/cyan] {run.state}{message}")

    def on_task(task: TaskRun) -> None:
        mark = "[green]done[/green]" if task.state == "COMPLETED" else f"[red]{task.state}[/red]"
        console.print(f"  {elapsed()}    {task.name:24} {mark} {task.seconds:6.1f} s")

    def on_step(canary: tuple[int, str, str]) -> None:
        weight, decision, reason = canary
        colour = {"pass": "green", "fail": "red"}.get(decision, "yellow")
        console.print(f"  {elapsed()}    canary {weight:3d}%  [{colour}]{decision}[/{colour}] {reason[:90]}")

    with Progress(TextColumn("waiting for the pipeline"), TimeElapsedColumn(), console=console, transient=True):
        return follow(
            settings.prefect.url, store, key, timeout=timeout, on_task=on_task, on_step=on_step, on_state=on_state
        )


def _champion(settings: Settings) -> Any:
    from tasks import registry

    return registry.alias_holder(settings.mlflow.url, settings.model.name, registry.CHAMPION)


def _traffic(settings: Settings, directory: Path, console: Console) -> Traffic:
    from tasks.champion import find_champion
    from tasks.dataset_gates import champion_spec

    # The client preprocesses as the model it calls was trained (its champion's recorded preprocessing).
    spec = champion_spec(settings, find_champion(settings.mlflow.url, settings.model.name))
    if spec is None:
        raise SluicegateError(f"the champion of {settings.model.name} has no recorded preprocessing")
    inputs = load_inputs(sorted((directory / "images").glob("*.png")), spec)
    console.print(f"a client sends {settings.model.name} requests to {settings.rollout.local_grpc} throughout")
    from tasks.rollout.local import client_tls

    tls = client_tls(settings.rollout)
    credentials = tls.grpc_credentials() if tls is not None else None
    return Traffic(settings.rollout.local_grpc, settings.model.name, inputs, spec, credentials=credentials)
