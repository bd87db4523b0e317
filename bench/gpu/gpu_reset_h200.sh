#!/usr/bin/env bash
# Real-GPU check of kimi_eagle_host/ops/gpu_reset.py (the host half of gpu-reset), for a machine with an NVIDIA GPU.
#
#   1. record nvidia-smi's baseline memory on GPU $GPU;
#   2. start an "ours" holder (own session, pgid recorded in a fake runs dir, like a job)
#      and a "foreign" holder (not recorded), each allocating GiB with torch;
#   3. gpu_reset (default mode): ours must die, foreign must live, memory = baseline + foreign;
#   4. gpu_reset --all: foreign must die, memory back to baseline;
#   5. write $OUT/gpu_reset_h200.json and .txt, with the time from each command to verified free memory.
#
# Safety: it signals only processes it started. Every gpu_reset call carries
# --only-pids <our two holders>, so other GPU users on the machine are never touched even
# with --all, and the cleanup trap kills only its own holders.
#
# Env: PYTHON (a python with torch+CUDA; default python3), OUT (default ./out), GPU (default 0),
#      GIB_OURS (default 8), GIB_FOREIGN (default 4), STUBBORN=1 (ours ignores SIGTERM),
#      GRACE (default 10), TIMEOUT (default 60), NVIDIA_SMI, TOL_MIB (default 256).
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$(dirname "$HERE")")"
PY="${PYTHON:-python3}"
OUT="${OUT:-./out}"
GPU="${GPU:-0}"
GIB_OURS="${GIB_OURS:-8}"
GIB_FOREIGN="${GIB_FOREIGN:-4}"
GRACE="${GRACE:-10}"
TIMEOUT="${TIMEOUT:-60}"
TOL_MIB="${TOL_MIB:-256}"
SMI="${NVIDIA_SMI:-$(command -v nvidia-smi || echo /usr/local/nvidia/bin/nvidia-smi)}"
# Run as a host runs it: a module of the checkout's kimi_eagle_host.
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
RESET=(-m kimi_eagle_host.ops.gpu_reset)

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
WORK="$(mktemp -d)"
RUNS="$WORK/runs"
mkdir -p "$RUNS/bench-ours"
STARTED=()

log() { echo "[bench] $*" >&2; }

cleanup() {
  # Kill only the holders this script started, and only if the pid still runs gpu_holder.py.
  for pid in "${STARTED[@]:-}"; do
    [ -n "$pid" ] || continue
    if kill -0 "$pid" 2>/dev/null && tr '\0' ' ' < "/proc/$pid/cmdline" 2>/dev/null | grep -q gpu_holder.py; then
      kill -KILL "$pid" 2>/dev/null || true
    fi
  done
  rm -rf "$WORK"
}
trap cleanup EXIT

[ -x "$SMI" ] || { log "nvidia-smi not found ($SMI): this bench needs an NVIDIA GPU"; exit 1; }

gpu_used() { "$SMI" --query-gpu=memory.used --format=csv,noheader,nounits -i "$GPU" | tr -d ' '; }
now() { date +%s.%N; }

wait_ready() {  # file pid
  for _ in $(seq 1 600); do
    [ -s "$1" ] && return 0
    kill -0 "$2" 2>/dev/null || { log "holder $2 died before allocating"; return 1; }
    sleep 0.2
  done
  log "holder $2 not ready after 120 s"; return 1
}

# Memory on our GPU must come down to target+TOL_MIB; returns the seconds it took (from $1).
wait_mem_below() {  # t_start target_mib max_s
  local deadline used
  deadline=$(awk -v a="$(now)" -v b="$3" 'BEGIN{print a+b}')
  while :; do
    used=$(gpu_used)
    if [ "$used" -le $(( $2 + TOL_MIB )) ]; then
      awk -v a="$(now)" -v b="$1" 'BEGIN{printf "%.3f", a-b}'; return 0
    fi
    if awk -v a="$(now)" -v d="$deadline" 'BEGIN{exit !(a>d)}'; then echo "null"; return 1; fi
    sleep 0.1
  done
}

alive() { kill -0 "$1" 2>/dev/null && [ "$(awk '{print $3}' "/proc/$1/stat" 2>/dev/null)" != Z ]; }

"$SMI" > "$OUT/nvidia-smi-before.txt" 2>&1 || true
BASE=$(gpu_used)
log "baseline: GPU $GPU uses $BASE MiB"

STUB=()
[ "${STUBBORN:-0}" = 1 ] && STUB=(--ignore-term)
"$PY" "$HERE/gpu_holder.py" --gib "$GIB_OURS" --device "$GPU" --new-session "${STUB[@]}" \
  --ready-file "$WORK/ours.ready" & OURS=$!
STARTED+=("$OURS")
"$PY" "$HERE/gpu_holder.py" --gib "$GIB_FOREIGN" --device "$GPU" \
  --ready-file "$WORK/foreign.ready" & FOREIGN=$!
STARTED+=("$FOREIGN")
wait_ready "$WORK/ours.ready" "$OURS"
wait_ready "$WORK/foreign.ready" "$FOREIGN"

# Record the job the way the controller does: <runs>/<job>/{pgid,pid,meta.json}, the group leader's start time in
# meta.json (what tells the job's group from a later one given the same number).
OURS_PGID=$(awk '{print $2}' "$WORK/ours.ready")
echo "$OURS_PGID" > "$RUNS/bench-ours/pgid"
echo "$OURS" > "$RUNS/bench-ours/pid"
TICKS=$("$PY" -c 'import sys; from kimi_eagle_host.ops.jobs import start_ticks; print(start_ticks(int(sys.argv[1])))' "$OURS_PGID")
printf '{"job_id": "bench-ours", "step": "extract", "start_ticks": %s}\n' "$TICKS" > "$RUNS/bench-ours/meta.json"
sleep 1
LOADED=$(gpu_used)
"$SMI" --query-compute-apps=pid,used_memory,gpu_uuid --format=csv,noheader,nounits > "$OUT/apps-loaded.csv" || true
FOREIGN_MIB=$(awk -F', *' -v p="$FOREIGN" '$1==p{s+=$2} END{print s+0}' "$OUT/apps-loaded.csv")
log "loaded: $LOADED MiB (ours pid $OURS pgid $OURS_PGID, foreign pid $FOREIGN holds $FOREIGN_MIB MiB)"

GUARD="$OURS,$FOREIGN"

# ---- phase 1: default mode, only ours ----------------------------------------------
T1=$(now)
set +e
"$PY" "${RESET[@]}" --runs-dir "$RUNS" --only-pids "$GUARD" --nvidia-smi "$SMI" \
  --grace "$GRACE" --timeout "$TIMEOUT" > "$OUT/reset_ours.json" 2> "$OUT/reset_ours.stderr"
RC1=$?
set -e
CMD1_S=$(awk -v a="$(now)" -v b="$T1" 'BEGIN{printf "%.3f", a-b}')
FREE1_S=$(wait_mem_below "$T1" $(( BASE + FOREIGN_MIB )) 30 || true)
AFTER1=$(gpu_used)
OURS_ALIVE1=0; alive "$OURS" && OURS_ALIVE1=1
FOREIGN_ALIVE1=0; alive "$FOREIGN" && FOREIGN_ALIVE1=1
log "phase 1: rc=$RC1 command ${CMD1_S}s, memory verified free after ${FREE1_S}s, now $AFTER1 MiB"

# ---- phase 2: --all (still restricted to our own holders by --only-pids) -----------
T2=$(now)
set +e
"$PY" "${RESET[@]}" --all --runs-dir "$RUNS" --only-pids "$GUARD" --nvidia-smi "$SMI" \
  --grace "$GRACE" --timeout "$TIMEOUT" > "$OUT/reset_all.json" 2> "$OUT/reset_all.stderr"
RC2=$?
set -e
CMD2_S=$(awk -v a="$(now)" -v b="$T2" 'BEGIN{printf "%.3f", a-b}')
FREE2_S=$(wait_mem_below "$T2" "$BASE" 30 || true)
AFTER2=$(gpu_used)
FOREIGN_ALIVE2=0; alive "$FOREIGN" && FOREIGN_ALIVE2=1
log "phase 2: rc=$RC2 command ${CMD2_S}s, memory verified free after ${FREE2_S}s, now $AFTER2 MiB"
"$SMI" > "$OUT/nvidia-smi-after.txt" 2>&1 || true

# ---- report ----------------------------------------------------------------------
export BASE LOADED AFTER1 AFTER2 RC1 RC2 CMD1_S CMD2_S FREE1_S FREE2_S OURS FOREIGN OURS_PGID \
  OURS_ALIVE1 FOREIGN_ALIVE1 FOREIGN_ALIVE2 FOREIGN_MIB TOL_MIB GIB_OURS GIB_FOREIGN GRACE TIMEOUT GPU OUT
"$PY" - <<'EOF'
import json, os
e = os.environ
def num(k):
    v = e[k]
    return None if v in ("", "null") else float(v)
def load(name):
    try:
        with open(os.path.join(e["OUT"], name)) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        return {"error": str(exc)}
r1, r2 = load("reset_ours.json"), load("reset_all.json")
base, tol, fmib = num("BASE"), num("TOL_MIB"), num("FOREIGN_MIB")
checks = {
    "phase1_exit_0": e["RC1"] == "0",
    "phase1_ours_dead": e["OURS_ALIVE1"] == "0",
    "phase1_foreign_alive": e["FOREIGN_ALIVE1"] == "1",
    "phase1_memory_baseline_plus_foreign": num("AFTER1") <= base + fmib + tol,
    "phase2_exit_0": e["RC2"] == "0",
    "phase2_foreign_dead": e["FOREIGN_ALIVE2"] == "0",
    "phase2_memory_back_to_baseline": num("AFTER2") <= base + tol,
}
report = {
    "ok": all(checks.values()), "checks": checks, "gpu": int(e["GPU"]),
    "baseline_mib": base, "loaded_mib": num("LOADED"), "foreign_mib": fmib, "tolerance_mib": tol,
    "holders": {"ours_pid": int(e["OURS"]), "ours_pgid": int(e["OURS_PGID"]),
                "foreign_pid": int(e["FOREIGN"]), "gib_ours": float(e["GIB_OURS"]),
                "gib_foreign": float(e["GIB_FOREIGN"])},
    "grace_s": float(e["GRACE"]), "timeout_s": float(e["TIMEOUT"]),
    "phase1_only_ours": {"rc": int(e["RC1"]), "command_s": num("CMD1_S"),
                         "verified_free_s": num("FREE1_S"), "mem_after_mib": num("AFTER1"),
                         "script_elapsed_s": r1.get("elapsed_s"), "script_ok": r1.get("ok"),
                         "holders": r1.get("holders"), "gpus": r1.get("gpus"), "problems": r1.get("problems")},
    "phase2_all": {"rc": int(e["RC2"]), "command_s": num("CMD2_S"),
                   "verified_free_s": num("FREE2_S"), "mem_after_mib": num("AFTER2"),
                   "script_elapsed_s": r2.get("elapsed_s"), "script_ok": r2.get("ok"),
                   "holders": r2.get("holders"), "gpus": r2.get("gpus"), "problems": r2.get("problems")},
}
with open(os.path.join(e["OUT"], "gpu_reset_h200.json.tmp"), "w") as f:
    json.dump(report, f, indent=2)
os.replace(os.path.join(e["OUT"], "gpu_reset_h200.json.tmp"), os.path.join(e["OUT"], "gpu_reset_h200.json"))
lines = [f"gpu_reset bench on GPU {report['gpu']}: {'PASS' if report['ok'] else 'FAIL'}",
         f"baseline {base:.0f} MiB, loaded {report['loaded_mib']:.0f} MiB (foreign {fmib:.0f} MiB)"]
for key in ("phase1_only_ours", "phase2_all"):
    p = report[key]
    lines.append(f"{key}: rc={p['rc']} command {p['command_s']} s, memory verified free {p['verified_free_s']} s "
                 f"after the command started (script elapsed_s {p['script_elapsed_s']}), after {p['mem_after_mib']:.0f} MiB")
    for h in p["holders"] or []:
        lines.append(f"   pid {h['pid']} {h['owner']:9s} action={h['action']} result={h['result']} "
                     f"signal={h['signal_sent']} mem={h['mem_mib']}")
lines += [f"  [{'x' if v else ' '}] {k}" for k, v in checks.items()]
text = "\n".join(lines) + "\n"
with open(os.path.join(e["OUT"], "gpu_reset_h200.txt"), "w") as f:
    f.write(text)
print(text, end="")
raise SystemExit(0 if report["ok"] else 1)
EOF
