"""Real datasets nobody here made, through the pipeline's own stages with default settings, against the
simple baselines on the same split.

Each dataset is written as a dataset version (``tasks.real_datasets``), read back through a dataset
source, given the preprocessing a first model of it gets (``candidate_spec``: size and colour from the
data), trained with the default training settings (``tasks.build``), converted to ONNX and scored
through ONNX Runtime on its test split: what the served model answers. The peers, measured in the same
run on the same split: the majority class and the eval gate's linear baseline (logistic regression on
16x16 thumbnails). The PCB sample (ours) is listed for comparison.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from sluicegate.settings import Settings
from tasks import build
from tasks.baselines import baselines, load_split_thumbnails
from tasks.dataset_gates import DataShape, candidate_spec
from tasks.dataset_source import LocalSource
from tasks.datasets import manifest_paths
from tasks.image_stats import collect_stats, common_size, is_grey
from tasks.real_datasets import write_digits
from tasks.sample_data import make_sample
from tasks.training_data import load_split

DATASETS: dict[str, Callable[[Path], Any]] = {
    "digits (sklearn, 10 classes, 64x64 grey)": lambda d: write_digits(d, size=64),
    "digits 3 vs 8 (sklearn, 24x24 grey)": lambda d: write_digits(d, size=24, classes=(3, 8)),
    "pcb sample (ours, 1,000, 64x64 RGB)": lambda d: make_sample(d, count=1000, seed=0),
}


def measure(folder: Path, work: Path) -> dict[str, Any]:
    import onnxruntime as ort

    settings = Settings(home=work, conversion={"tensorrt": "off"})
    source = LocalSource(folder)
    manifest = source.manifest()
    stats = collect_stats(source, manifest_paths(manifest))
    size = common_size(stats)
    assert size is not None
    spec = candidate_spec(settings, champion=None, data=DataShape(size[0], size[1], is_grey(stats)))
    data = build.load_training_data(settings, source, manifest, spec)
    started = time.perf_counter()
    trained = build.train_candidate(settings, data, work)
    train_s = time.perf_counter() - started
    converted = build.convert(settings, trained)
    x_test, y_test, _ = load_split(source, manifest, "test", spec, data.labels)
    session = ort.InferenceSession(str(converted.onnx_path), providers=["CPUExecutionProvider"])
    logits = session.run(None, {session.get_inputs()[0].name: x_test})[0]
    accuracy = float((np.asarray(logits).argmax(axis=1) == y_test).mean())
    rules = settings.eval_gate
    train_x, train_y = load_split_thumbnails(source, manifest, "train", size=rules.baseline_size)
    test_x, test_y = load_split_thumbnails(source, manifest, "test", size=rules.baseline_size)
    found = baselines(train_x, train_y, test_x, test_y, data.labels, size=rules.baseline_size)
    result = trained.result
    return {
        "input": f"{spec.channels}x{spec.height}x{spec.width}",
        "arch": result.resolved.arch,
        "epochs": len(result.history),
        "train_images": len(data.x_train),
        "test_images": len(y_test),
        "test_accuracy": accuracy,
        "linear_accuracy": found.linear_accuracy,
        "majority_accuracy": found.majority_accuracy,
        "train_seconds": train_s,
        # The training passes' own rate (validation passes excluded), as benchmarks.training_throughput.
        "images_per_second": sum(r.images_per_second for r in result.history) / len(result.history),
        "linear_seconds": found.linear_seconds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("bench-results/real_datasets.json"))
    args = parser.parse_args()
    console = Console(width=max(Console().width, 130))  # the table's nine columns, also when piped
    rows: dict[str, dict[str, Any]] = {}
    for name, write in DATASETS.items():
        work = Path(tempfile.mkdtemp(prefix="sluicegate-bench-real-"))
        write(work / "data")
        with console.status(f"{name}: training with the default settings..."):
            rows[name] = measure(work / "data", work)
    table = Table(title="real datasets, default settings, this CPU (test split; peers on the same split)")
    for column in (
        "dataset",
        "input",
        "arch / epochs",
        "test acc",
        "linear (peer)",
        "ratio",
        "majority",
        "train s",
        "train images/s",
    ):
        table.add_column(column, justify="right" if column != "dataset" else "left")
    for name, row in rows.items():
        table.add_row(
            name,
            row["input"],
            f"{row['arch']} / {row['epochs']}",
            f"{row['test_accuracy']:.3f}",
            f"{row['linear_accuracy']:.3f}",
            f"{row['test_accuracy'] / row['linear_accuracy']:.3f}",
            f"{row['majority_accuracy']:.3f}",
            f"{row['train_seconds']:.0f}",
            f"{row['images_per_second']:.0f}",
        )
    console.print(table)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
