#!/usr/bin/env bash
# GPU check of the convert gate, for a machine with an NVIDIA GPU (a few minutes):
#   bash scripts/gpu_check.sh
# Prints nvidia-smi, torch's CUDA view, whether TensorRT imports, which onnxruntime providers really run
# a tiny model, then runs the gpu-marked tests of tests/tasks/test_conversion.py. Needs only python3 with
# torch, onnx, onnxruntime, numpy and pytest (not the platform's venv: hence --noconftest).
# Everything printed is also written to "${OUT:-/tmp}/gpu_check.txt". Exit status: pytest's.
set -u -o pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
SUMMARY="${OUT:-/tmp}/gpu_check.txt"
mkdir -p "$(dirname "$SUMMARY")"
exec > >(tee "$SUMMARY") 2>&1

section() { printf '\n===== %s =====\n' "$1"; }

section "nvidia-smi"
nvidia-smi || echo "nvidia-smi: not available"

section "python, torch, TensorRT, onnxruntime"
PYTHONPATH=. "$PYTHON" - <<'EOF'
import importlib.metadata
import importlib.util
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

warnings.simplefilter("ignore")  # the legacy exporter's and ORT's provider warnings: the lines below say it
print("python", sys.version.split()[0])
for dist in ("torch", "onnx", "onnxscript", "onnxruntime", "onnxruntime-gpu", "tensorrt", "numpy", "pytest"):
    try:
        print(f"  {dist} {importlib.metadata.version(dist)}")
    except importlib.metadata.PackageNotFoundError:
        print(f"  {dist} not installed")
print("torch", torch.__version__, "cuda build", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"  cuda:{i} {p.name} cc {p.major}.{p.minor} {p.total_memory / 2**30:.1f} GiB")
print("onnxscript (dynamo exporter)", "present" if importlib.util.find_spec("onnxscript") else "MISSING")
try:
    import tensorrt

    print("tensorrt", tensorrt.__version__)
except Exception as exc:
    print("tensorrt import failed:", type(exc).__name__, exc)

from tasks.conversion import tensorrt_available

print("tensorrt_available():", tensorrt_available())

import onnxruntime as ort

print("onnxruntime", ort.__version__, "available providers", ort.get_available_providers())
model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2)).eval()
x = torch.randn(2, 3, 8, 8)
with torch.no_grad():
    expected = model(x).numpy()
with tempfile.TemporaryDirectory() as tmp:
    path = Path(tmp) / "tiny.onnx"
    torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=18, input_names=["input"],
                      dynamic_axes={"input": {0: "batch"}})
    for wanted in ("TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"):
        try:
            session = ort.InferenceSession(str(path), providers=[wanted, "CPUExecutionProvider"])
            (out,) = session.run(None, {"input": x.numpy()})
            diff = float(np.abs(out - expected).max())
            print(f"  asked {wanted}: runs on {session.get_providers()}, max abs diff {diff:.2e}")
        except Exception as exc:
            print(f"  asked {wanted}: failed {type(exc).__name__}: {str(exc)[:200]}")
EOF

section "pytest -m gpu tests/tasks/test_conversion.py"
PYTHONPATH=. "$PYTHON" -m pytest -m gpu -q -rfEsp -p no:cacheprovider --noconftest tests/tasks/test_conversion.py
status=$?
section "result"
echo "pytest exit status $status (0: passed; 5: nothing selected). Summary written to $SUMMARY"
exit "$status"
