"""GPU check of training (issue 4): CUDA + bf16 autocast on the sample dataset, then ONNX export and
parity of the CUDA-trained model, then the TensorRT engine step (built, or skipped with the reason).

Run on a GPU machine: `PYTHONPATH=. python3 scripts/gpu_train_check.py` (needs torch with CUDA, onnx,
onnxscript, onnxruntime, numpy, pillow, safetensors, psutil, pydantic-settings).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch

from serving.preprocessing import PreprocessSpec
from sluicegate.settings import ConversionSettings, TrainingSettings
from tasks.conversion import build_tensorrt_engine, export_onnx, parity, tensorrt_available
from tasks.dataset_source import LocalSource
from tasks.sample_data import make_sample
from tasks.training import train
from tasks.training_data import load_split

out = Path(os.environ.get("OUT", "/tmp"))
work = Path(tempfile.mkdtemp())
start = time.perf_counter()
make_sample(work / "data", count=2000, seed=0)
print(f"rendered 2000 images in {time.perf_counter() - start:.1f} s")
source = LocalSource(work / "data")
manifest = source.manifest()
spec = PreprocessSpec(height=64, width=64)
train_split = load_split(source, manifest, "train", spec, None)
val_split = load_split(source, manifest, "val", spec, train_split[2])
settings = TrainingSettings(device="cuda", amp=True, epochs=25, patience=6, width=32, learning_rate=3e-3)
print("cuda", torch.cuda.get_device_name(0), "torch", torch.__version__)
start = time.perf_counter()
model, result = train(
    train_split[:2],
    val_split[:2],
    train_split[2],
    settings,
    on_epoch=lambda r: print(
        f"  epoch {r.epoch}: val acc {r.val_accuracy:.3f} loss {r.val_loss:.3f} {r.images_per_second:.0f} img/s"
    ),
)
elapsed = time.perf_counter() - start
peak_mib = result.peak_memory_bytes / 2**20
print(
    f"trained on {result.device} amp={result.amp} in {elapsed:.1f} s: best val accuracy "
    f"{result.best_val_accuracy:.3f} at epoch {result.best_epoch}, peak CUDA memory {peak_mib:.0f} MiB"
)
conv = ConversionSettings()
batch = val_split[0][:32]
start = time.perf_counter()
export_onnx(model, batch[:1], work / "model.onnx", opset=conv.opset)
verdict = parity(model, work / "model.onnx", batch, atol=conv.parity_atol)
print(f"export + parity {time.perf_counter() - start:.1f} s: {verdict.reason()} metrics {verdict.metrics}")
print("tensorrt_available:", tensorrt_available())
with torch.no_grad():
    reference = model.cpu()(torch.from_numpy(batch)).numpy()
engine = build_tensorrt_engine(
    work / "model.onnx",
    work / "model.plan",
    profile=conv.profile,
    fp16=False,
    cache_dir=work / "engines",
    parity_batch=batch,
    reference_logits=reference,
)
print("tensorrt engine:", engine)
(out / "gpu_train_check.txt").write_text(
    f"device={result.device} amp={result.amp} best_val_accuracy={result.best_val_accuracy:.4f} "
    f"epochs={len(result.history)} parity={verdict.passed} max_abs_diff={verdict.metrics.get('max_abs_diff')} "
    f"tensorrt_built={engine.built} reason={engine.reason}\n"
)
assert result.device.startswith("cuda") and result.best_val_accuracy >= 0.9 and verdict.passed
