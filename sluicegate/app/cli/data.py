"""`sluicegate dataset ...` and `sluicegate check ...`: datasets and gates outside any flow."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from sluicegate.app.cli.common import ModelOption, cli_errors, console, load_settings, settings_for_location
from sluicegate.settings import Settings

if TYPE_CHECKING:
    from tasks.dataset_source import DatasetSource
    from tasks.verdicts import GateVerdict

dataset_app = typer.Typer(no_args_is_help=True, help="Dataset versions: make, push, pull, list.")
check_app = typer.Typer(no_args_is_help=True, help="Run a gate on a folder or s3:// prefix, outside any flow.")


def _progress(label: str) -> Progress:
    return Progress(TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=console)


@dataset_app.command("make-sample")
def make_sample(
    directory: Annotated[Path, typer.Argument(help="Empty or new folder to write the dataset into.")],
    count: Annotated[int, typer.Option(help="Number of images.")] = 3000,
    seed: Annotated[int, typer.Option(help="Seed: the same seed gives byte-identical files.")] = 0,
    corrupt: Annotated[str | None, typer.Option(help="Defect to inject, for testing the data gate.")] = None,
) -> None:
    """Render the synthetic PCB solder-joint inspection dataset (good / bridge / insufficient / excess)."""
    from tasks.sample_data import Corruption
    from tasks.sample_data import make_sample as render

    try:
        corruption = Corruption(corrupt) if corrupt else None
    except ValueError as exc:
        allowed = ", ".join(c.value for c in Corruption)
        raise typer.BadParameter(
            f"{corrupt!r} is not a corruption; choose one of: {allowed}", param_hint="--corrupt"
        ) from exc
    with cli_errors(), _progress("rendering") as bar:
        task = bar.add_task("render", total=count)
        summary = render(directory, count=count, seed=seed, corrupt=corruption, on_image=lambda _: bar.advance(task))
    console.print(
        f"wrote {summary.count} images to {directory} — labels {summary.labels}, splits {summary.splits}"
        + (f", corruption {corruption.value}" if corruption else "")
    )


@dataset_app.command("make-digits")
def make_digits(
    directory: Annotated[Path, typer.Argument(help="Empty or new folder to write the dataset into.")],
    size: Annotated[int, typer.Option(help="Side of the written images in pixels (the scans are 8x8).")] = 64,
    classes: Annotated[
        str | None, typer.Option(help="Only these digits, comma-separated (e.g. 3,8); default: all ten.")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the stratified 70/15/15 split.")] = 0,
) -> None:
    """Write scikit-learn's bundled handwritten digits (real scans, grey) as a dataset version."""
    from tasks.real_datasets import write_digits

    try:
        chosen = [int(part) for part in classes.split(",")] if classes else None
    except ValueError as exc:
        raise typer.BadParameter(
            f"{classes!r}: list digits separated by commas, e.g. 3,8", param_hint="--classes"
        ) from exc
    with cli_errors(), console.status("writing images..."):
        written = write_digits(directory, size=size, classes=chosen, seed=seed)
    console.print(
        f"wrote {sum(written.labels.values())} grey {size}x{size} images to {directory} — labels {written.labels}, "
        f"splits {written.splits}; push it with `sluicegate dataset push {directory} --name {written.name}`"
    )


@dataset_app.command("push")
def push(
    directory: Annotated[Path, typer.Argument(help="Folder with images and manifest.csv.")],
    name: Annotated[str, typer.Option(help="Dataset name (the key's second segment).")],
    version: Annotated[str | None, typer.Option(help="Version label; default: the current UTC time.")] = None,
) -> None:
    """Upload a dataset version: every file in parallel, the manifest last; prints the data version."""
    from tasks.transfer import push_directory

    settings = load_settings()
    label = version or time.strftime("%Y-%m-%dT%H%M%SZ", time.gmtime())
    files = sum(1 for path in directory.rglob("*") if path.is_file())
    with cli_errors(), _progress("uploading") as bar:
        task = bar.add_task("upload", total=files)
        pushed = push_directory(settings, directory, name, label, on_file=lambda _: bar.advance(task))
    console.print(f"s3://{pushed.bucket}/{pushed.manifest_key}")
    console.print(f"data version {pushed.data_version}")


@dataset_app.command("pull")
def pull(
    name: Annotated[str, typer.Argument(help="Dataset name.")],
    version: Annotated[str, typer.Argument(help="Version label (see `dataset ls`).")],
    directory: Annotated[Path, typer.Argument(help="Folder to write into.")],
) -> None:
    """Download a dataset version (its manifest and every file it lists)."""
    from tasks.transfer import pull_version

    settings = load_settings()
    with cli_errors(), _progress("downloading") as bar:
        task = bar.add_task("download", total=None)
        pulled = pull_version(settings, name, version, directory, on_file=lambda _: bar.advance(task))
    console.print(f"{pulled.files} files in {directory}; data version {pulled.data_version}")


@dataset_app.command("ls")
def ls(name: Annotated[str | None, typer.Argument(help="Only this dataset.")] = None) -> None:
    """List dataset versions in the bucket."""
    from tasks.transfer import list_versions

    versions = list_versions(load_settings(), name)
    table = Table(title="dataset versions")
    for column in ("dataset", "version", "manifest written", "manifest bytes"):
        table.add_column(column)
    for v in versions:
        table.add_row(v.name, v.label, v.last_modified, str(v.size))
    console.print(table)


def open_source(settings: Settings, location: str) -> DatasetSource:
    """The dataset a command names: a folder or an ``s3://`` prefix (an S3 client only for the latter)."""
    from sluicegate import storage
    from tasks.dataset_source import open_location

    return open_location(location, lambda: storage.s3_client(settings))


def print_verdict(verdict: GateVerdict) -> None:
    table = Table(title=f"{verdict.gate} gate: {'passed' if verdict.passed else 'FAILED'}")
    for column in ("check", "observed", "threshold", "result", "detail"):
        table.add_column(column, overflow="fold")
    for check in verdict.checks:
        observed = f"{check.observed:.4g}" if isinstance(check.observed, float) else str(check.observed)
        table.add_row(
            check.name,
            observed,
            check.threshold,
            "[green]pass[/green]" if check.passed else "[red]FAIL[/red]",
            check.detail,
        )
    console.print(table)
    if not verdict.passed:
        console.print(f"[red]{verdict.reason()}[/red]")


def _champion(settings: Settings, use: bool) -> Any:
    if not use:
        return None
    from tasks.champion import find_champion

    found = find_champion(settings.mlflow.url, settings.model.name)
    if found is None:
        console.print(f"no champion of {settings.model.name} in {settings.mlflow.url}: comparing with no reference")
    return found


@check_app.command("data")
def check_data(
    location: Annotated[str, typer.Argument(help="Dataset folder or s3://bucket/datasets/<name>/<version>/.")],
    champion: Annotated[bool, typer.Option(help="Compare labels with the MLflow champion's training data.")] = False,
    report: Annotated[Path | None, typer.Option(help="Also write the verdict and GX's result as JSON here.")] = None,
    model: ModelOption = None,
) -> None:
    """The data gate (Great Expectations) on a dataset that follows the contract; exit 1 on failure."""
    from tasks.dataset_gates import check_data as data_gate
    from tasks.datasets import manifest_paths

    settings = settings_for_location(load_settings(), location, model)
    with cli_errors():
        source = open_source(settings, location)
        manifest = source.manifest()
        found = _champion(settings, champion)
        with _progress("reading images, then validating") as bar:
            task = bar.add_task("stats", total=len(manifest_paths(manifest)))
            outcome = data_gate(settings, source, manifest, champion=found, on_image=lambda _: bar.advance(task))
    print_verdict(outcome.verdict)
    if report is not None:
        document = {"verdict": outcome.verdict.to_dict(), "gx_validation": outcome.validation}
        report.write_text(json.dumps(document, indent=2, default=str))
    if not outcome.verdict.passed:
        raise typer.Exit(1)


@check_app.command("features")
def check_features(
    location: Annotated[str, typer.Argument(help="Dataset folder or s3://bucket/datasets/<name>/<version>/.")],
    against: Annotated[Path | None, typer.Option(help="Reference preprocessing spec (JSON) to compare with.")] = None,
    champion: Annotated[bool, typer.Option(help="Compare with the MLflow champion's preprocessing.")] = False,
    model: ModelOption = None,
) -> None:
    """The feature gate: the configured preprocessing vs a reference one on sampled images; exit 1 on failure."""
    from serving.preprocessing import PreprocessSpec
    from tasks.dataset_gates import champion_spec
    from tasks.dataset_gates import check_features as feature_gate

    settings = settings_for_location(load_settings(), location, model)
    with cli_errors(ValueError, OSError):
        reference: PreprocessSpec | None
        if against is not None:
            reference = PreprocessSpec.from_dict(json.loads(against.read_text()))
        else:
            reference = champion_spec(settings, _champion(settings, champion))
        source = open_source(settings, location)
        with console.status("reading the sampled images..."):
            # Against a champion the candidate keeps its input unless the settings pin a field, as in
            # the pipeline; against a spec file it is what a first model of this data would get.
            verdict = feature_gate(
                settings, source, source.manifest(), reference=reference, follow_reference=against is None
            )
    print_verdict(verdict)
    if not verdict.passed:
        raise typer.Exit(1)
