"""`sluicegate train`: training, the train gate and conversion outside any flow, on any dataset that
follows the contract; writes a serving-layout model repository version. The stages are the pipeline's
own (``tasks.build``); this module shows their progress and prints their verdicts."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sluicegate import ids
from sluicegate.app.cli.common import ModelOption, cli_errors, console, load_settings, settings_for_location
from sluicegate.app.cli.data import open_source, print_verdict
from sluicegate.settings import Settings

if TYPE_CHECKING:
    from tasks.build import Trained, TrainingData
    from tasks.dataset_source import DatasetSource


def train_command(
    location: Annotated[str, typer.Argument(help="Dataset folder or s3://bucket/datasets/<name>/<version>/.")],
    out: Annotated[Path, typer.Option(help="Model repository to write <model>/<version>/ into.")],
    model: ModelOption = None,
) -> None:
    """Train, gate and convert a model from a dataset; write the model repository version.

    The model is the dataset's (its spec's, or named after it) unless --model names another.
    """
    from tasks import build

    settings = settings_for_location(load_settings(), location, model)
    console.print(f"model {settings.model.name}")
    with cli_errors():
        source = open_source(settings, location)
        manifest = source.manifest()
        data, baseline = _load(settings, source, manifest)
        with tempfile.TemporaryDirectory() as tmp:
            trained = _train(settings, data, Path(tmp))
            _require(build.gate_training(settings, trained, []))
            converted = build.convert(settings, trained)
            _require(converted.verdict)
            built = "built" if converted.engine_path is not None else "skipped"
            console.print(f"TensorRT engine: {built} ({converted.engine_reason})")
            code = ids.code_version(baked=settings.code_commit)
            data_version = ids.data_version(manifest)
            version = build.version_name(settings, code, data_version)
            tags = {
                "sluicegate.model_version": version,
                "sluicegate.data_version": data_version,
                "sluicegate.code_version": code.commit,
                "sluicegate.source": source.uri,
            }
            written = build.package(
                settings, out, version=version, trained=trained, converted=converted, baseline=baseline, lineage=tags
            )
    result = trained.result
    console.print(f"best val accuracy {result.best_val_accuracy:.3f} (epoch {result.best_epoch}); wrote {written}")


def _load(settings: Settings, source: DatasetSource, manifest: bytes) -> tuple[TrainingData, dict[str, Any]]:
    from tasks import build
    from tasks.dataset_gates import DataShape, candidate_spec
    from tasks.datasets import manifest_paths
    from tasks.image_stats import channel_baseline, collect_stats, common_size, is_grey

    concurrency = settings.data_gate.read_concurrency
    with console.status("decoding and preprocessing images..."):
        stats = collect_stats(source, manifest_paths(manifest), concurrency=concurrency)
        size = common_size(stats)
        shape = DataShape(size[0], size[1], is_grey(stats)) if size is not None else None
        spec = candidate_spec(settings, champion=None, data=shape)
        data = build.load_training_data(settings, source, manifest, spec)
        baseline = channel_baseline(stats)
    console.print(
        f"{len(data.x_train)} train / {len(data.x_val)} val images, labels {', '.join(data.labels)}; "
        f"input {spec.channels}x{spec.height}x{spec.width} ({spec.colour})"
    )
    return data, baseline


def _train(settings: Settings, data: TrainingData, workdir: Path) -> Trained:
    from tasks import build

    columns = (TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"))
    with Progress(*columns, TimeElapsedColumn(), console=console) as bar:
        task = bar.add_task("", total=build.resolved_training(settings, data).epochs)

        def on_epoch(record: Any) -> None:
            bar.update(task, advance=1, description=f"val acc {record.val_accuracy:.3f} loss {record.val_loss:.3f}")

        return build.train_candidate(settings, data, workdir, on_epoch=on_epoch)


def _require(verdict: Any) -> None:
    """Print a stage's verdict; a failed one ends the command with exit code 1."""
    print_verdict(verdict)
    if not verdict.passed:
        raise typer.Exit(1)
