#!/usr/bin/env bash
# `train --trainer speculators` on a CUDA GPU, the smallest run that goes through it: a random Llama (hidden 256,
# 8 layers) -> prepare (the bundled sample chat) -> extract (hf) -> vocab -> train.py --trainer speculators -> its
# checkpoint checked and published as draft/export. What it shows: our train step drives speculators' own trainer
# on our hidden states on a GPU (the CPU box can only see its one-line refusal). Not a figure.
#
# Needs speculators >= 0.8 and what it imports, as wheels in .specwhl/ (carried; about 8 MiB; written by
# bench/gpu/fetch_gpu_deps.sh). There:  bash bench/gpu/spec_step_smoke.sh   # -> $OUT/spec_step.json, $OUT/spec_step.log
# SPEC_SMOKE_STEPS (20): speculators' --max-steps. SPEC_SMOKE_DEVICE=cpu SPEC_SMOKE_INSTALL=0: a CPU rehearsal up to
# the trainer's one-line refusal.
set -uo pipefail
cd "$(dirname "$0")/../.."
# The steps run as modules of this checkout's kimi_eagle_host, as on a host.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
OUT=${OUT:-./out}
W=${SPEC_SMOKE_WORK:-/tmp/spec-smoke}
mkdir -p "$OUT" "$W"
log="$OUT/spec_step.log"
: >"$log"
if [ -d .specwhl ] && [ "${SPEC_SMOKE_INSTALL:-1}" = 1 ]; then   # 0: the wheels are installed already
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$W/site" .specwhl/*.whl >>"$log" 2>&1 || exit 1
  export PYTHONPATH="$W/site${PYTHONPATH:+:$PYTHONPATH}"
fi
P=kimi_eagle_host.pipeline
m="$W/model" o="$W/out" DEV=${SPEC_SMOKE_DEVICE:-cuda}   # cpu: a rehearsal up to the trainer's refusal
step() {  # name, then the command; its last JSON line is its result
  local name=$1; shift
  local t0=$SECONDS
  echo "\$ $*" >>"$log"
  "$@" >"$W/$name.out" 2>>"$log"
  local rc=$?
  cat "$W/$name.out" >>"$log"
  printf '{"step": "%s", "exit": %d, "seconds": %d, "result": %s}\n' "$name" "$rc" $((SECONDS - t0)) \
    "$(grep '^{' "$W/$name.out" | tail -n 1 | grep . || echo null)" >>"$W/steps.jsonl"
  return $rc
}
rm -f "$W/steps.jsonl"
step model "$PY" -m $P.tiny_model --out "$m" --kind llama --hidden 256 --layers 8 --vocab 1024 --dtype bf16 &&
step prepare "$PY" -m $P.prepare --model "$m" --dataset kimi_eagle_host/sample_data/chat.jsonl --output-dir "$o" \
  --seq-len 256 &&
step extract "$PY" -m $P.extract --model "$m" --output-dir "$o" --engine hf --seq-len 256 --device "$DEV" &&
step vocab "$PY" -m $P.vocab --model "$m" --output-dir "$o" --draft-vocab-size 256 &&
step train_speculators "$PY" -m $P.train --trainer speculators --model "$m" --output-dir "$o" --max-steps "${SPEC_SMOKE_STEPS:-20}" \
  --epochs 100 --device "$DEV" --log-every 5
rc=$?
"$PY" - "$W/steps.jsonl" "$OUT/spec_step.json" "$rc" <<'EOF'
import json, sys
steps = [json.loads(line) for line in open(sys.argv[1])]
export = steps[-1]["result"] or {}
doc = {"what": "train.py --trainer speculators on a CUDA GPU (random Llama, hidden 256, bundled sample chat)",
       "ok": int(sys.argv[3]) == 0 and steps[-1]["step"] == "train_speculators", "steps": steps,
       "export_dir": export.get("export_dir")}
json.dump(doc, open(sys.argv[2], "w"), indent=1)
print(json.dumps({k: doc[k] for k in ("ok", "export_dir")}), [(s["step"], s["exit"], s["seconds"]) for s in steps])
EOF
exit $rc
