"""GPU check of training (issue 4): CUDA + bf16 autocast on the sample dataset, then ONNX export and
parity of the CUDA-trained model, then the TensorRT engine step (built, or skipped with the reason),
through the same composition the pipeline and `sluicegate train` run (tasks/build.py).

Run on a GPU machine: `PYTHONPATH=. python3 scripts/gpu_train_check.py` (needs torch with CUDA, onnx,
onnxscript, onnxruntime, numpy, pillow, safetensors, psutil, pydantic-settings). `DEVICE=cpu COUNT=200`
runs the same steps on a CPU as a smoke test (the final assertion then only checks parity).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from sluicegate.settings import Settings
from tasks import build
from tasks.conversion import tensorrt_available
from tasks.dataset_source import LocalSource
from tasks.sample_data import make_sample

out = Path(os.environ.get("OUT", "/tmp"))
device = os.environ.get("DEVICE", "cuda")
count = int(os.environ.get("COUNT", "2000"))
work = Path(tempfile.mkdtemp())
start = time.perf_counter()
make_sample(work / "data", count=count, seed=0)
print(f"rendered {count} images in {time.perf_counter() - start:.1f} s")
source = LocalSource(work / "data")
settings = Settings(
    home=work,
    preprocessing={"height": 64, "width": 64},
    training={"device": device, "amp": True, "epochs": 25, "patience": 6, "width": 32, "learning_rate": 3e-3},
    conversion={"engine_cache": work / "engines"},
)
data = build.load_training_data(settings, source, source.manifest())
if device == "cuda":
    print("cuda", torch.cuda.get_device_name(0), "torch", torch.__version__)
start = time.perf_counter()
trained = build.train_candidate(
    settings,
    data,
    work,
    on_epoch=lambda r: print(
        f"  epoch {r.epoch}: val acc {r.val_accuracy:.3f} loss {r.val_loss:.3f} {r.images_per_second:.0f} img/s"
    ),
)
result = trained.result
elapsed = time.perf_counter() - start
peak_mib = result.peak_memory_bytes / 2**20
print(
    f"trained on {result.device} amp={result.amp} in {elapsed:.1f} s: best val accuracy "
    f"{result.best_val_accuracy:.3f} at epoch {result.best_epoch}, peak memory {peak_mib:.0f} MiB"
)
print("tensorrt_available:", tensorrt_available())
start = time.perf_counter()
converted = build.convert(settings, trained)
verdict = converted.verdict
print(f"export + parity + engine {time.perf_counter() - start:.1f} s: {verdict.reason()} metrics {verdict.metrics}")
print("tensorrt engine:", converted.engine_path or "none", f"({converted.engine_reason})")
(out / "gpu_train_check.txt").write_text(
    f"device={result.device} amp={result.amp} best_val_accuracy={result.best_val_accuracy:.4f} "
    f"epochs={len(result.history)} parity={verdict.passed} max_abs_diff={verdict.metrics.get('max_abs_diff')} "
    f"tensorrt_built={converted.engine_path is not None} reason={converted.engine_reason}\n"
)
assert verdict.passed
assert device != "cuda" or (result.device.startswith("cuda") and result.best_val_accuracy >= 0.9)
