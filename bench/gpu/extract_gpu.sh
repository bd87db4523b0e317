#!/usr/bin/env bash
# Extraction throughput on a GPU: builds a ~1B-parameter random llama (bf16), a synthetic chat set,
# prepares it, then runs bench/gpu/extract_bench.py (ours vs the naive loop, fraction of bf16 peak).
#   PYTHON=/opt/torch/.venv/bin/python3 OUT=./out bash bench/gpu/extract_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
# The steps run as modules of this checkout's kimi_eagle_host, as on a host.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-./out}
W=${WORK:-/tmp/kimi-eagle-extract}
mkdir -p "$OUT" "$W"
[ -f "$W/model/config.json" ] || "$PY" -m kimi_eagle_host.pipeline.tiny_model --kind llama --hidden 2048 --layers 20 --vocab 32000 \
  --heads 16 --dtype bf16 --out "$W/model" > /dev/null
"$PY" bench/make_chat_dataset.py --rows "${ROWS:-600}" --words 600 --out "$W/chat.jsonl"
"$PY" -m kimi_eagle_host.pipeline.prepare --model "$W/model" --dataset "$W/chat.jsonl" --output-dir "$W" --seq-len 2048 > /dev/null
"$PY" bench/gpu/extract_bench.py --model "$W/model" --prepared "$W/prepared" --out /dev/shm/kimi-eagle-xb \
  --batch-size "${BATCH:-16}" --writers "${WRITERS:-4}" | tee "$OUT/extract_bench.json"
rm -rf /dev/shm/kimi-eagle-xb
