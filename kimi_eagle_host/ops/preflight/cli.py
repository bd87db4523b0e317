"""The command line: the flags, the checks a step gets, in order, and the JSON report."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from kimi_eagle_host.gpus import find_nvidia_smi
from kimi_eagle_host.ops.preflight.dataset import check_dataset, check_inputs
from kimi_eagle_host.ops.preflight.gpu import check_gpu, check_gpu_present
from kimi_eagle_host.ops.preflight.gpu_lock import check_lock
from kimi_eagle_host.ops.preflight.engine import check_engine_memory
from kimi_eagle_host.ops.preflight.model import check_layer_ids, load_model_config, model_source_checks
from kimi_eagle_host.ops.preflight.packages import check_patch, check_python, check_serving, check_trainer, check_versions
from kimi_eagle_host.ops.preflight.report import GPU_STEPS, check, log, step_value
from kimi_eagle_host.ops.preflight.storage import check_disk, check_storage
from kimi_eagle_host.settings import RenamedFlag
from kimi_eagle_host.step_runtime import host_runs_dir
from kimi_eagle_host.target.model_layers import layer_id_list

def parse_step_settings(text: str | None, step: str) -> dict:
    """--step-settings: {step: {flag: value}} for the steps this job runs (the recipe's `steps:` entries); not given,
    the step checked with its defaults. Raises ValueError on anything else."""
    if text is None:
        return {step: {}}
    doc = json.loads(text)
    if not isinstance(doc, dict) or not all(isinstance(v, dict) for v in doc.values()):
        raise ValueError("expected a JSON object {step: {flag: value}}")
    return doc


def default_runs_dir() -> str | None:
    return host_runs_dir()


# How the host runs this module (its name in usage and error lines).
PROG = "python -m kimi_eagle_host.ops.preflight"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Pre-flight checks for a pipeline step host side.")
    p.add_argument("--step", choices=["regenerate", "prepare", "extract", "vocab", "train", "choose", "eval", "all"],
                   default="all")
    p.add_argument("--draft", default=None, help="eval: an exported draft folder (config.json) to check for serving")
    p.add_argument("--model", default=None)
    p.add_argument("--dataset", default=None)
    p.add_argument("--output-dir", default=None)
    p.add_argument("--layer-ids", default=None, help="comma list; default [2, N//2, N-3, N]")
    # The extraction engine (the setting `engine`); its default is the schema's (kimi_eagle_host/settings.py).
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="extraction engine (the setting `engine`)")
    p.add_argument("--backend", dest="engine", choices=["hf", "vllm"], action=RenamedFlag, new="--engine",
                   help=argparse.SUPPRESS)
    p.add_argument("--model-source", default=None,
                   help="the job builds --model first: tiny (a random demo model) or a pipeline/models.py source")
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--max-samples", type=int, default=None,
                   help="rows the pipeline will use (default: prepare's max_samples in --step-settings, else all)")
    p.add_argument("--runs-dir", default=None, help="<workdir>/runs, holding gpu.lock")
    p.add_argument("--job-id", default=None, help="this job's id: a GPU lock held by it is fine")
    p.add_argument("--patch-engine", default=str(Path(__file__).resolve().parent.parent / "deploy_patch.py"))
    p.add_argument("--nvidia-smi", default=None, help="nvidia-smi binary (default: PATH, /usr/local/nvidia/bin)")
    p.add_argument("--min-free-disk-gib", type=float, default=10.0,
                   help="free disk to keep beyond the estimate (default 10)")
    p.add_argument("--epochs", type=float, default=None,
                   help="training epochs, for the storage plan's hours (default: train's in --step-settings, else 1)")
    p.add_argument("--hidden-states", choices=["offline", "online"], default="offline",
                   help="online: no hidden-state files; the storage check shows what the run costs instead")
    p.add_argument("--gpus", type=int, default=None,
                   help="the host's gpus: (inventory): the job's steps use the first N visible GPUs (storage plan)")
    p.add_argument("--engine-gpus", default=None,
                   help="online: the GPUs the engine uses (unset: the trainer's, and the engine is sized beside it)")
    p.add_argument("--step-settings", default=None,
                   help='JSON {"regenerate": {"max_model_len": 512}, ...}: the steps this job runs and their settings '
                        "as each step gets them (default: --step with its defaults); sizes the vLLM engines of "
                        "regenerate and eval, and plans the storage (prepare's max_samples, regenerate's prompt "
                        "counts, extract's out and prepared_dir, train's epochs, trainer and online buffer)")
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
    return {"ok": all(c["status"] != "fail" for c in checks), "step": args.step, "engine": args.engine,
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
        print(f"{PROG}: --layer-ids: not a comma list of integers: {args.layer_ids!r}", file=sys.stderr)
        return 2
    try:
        args.step_settings_parsed = parse_step_settings(args.step_settings, args.step)
    except ValueError as e:
        print(f"{PROG}: --step-settings: {e}", file=sys.stderr)
        return 2
    if args.tp_size < 1 or args.seq_len < 1:
        print(f"{PROG}: --tp-size and --seq-len must be >= 1", file=sys.stderr)
        return 2
    if args.max_samples is None:   # prepare keeps this many (0: all)
        args.max_samples = step_value(args, "prepare", "max_samples") or None
    if args.runs_dir is None:
        args.runs_dir = default_runs_dir()
    args.smi_path = find_nvidia_smi(args.nvidia_smi)
    report = run_checks(args)
    print(json.dumps(report, indent=2))
    for c in report["checks"]:
        if c["status"] != "pass":
            log(f"{c['status'].upper()} {c['name']}: {c['detail']} -> {c['fix']}")
    return 0 if report["ok"] else 1
