#!/usr/bin/env bash
# A separate virtual environment holding KServe's own Python client (kserve==0.21.0), for checking that
# serving/ answers it unchanged (tests/serving/test_kserve_client.py). It cannot live in the project
# venv: kserve pins psutil<6 (we need >=6) and brings FastAPI, uvicorn and pandas.
#
# Built once (about a minute); a stamp file naming the pinned set marks a complete build, so later
# calls only read the stamp. A lock keeps two callers from building at once. The venv's python path
# is the last line on stdout; pip's output goes to stderr.
#
#   SLUICEGATE_KSERVE_VENV  where the venv lives (default /tmp/sluicegate-kserve-venv)
#   PYTHON                  interpreter that creates it (default python3)
set -euo pipefail

venv="${SLUICEGATE_KSERVE_VENV:-/tmp/sluicegate-kserve-venv}"
python="${PYTHON:-python3}"
# grpcio, protobuf, httpx and numpy, which the clients import, are kserve 0.21's own requirements.
# Change this list and the stamp no longer matches, so the venv is rebuilt.
packages=("kserve==0.21.0")
stamp="$venv/.sluicegate-kserve-stamp"
want="${packages[*]}"

built() { [ -x "$venv/bin/python" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; }

if built; then
  echo "$venv/bin/python"
  exit 0
fi

mkdir -p "$(dirname "$venv")"
exec 9>"$venv.lock"
if command -v flock >/dev/null; then flock 9; fi
if ! built; then
  if [ -e "$venv" ] && [ ! -f "$venv/pyvenv.cfg" ]; then
    echo "$venv exists and is not a virtual environment; set SLUICEGATE_KSERVE_VENV elsewhere" >&2
    exit 1
  fi
  rm -rf "$venv"
  "$python" -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet "${packages[@]}" >&2
  # Fail here, not in the probe, when the clients cannot be imported.
  "$venv/bin/python" -c "from kserve import InferenceGRPCClient, InferenceRESTClient" >&2
  echo "$want" >"$stamp"
fi
echo "$venv/bin/python"
