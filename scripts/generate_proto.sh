#!/usr/bin/env bash
# Regenerates the checked-in gRPC code under serving/proto/ from serving/proto/*.proto.
#
#   scripts/generate_proto.sh [OUT_DIR]     (`make generate`; OUT_DIR defaults to the repository root)
#
# The drift test (tests/serving/test_proto.py) runs this into a temporary OUT_DIR and compares the result
# with the checked-in files byte for byte, so edit the .proto, then run `make generate`.
# PYTHON must have grpcio-tools 1.81.1: its protoc matches the protobuf 6.33 runtime (FACTS.md).
set -euo pipefail

cd "$(dirname "$0")/.."
python="${PYTHON:-.venv/bin/python}"
out="${1:-.}"
mkdir -p "$out"

# `-I .` from the repository root makes the generated imports package-qualified
# (`from serving.proto import grpc_service_pb2`), so they work from any working directory.
"$python" -m grpc_tools.protoc -I . \
  --python_out="$out" --pyi_out="$out" --grpc_python_out="$out" \
  serving/proto/grpc_service.proto serving/proto/admin.proto

# tritonclient (and KServe, MLServer) register the same `inference.*` symbols in protobuf's default
# descriptor pool, and a second registration fails at import ("duplicate symbol
# 'inference.ServerLiveRequest'", kserve/kserve#3099, SeldonIO/MLServer#1730). Our V2 messages go into a
# private pool instead, so the server and Triton's client can share a process (our tests do). The wire
# format does not depend on the pool.
"$python" - "$out/serving/proto/grpc_service_pb2.py" <<'PY'
import sys
from pathlib import Path

path = Path(sys.argv[1])
old = "DESCRIPTOR = _descriptor_pool.Default().AddSerializedFile("
new = (
    "# sluicegate: a private pool, so tritonclient's identical symbols can load too (scripts/generate_proto.sh).\n"
    "DESCRIPTOR = _descriptor_pool.DescriptorPool().AddSerializedFile("
)
text = path.read_text()
if text.count(old) != 1:
    sys.exit(f"{path}: expected one '{old}' line; protoc's output changed, update scripts/generate_proto.sh")
path.write_text(text.replace(old, new))
PY
