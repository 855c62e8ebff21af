"""`sluicegate train`: training, the train gate and conversion outside any flow, on any dataset that
follows the contract; writes a serving-layout model repository version."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from sluicegate import ids
from sluicegate.app.cli.common import cli_errors, console, load_settings


def train_command(
    location: Annotated[str, typer.Argument(help="Dataset folder or s3://bucket/datasets/<name>/<version>/.")],
    out: Annotated[Path, typer.Option(help="Model repository to write <model>/<version>/ into.")],
) -> None:
    """Train, gate and convert a model from a dataset; write the model repository version."""
    from serving.model_format import ModelConfig, write_version
    from sluicegate.app.cli.data import _source, print_verdict
    from tasks.conversion import build_tensorrt_engine, export_onnx, parity
    from tasks.datasets import manifest_paths
    from tasks.feature_gate import spec_from_settings
    from tasks.image_stats import channel_baseline, collect_stats
    from tasks.train_gate import train_gate
    from tasks.training import load_split, save_checkpoint, train

    settings = load_settings()
    p = settings.preprocessing
    spec = spec_from_settings(p)
    with cli_errors():
        source = _source(settings, location)
        manifest = source.manifest()
        concurrency = settings.data_gate.read_concurrency
        with console.status("decoding and preprocessing images..."):
            x_train, y_train, labels = load_split(source, manifest, "train", spec, None, concurrency=concurrency)
            x_val, y_val, _ = load_split(source, manifest, "val", spec, labels, concurrency=concurrency)
            baseline = channel_baseline(collect_stats(source, manifest_paths(manifest), concurrency=concurrency))
        console.print(f"{len(x_train)} train / {len(x_val)} val images, labels {', '.join(labels)}")
        columns = (
            TextColumn("training"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.description}"),
            TimeElapsedColumn(),
        )
        with Progress(*columns, console=console) as bar:
            task = bar.add_task("", total=settings.training.epochs)

            def on_epoch(record: Any) -> None:
                bar.update(task, advance=1, description=f"val acc {record.val_accuracy:.3f} loss {record.val_loss:.3f}")

            model, result = train((x_train, y_train), (x_val, y_val), labels, settings.training, on_epoch=on_epoch)
        verdict = train_gate(
            result.train_loss_curve,
            result.peak_memory_bytes,
            [],
            settings.train_gate,
            val_curve=[record.val_loss for record in result.history],
        )
        print_verdict(verdict)
        if not verdict.passed:
            raise typer.Exit(1)
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            batch = x_val[: settings.conversion.parity_batch]
            export_onnx(model, batch[:1], work / "model.onnx", opset=settings.conversion.opset)
            converted = parity(model, work / "model.onnx", batch, atol=settings.conversion.parity_atol)
            print_verdict(converted)
            if not converted.passed:
                raise typer.Exit(1)
            files = {"model.onnx": work / "model.onnx"}
            if settings.conversion.tensorrt != "off":
                import torch

                with torch.no_grad():
                    reference = model.cpu()(torch.from_numpy(batch)).numpy()
                engine = build_tensorrt_engine(
                    work / "model.onnx",
                    work / "model.plan",
                    profile=settings.conversion.profile,
                    fp16=settings.conversion.fp16,
                    cache_dir=settings.conversion.engine_cache or settings.home / "engines",
                    parity_batch=batch,
                    reference_logits=reference,
                    fp16_atol=settings.conversion.fp16_atol,
                    atol=settings.conversion.parity_atol,
                )
                console.print(f"TensorRT engine: {'built' if engine.built else 'skipped'} ({engine.reason})")
                if engine.built and engine.path is not None:
                    files["model.plan"] = engine.path
            code = ids.code_version(baked=settings.code_commit)
            major, minor, patch = (int(x) for x in settings.model.semver.split("."))
            data = ids.data_version(manifest)
            version = str(ids.model_version((major, minor, patch), code, data))
            tags = {
                "sluicegate.model_version": version,
                "sluicegate.data_version": data,
                "sluicegate.code_version": code.commit,
                "sluicegate.source": source.uri,
            }
            save_checkpoint(model, work / "checkpoint.safetensors", tags)
            files["checkpoint.safetensors"] = work / "checkpoint.safetensors"
            config = ModelConfig(
                name=settings.model.name,
                version=version,
                platform="tensorrt" if "model.plan" in files else "onnxruntime",
                inputs=[{"name": "input", "datatype": "FP32", "shape": [-1, 3, spec.height, spec.width]}],
                outputs=[{"name": "logits", "datatype": "FP32", "shape": [-1, len(labels)]}],
                labels=list(labels),
                preprocessing=spec.to_dict(),
                batching={
                    "max_batch_size": settings.conversion.profile[2],
                    "max_queue_delay_us": 0,
                    "max_queue_size": 256,
                },
                drift_baseline=baseline,
                lineage=tags,
            )
            written = write_version(out, config, files)
    console.print(f"best val accuracy {result.best_val_accuracy:.3f} (epoch {result.best_epoch}); wrote {written}")
