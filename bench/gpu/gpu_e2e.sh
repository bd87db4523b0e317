#!/usr/bin/env bash
# End to end on a GPU machine with no network. Before, on a machine with network:
#   bash bench/gpu/fetch_gpu_deps.sh        # .whl/ (controller wheels, speculators) and .debs/ (OpenSSH)
# Then on the GPU machine, from the repo root:
#   PYTHON=/opt/torch/.venv/bin/python3 OUT=./out bash bench/gpu/gpu_e2e.sh
# Nothing is installed from a registry there: gpu_e2e.py (bench/gpu/loopback_host.py) unpacks the wheels into a
# private --target folder and the Debian packages with dpkg -x into a private folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-./out}
mkdir -p "$OUT"
OUT=$OUT "$PY" bench/gpu/gpu_e2e.py
