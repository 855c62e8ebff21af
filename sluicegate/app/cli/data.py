"""`sluicegate dataset ...` and `sluicegate check ...`: datasets and gates outside any flow."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
from rich.table import Table

from sluicegate.app.cli.common import cli_errors, console, load_settings
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


def _source(settings: Settings, location: str) -> DatasetSource:
    from tasks.dataset_source import LocalSource, S3Source, parse_s3_uri

    if location.startswith("s3://"):
        from sluicegate import storage

        bucket, prefix = parse_s3_uri(location)
        return S3Source(storage.s3_client(settings), bucket, prefix)
    path = Path(location)
    if not path.is_dir():
        raise typer.BadParameter(
            f"{location} is neither a folder nor an s3://bucket/prefix/ URI", param_hint="LOCATION"
        )
    return LocalSource(path)


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
) -> None:
    """The data gate (Great Expectations) on a dataset that follows the contract; exit 1 on failure."""
    from tasks.champion import champion_labels
    from tasks.data_gate import run_data_gate
    from tasks.datasets import manifest_paths
    from tasks.image_stats import collect_stats

    settings = load_settings()
    with cli_errors():
        source = _source(settings, location)
        manifest = source.manifest()
        paths = manifest_paths(manifest)
        with _progress("reading images") as bar:
            task = bar.add_task("stats", total=len(paths))
            stats = collect_stats(
                source, paths, concurrency=settings.data_gate.read_concurrency, on_image=lambda _: bar.advance(task)
            )
        found = _champion(settings, champion)
        reference = champion_labels(settings.mlflow.url, found) if found else None
        with console.status("validating with Great Expectations..."):
            verdict, validation = run_data_gate(manifest, stats, reference, settings.data_gate)
    print_verdict(verdict)
    if report is not None:
        report.write_text(
            json.dumps({"verdict": verdict.to_dict(), "gx_validation": validation}, indent=2, default=str)
        )
    if not verdict.passed:
        raise typer.Exit(1)


@check_app.command("features")
def check_features(
    location: Annotated[str, typer.Argument(help="Dataset folder or s3://bucket/datasets/<name>/<version>/.")],
    against: Annotated[Path | None, typer.Option(help="Reference preprocessing spec (JSON) to compare with.")] = None,
    champion: Annotated[bool, typer.Option(help="Compare with the MLflow champion's preprocessing.")] = False,
) -> None:
    """The feature gate: the configured preprocessing vs a reference one on sampled images; exit 1 on failure."""
    from serving.preprocessing import PreprocessSpec
    from tasks.champion import champion_preprocessing
    from tasks.datasets import manifest_paths
    from tasks.feature_gate import feature_gate, sample_indices, spec_from_settings
    from tasks.image_stats import load_images

    settings = load_settings()
    p = settings.preprocessing
    candidate = spec_from_settings(p)
    with cli_errors(ValueError, OSError):
        reference = None
        if against is not None:
            reference = PreprocessSpec.from_dict(json.loads(against.read_text()))
        elif (found := _champion(settings, champion)) is not None:
            recorded = champion_preprocessing(settings.mlflow.url, found)
            reference = PreprocessSpec.from_dict(recorded) if recorded else None
        source = _source(settings, location)
        paths = sorted(set(manifest_paths(source.manifest())))
        chosen = [
            paths[i] for i in sample_indices(len(paths), settings.feature_gate.sample_size, settings.feature_gate.seed)
        ]
        with console.status(f"reading {len(chosen)} sampled images..."):
            images = load_images(source, chosen, concurrency=settings.data_gate.read_concurrency)
        verdict = feature_gate(
            images,
            reference,
            candidate,
            percentile=settings.feature_gate.percentile,
            min_cosine=settings.feature_gate.min_cosine,
        )
    print_verdict(verdict)
    if not verdict.passed:
        raise typer.Exit(1)
