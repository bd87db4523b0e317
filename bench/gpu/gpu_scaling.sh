#!/usr/bin/env bash
# GPU scaling 1 -> 2 GPUs on one host: extraction and training tokens/s, a training resumed on
# another world size, and `stop` of a torchrun job (no process, no GPU memory left). About 4 minutes on the
# 2-GPU H200 machine; needs only the machine's torch/transformers/safetensors/jinja2 (no network, no sshd).
#   PYTHON=/opt/torch/.venv/bin/python3 OUT=./out bash bench/gpu/gpu_scaling.sh
# Result: $OUT/gpu_scaling.json (written after every phase) and $OUT/gpu_scaling.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
export OUT=${OUT:-./out}
mkdir -p "$OUT"
export PATH="$PATH:/usr/local/nvidia/bin"
# NVLink multicast stays off on shared machines (KINDS.md): keep it off for every process we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
exec "$PY" bench/gpu/gpu_scaling.py
