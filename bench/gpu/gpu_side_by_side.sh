#!/usr/bin/env bash
# Side-by-side measurements on the 2-GPU H200 machine: extraction hf vs vLLM-native (1 B and 8 B
# random Llamas), serving a SmolLM2-135M draft trained there (eval with/without the draft), and our trainer vs
# speculators' own on the same hidden states; then bench/gpu/gpu_scaling.sh if it is in the checkout.
#
# Here, once (network):   bash bench/gpu/fetch_gpu_deps.sh      # -> .gpu/manifest.json + .gpu/p0 .. p4 (~58 MiB each)
# There, one call per piece, on a warm machine (each call carries .gpu/manifest.json and the next piece):
#   WAIT=20 bash bench/gpu/gpu_side_by_side.sh       # absorb carried pieces, start the runner once, wait, report
# and after the last piece, calls with WAIT=590 (or UNTIL="stage ...") until the runner reports finished.
# Results: $OUT/side_by_side.json (every stage's JSON, merged) and $OUT/side_by_side_logs.tar.gz.
# The runner is detached (its own session): it keeps working between calls while the machine stays warm.
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export PYTHON=$PY OUT=${OUT:-./out} KE_WORK=${KE_WORK:-/tmp/ke}
export PATH="$PATH:/usr/local/nvidia/bin"
# NVLink multicast stays off on shared machines (KINDS.md), for every process started from here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
mkdir -p "$OUT"
"$PY" bench/gpu/side_by_side.py absorb --from .gpu
"$PY" bench/gpu/side_by_side.py start
# shellcheck disable=SC2086
"$PY" bench/gpu/side_by_side.py wait --seconds "${WAIT:-0}" --out "$OUT" ${UNTIL:+--until $UNTIL}
