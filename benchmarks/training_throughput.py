"""Training throughput (images/s) on this machine's CPU, and the ONNX export + parity time.

Default pipeline settings (32x32 input, resnet-small width 16) on the rendered sample dataset; the
peer is the same model at the sample's native 64x64 (what a GPU pool would use).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from serving.preprocessing import PreprocessSpec
from sluicegate.settings import ConversionSettings, Settings
from tasks.conversion import export_onnx, parity
from tasks.dataset_source import LocalSource
from tasks.sample_data import make_sample
from tasks.training import train
from tasks.training_data import load_split


def run(size: int, work: Path, epochs: int) -> dict[str, float]:
    source = LocalSource(work / "data")
    manifest = source.manifest()
    spec = PreprocessSpec(height=size, width=size)
    x_train, y_train, labels = load_split(source, manifest, "train", spec, None)
    x_val, y_val, _ = load_split(source, manifest, "val", spec, labels)
    settings = Settings().training.model_copy(update={"epochs": epochs, "patience": epochs})
    model, result = train((x_train, y_train), (x_val, y_val), labels, settings)
    rate = sum(r.images_per_second for r in result.history) / len(result.history)
    conv = ConversionSettings()
    start = time.perf_counter()
    export_onnx(model, x_val[:1], work / f"model{size}.onnx", opset=conv.opset)
    verdict = parity(model, work / f"model{size}.onnx", x_val[: conv.parity_batch], atol=conv.parity_atol)
    convert_s = time.perf_counter() - start
    return {
        "images_per_second": rate,
        "convert_seconds": convert_s,
        "max_abs_diff": verdict.metrics["max_abs_diff"],
        "parameters": result.parameters,
        "train_images": len(x_train),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--images", type=int, default=1000)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench-results/training_throughput.json"))
    args = parser.parse_args()
    console = Console()
    work = Path(tempfile.mkdtemp(prefix="sluicegate-bench-train-"))
    make_sample(work / "data", count=args.images, seed=0)
    with console.status("training..."):
        default = run(32, work, args.epochs)
        native = run(64, work, args.epochs)
    table = Table(title=f"training on this CPU ({default['train_images']:.0f} train images, {args.epochs} epochs)")
    for column in ("input", "parameters", "train images/s", "ratio vs 64x64", "export + parity s", "max |diff|"):
        table.add_column(column, justify="right")
    for name, row in (("64x64 (peer)", native), ("32x32 (default)", default)):
        table.add_row(
            name,
            f"{row['parameters']:.0f}",
            f"{row['images_per_second']:.0f}",
            f"{row['images_per_second'] / native['images_per_second']:.2f}",
            f"{row['convert_seconds']:.1f}",
            f"{row['max_abs_diff']:.1e}",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"default_32": default, "native_64": native}, indent=2))


if __name__ == "__main__":
    main()
