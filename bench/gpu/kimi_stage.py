"""The seed's model family on a real GPU engine: a Kimi-K2.5-shaped target through the product, over a real sshd on
the GPU machine, driven through the CLI as a user would (as gpu_e2e.py does for a Llama).

Target: tiny_model.py --kind kimi --preset k2.5 --layers 4 (KimiK25ForConditionalGeneration laid out like the Hub
checkpoint: Kimi-K2.5's hidden 7168, vocabulary 163,840, MLA dims and 64 heads, layer 0 dense and 3 MoE layers with
8 routed experts; ~4.3 B parameters, 8.7 GB in bf16), drawn on the GPU. Steps, each recorded with its result:

  hosts trust/check, upload, build the target, deploy-patch (--check then apply; `skipped` where the installed
  speculators needs none), prepare, preflight extract (--engine vllm), extract --engine vllm (native
  extract_hidden_states + our connector through the multimodal wrapper), the same samples with --engine hf (float32)
  and their agreement per layer, vocab (163,840 -> 32,000), train (+ export), eval (vLLM serves the draft as EAGLE-3
  next to the target), train again with hidden_states=online (train runs vLLM's native extraction itself; no
  hidden-state file), and with two GPUs extract --tp-size 2 against --tp-size 1 (agreement, tokens/s of both).

A step that fails records the product's own one-line reason (e.g. what this vLLM cannot do) and the later steps that
need it are recorded as skipped. Writes $OUT/kimi_gpu.json (target architecture, vLLM version, device, every step)
and $OUT/kimi_cli.log. Run by side_by_side.py's `kimi` stage (after its vLLM bundle is installed), or by hand:

    PYTHON=/opt/torch/.venv/bin/python3 KIMI_SITES=/tmp/ke/site-early:/tmp/ke/site-vllm OUT=./out \\
        python3 bench/gpu/kimi_stage.py

Needs, carried in the checkout: .whl/ (controller wheels) and .debs/ (OpenSSH), as bench/gpu/fetch_gpu_deps.sh
writes them. Sizes come from the environment (KIMI_*), so the same flow rehearses on a CPU box with KIMI_PRESET=mla.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback_host import controller_site, host_entry, openssh_on_path, start_sshd  # noqa: E402

# The host's interpreter (torch, the carried vLLM), as an absolute path: jobs start from sshd sessions, whose PATH
# is the system's, not this process's (a bare "python3" there is the system Python, without torch).
PY = shutil.which(os.environ.get("PYTHON", sys.executable)) or os.environ.get("PYTHON", sys.executable)
CTL_PY = os.environ.get("KIMI_CONTROLLER_PYTHON", PY)          # the controller's (its wheels from .whl/)
OUT = Path(os.environ.get("OUT") or ROOT / "out").resolve()
WORK = Path(os.environ.get("KIMI_WORK") or "/tmp/kimi-gpu-stage")
SITES = [s for s in os.environ.get("KIMI_SITES", "").split(os.pathsep) if s]
K = {k: os.environ.get(f"KIMI_{k}", v) for k, v in dict(
    PRESET="k2.5", LAYERS="4", LAYER_IDS="1,2,3,4", ROWS="96", WORDS="400", SAMPLES="64", SEQ="1024",
    DRAFT_VOCAB="32000", TRAIN_STEPS="40", EVAL_PROMPTS="16", EVAL_TOKENS="64", DEVICE="cuda").items()}
# Steps left out of a short campaign (KIMI_SKIP=extract_hf,eval): recorded as skipped, the rest runs as always.
SKIP = {s for s in os.environ.get("KIMI_SKIP", "").split(",") if s}
# vLLM bf16 vs transformers float32, per layer, mean over tokens of |a - b| / |b|. An off-by-one layer is tens of
# percent away (checked below), so this separates right from wrong.
TOL = 0.05
report: dict = {"stage": "kimi", "sizes": K, "steps": {}}
LOG = None


def cli(*args, timeout=1500):
    env = {**os.environ, "KIMI_EAGLE_INVENTORY": str(WORK / "inventory.yaml"), "NO_COLOR": "1", "COLUMNS": "200",
           "PYTHONPATH": os.pathsep.join([str(WORK / "ctl-site"), str(ROOT)])}
    t0 = time.perf_counter()
    try:
        p = subprocess.run([CTL_PY, "-m", "kimi_eagle", *args], capture_output=True, text=True, env=env, timeout=timeout)
        rc, out, err = p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired as e:
        rc, out, err = 124, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or ""), \
            f"timed out after {timeout} s"
    secs = round(time.perf_counter() - t0, 1)
    LOG.write(f"\n$ kimi-eagle {' '.join(args)}   # exit {rc}, {secs}s\n{out}{err}")
    LOG.flush()
    return rc, out, err, secs


def step_result(text: str, name: str) -> dict | None:
    """The step's own JSON result line from a followed job log ({"ok": ..., "step": name, ...}); with --json each
    log line arrives wrapped as {"host": ..., "line": "..."}."""
    for raw in reversed(text.splitlines()):
        line = raw.strip()
        try:
            wrapped = json.loads(line) if line.startswith("{") else None
        except ValueError:
            wrapped = None
        if isinstance(wrapped, dict) and isinstance(wrapped.get("line"), str):
            line = wrapped["line"].strip()
        i = line.find('{"ok"')
        if i < 0:
            continue
        try:
            doc = json.loads(line[i:])
        except ValueError:
            continue
        # train's result counts its steps in "step"; every other step names itself there
        if doc.get("step") == name or (name == "train" and doc.get("finished") is not None):
            return doc
    return None


def reason(out: str, err: str) -> str:
    """The one line that says why a command failed: the step's error, else the last error-looking line."""
    for text in (out, err):
        for line in reversed(text.splitlines()):
            m = re.search(r'"error": "([^"]+)"', line)
            if m:
                return m.group(1)[:400]
    lines = [ln.strip() for ln in (err + out).splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.search(r"(Error|refus|cannot|not supported|failed)", ln):
            return ln[:400]
    return (lines[-1] if lines else "no output")[:400]


def record(name, ok, **fields):
    report["steps"][name] = {"ok": ok, **fields}
    print(f"[kimi] {name}: {json.dumps(report['steps'][name])[:400]}", flush=True)
    # Written after every step: a machine taken back mid-stage (device time spent) still leaves what was measured.
    (OUT / "kimi_gpu.json").write_text(json.dumps(report, indent=1))
    return ok


def run_step(name, *extra, preflight=False, gpu=True, timeout=1500, overrides=()):
    """`kimi-eagle run <step>` followed to the end; its result JSON, or a recorded refusal."""
    flags = [] if preflight else ["--no-preflight"]
    rc, out, err, secs = cli("--json", "run", name, "--host", "h200", *flags, *([] if gpu else ["--no-gpu"]),
                             *overrides, "--", *extra, timeout=timeout)
    res = step_result(out + err, name)
    return rc == 0, res, secs, (None if rc == 0 else reason(out, err))


def host_info() -> dict:
    """The device and the installed vLLM, as the host's interpreter sees them (with the carried sites)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(SITES + [str(ROOT)])}
    code = ("import json, torch; from kimi_eagle_host.vllm_compat import vllm_install; i = vllm_install() or {}; "
            "print(json.dumps({'vllm': i.get('version'), 'vllm_dist': i.get('dist'), 'torch': torch.__version__, "
            "'gpus': torch.cuda.device_count(), "
            "'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu'}))")
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    return json.loads(p.stdout.strip().splitlines()[-1]) if p.returncode == 0 else {"error": p.stderr[-400:]}


def eagle3_serving(model: Path) -> tuple[bool, str | None]:
    """eval's own answer, asked of the host's interpreter: can its vLLM serve an EAGLE-3 draft for this target?"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(SITES + [str(ROOT)])}
    code = ("import json, sys; from kimi_eagle_host.pipeline.eval import target_text_config, vllm_support; "
            "print(json.dumps(vllm_support(target_text_config(sys.argv[1])[0])))")
    p = subprocess.run([PY, "-c", code, str(model)], capture_output=True, text=True, env=env, timeout=600)
    if p.returncode:
        return True, None      # the eval step itself says what is wrong
    ok, why = json.loads(p.stdout.strip().splitlines()[-1])
    return ok, (None if ok else why)


# ------------------------------------------------------------------------------------------------------
# agreement between two extractions of the same samples

def rel_err_per_layer(a_dir: Path, b_dir: Path, shift: int = 0) -> dict:
    import torch
    from safetensors.torch import load_file

    files = sorted(a_dir.glob("hs_*.safetensors"))
    sums, count, samples = None, 0, 0
    for f in files:
        if not (b_dir / f.name).exists():
            continue
        a, b = load_file(str(f)), load_file(str(b_dir / f.name))
        if not torch.equal(a["token_ids"], b["token_ids"]):
            return {"error": f"token ids differ in {f.name}"}
        ha, hb = a["hidden_states"].float(), b["hidden_states"].float()
        if shift:
            ha, hb = ha[:, :-shift], hb[:, shift:]
        rel = ((ha - hb).norm(dim=-1) / hb.norm(dim=-1).clamp_min(1e-6)).sum(0)
        sums = rel if sums is None else sums + rel
        count += ha.shape[0]
        samples += 1
    if not samples:
        return {"error": f"no common samples between {a_dir} and {b_dir}"}
    return {"samples": samples, "tokens": count, "rel_err_per_layer": [round(x, 5) for x in (sums / count).tolist()]}


# ------------------------------------------------------------------------------------------------------

def main():
    controller_site(CTL_PY, WORK / "ctl-site")   # cli() puts WORK/ctl-site on PYTHONPATH
    openssh_on_path(WORK)
    info = host_info()
    report.update(vllm_version=info.get("vllm"), device=info.get("device"), gpus=info.get("gpus"), torch=info.get("torch"))
    sshd, known = start_sshd(WORK)
    out = WORK / "out"
    host_env = {"PYTHONPATH": os.pathsep.join(SITES), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1", "TOKENIZERS_PARALLELISM": "false", "NCCL_NVLS_ENABLE": "0",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                "VLLM_CACHE_ROOT": str(WORK / "vllm-cache"), "HF_HOME": str(WORK / "hf")}
    if K["DEVICE"] == "cpu":
        host_env.update(VLLM_CPU_KVCACHE_SPACE="2", VLLM_CPU_OMP_THREADS_BIND="nobind")
    (WORK / "inventory.yaml").write_text("hosts:\n" + host_entry("h200", sshd, known, python=PY, workdir=WORK / "host",
                                                                env=host_env) + f"""pipeline:
  model: "{{workdir}}/models/kimi"
  dataset: "{{workdir}}/data/chat.jsonl"
  output_dir: "{out}"
  engine: vllm
  layer_ids: [{K['LAYER_IDS']}]
  seq_len: {K['SEQ']}
  batch_size: 8
  tp_size: 1
  draft_vocab_size: {K['DRAFT_VOCAB']}
  epochs: 1
  lr: 0.0003
  eval_prompts: "{ROOT / 'kimi_eagle_host' / 'sample_data' / 'prompts_eval.jsonl'}"
  eval_num_prompts: {K['EVAL_PROMPTS']}
  eval_max_tokens: {K['EVAL_TOKENS']}
""")
    model = WORK / "host" / "models" / "kimi"
    try:
        cli("hosts", "trust", "h200", "--yes")
        rc, o, e, secs = cli("--json", "hosts", "check", "h200")
        record("hosts_check", rc == 0, seconds=secs, **({} if rc else {"gpus": json.loads(o)[0].get("gpus")}))

        data = WORK / "chat.jsonl"
        subprocess.run([PY, str(ROOT / "bench" / "make_chat_dataset.py"), "--rows", K["ROWS"], "--words", K["WORDS"],
                        "--out", str(data)], check=True)
        rc, o, e, secs = cli("--json", "upload", str(data), "--host", "h200", "--to", "data")
        record("upload_dataset", rc == 0, seconds=secs, bytes=data.stat().st_size)

        ok, res, secs, why = run_step("exec", PY, "-m", "kimi_eagle_host.pipeline.tiny_model", "--kind", "kimi",
                                      "--preset", K["PRESET"], "--layers", K["LAYERS"], "--dtype", "bf16",
                                      "--device", K["DEVICE"], "--out", str(model), gpu=False)
        cfg = json.loads((model / "config.json").read_text()) if (model / "config.json").exists() else {}
        text = cfg.get("text_config", {})
        report["target"] = {"architecture": (cfg.get("architectures") or [None])[0], "model_type": cfg.get("model_type"),
                            "preset": K["PRESET"], "layers": text.get("num_hidden_layers"),
                            "hidden_size": text.get("hidden_size"), "vocab_size": text.get("vocab_size"),
                            "heads": text.get("num_attention_heads"), "kv_lora_rank": text.get("kv_lora_rank"),
                            "q_lora_rank": text.get("q_lora_rank"), "routed_experts": text.get("n_routed_experts"),
                            "first_k_dense_replace": text.get("first_k_dense_replace")}
        if not record("build_target", ok and bool(cfg), seconds=secs, error=why):
            return

        runs = []
        for mode in (["--check"], []):
            rc, o, e, secs = cli("--json", "deploy-patch", "--host", "h200", *mode)
            try:
                doc = json.loads(o)[0]
            except (ValueError, IndexError, KeyError):
                doc = {"error": reason(o, e)}
            runs.append({"mode": mode[0] if mode else "apply", "exit": rc, "seconds": secs,
                         "patch_set": doc.get("patch_set"), "not_needed": doc.get("not_needed"),
                         "reason": doc.get("reason") or doc.get("error"),
                         "statuses": sorted({f.get("status") for f in doc.get("files", [])})})
        # With native extraction (vLLM >= 0.18) nothing of speculators runs: the product says "nothing to patch".
        record("deploy_patch", all(r["exit"] == 0 for r in runs),
               skipped=next((r["not_needed"] for r in runs if r["not_needed"]), None), runs=runs)

        ok, res, secs, why = run_step("prepare", "--max-samples", K["SAMPLES"], gpu=False)
        if not record("prepare", ok, seconds=secs, result=res, error=why):
            return

        rc, o, e, secs = cli("--json", "preflight", "extract", "--host", "h200")
        try:
            checks = json.loads(o)[0]["checks"]
        except (ValueError, IndexError, KeyError):
            checks = []
        record("preflight", rc == 0, seconds=secs, checks={c["name"]: [c["status"], c["detail"]] for c in checks},
               error=None if rc == 0 else reason(o, e))

        ok, res, secs, why = run_step("extract")
        vllm_ok = record("extract_vllm_tp1", ok, seconds=secs, result=res, error=why)
        # another output folder (its own job's record, which clean respects) reading the same prepared samples
        hf_dir = WORK / "hs_hf" / "hidden_states"
        hf_ok = False
        if "extract_hf" in SKIP:
            record("extract_hf", False, skipped="KIMI_SKIP")
        else:
            ok, res, secs, why = run_step("extract", "--engine", "hf", "--dtype", "float32", "--prepared-dir",
                                          str(out / "prepared"), overrides=[f"output_dir={hf_dir.parent}"])
            hf_ok = record("extract_hf", ok, seconds=secs, result=res, error=why)
        if vllm_ok and hf_ok:
            agree = rel_err_per_layer(out / "hidden_states", hf_dir)
            off = rel_err_per_layer(out / "hidden_states", hf_dir, shift=1)
            errs = agree.get("rel_err_per_layer") or [1.0]
            record("agreement_vllm_vs_hf", max(errs) < TOL and min(off.get("rel_err_per_layer") or [0]) > 3 * TOL,
                   tolerance=TOL, **agree, off_by_one_rel_err=off.get("rel_err_per_layer"))

        trained = False
        if vllm_ok:
            ok, res, secs, why = run_step("vocab", gpu=False)
            if record("vocab", ok, seconds=secs, result=res, error=why):
                ok, res, secs, why = run_step("train", "--max-steps", K["TRAIN_STEPS"], "--epochs", "100")
                export = out / "draft" / "export" / "config.json"
                exp = json.loads(export.read_text()) if export.exists() else {}
                trained = record("train_export", ok and bool(exp), seconds=secs, error=why,
                                 result={k: v for k, v in (res or {}).items() if k != "history"},
                                 export={k: exp.get(k) for k in ("architectures", "eagle_aux_hidden_state_layer_ids",
                                                                 "draft_vocab_size", "speculators_model_type")})
        serving = eagle3_serving(model) if trained else (True, None)
        if trained and "eval" in SKIP:
            record("eval", False, skipped="KIMI_SKIP")
        elif trained and not serving[0]:    # where vLLM itself cannot (a CPU without AMX): said, not run
            record("eval", False, skipped=serving[1])
        elif trained:
            ok, res, secs, why = run_step("eval", timeout=1800)
            rep = out / "eval" / "report.json"
            doc = json.loads(rep.read_text()) if rep.exists() else {}
            record("eval", ok and doc.get("engine") == "vllm", seconds=secs, error=why or doc.get("fallback_reason"),
                   **{k: doc.get(k) for k in ("engine", "vllm_version", "engine_env", "mean_acceptance_length",
                                              "acceptance_per_position", "drafts", "accepted_tokens", "tokens_per_s",
                                              "speedup", "identical_completions", "headline")})

        if trained:
            # hidden_states: online through the product: train runs the engine (vLLM's native extraction) itself,
            # its hidden states reach the loop through a bounded buffer, none is written; on the same prepared data
            # and vocab, in an output folder of its own, with the offline run's steps
            online = WORK / "online"
            shutil.rmtree(online, ignore_errors=True)
            for sub in ("prepared", "vocab"):
                shutil.copytree(out / sub, online / sub)
            ok, res, secs, why = run_step("train", "--max-steps", K["TRAIN_STEPS"], "--epochs", "100",
                                          overrides=["hidden_states=online", f"output_dir={online}"])
            res = {k: v for k, v in (res or {}).items() if k != "history"}
            left = [str(f) for f in online.rglob("*.safetensors") if not {"draft", "prepared"} & set(f.parts)]
            offline = report["steps"]["train_export"].get("result") or {}
            record("train_online", ok and res.get("hidden_states") == "online" and not left
                   and (online / "draft" / "export" / "config.json").exists(), seconds=secs, error=why, result=res,
                   hidden_state_files_left=left[:5], steps_offline=offline.get("step"),
                   final_loss_offline=offline.get("final_loss"), final_loss_online=res.get("final_loss"))

        if vllm_ok and (info.get("gpus") or 0) >= 2:
            tp2 = WORK / "hs_tp2" / "hidden_states"
            ok, res, secs, why = run_step("extract", "--tp-size", "2", "--prepared-dir", str(out / "prepared"),
                                          overrides=[f"output_dir={tp2.parent}"])
            tp1 = report["steps"]["extract_vllm_tp1"].get("result") or {}
            fields = {}
            if ok:
                agree = rel_err_per_layer(tp2, out / "hidden_states")
                fields = {**agree, "tokens_per_s_tp1": tp1.get("extract_tokens_per_s") or tp1.get("tokens_per_s"),
                          "tokens_per_s_tp2": (res or {}).get("extract_tokens_per_s") or (res or {}).get("tokens_per_s")}
                ok = max(agree.get("rel_err_per_layer") or [1.0]) < TOL / 2
            record("extract_vllm_tp2_vs_tp1", ok, seconds=secs, result=res, error=why, **fields)
        elif vllm_ok:
            record("extract_vllm_tp2_vs_tp1", False, skipped=f"{info.get('gpus')} GPU(s): tensor parallelism 2 needs two")
    finally:
        sshd.stop()
        report["ok"] = bool(report["steps"]) and all(s.get("ok") or s.get("skipped") for s in report["steps"].values())
        (OUT / "kimi_gpu.json").write_text(json.dumps(report, indent=1))
        if not os.environ.get("KIMI_KEEP"):
            shutil.rmtree(model, ignore_errors=True)   # 8.7 GB


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    LOG = open(OUT / "kimi_cli.log", "w")
    try:
        main()
    finally:
        (OUT / "kimi_gpu.json").write_text(json.dumps(report, indent=1))
        LOG.close()
