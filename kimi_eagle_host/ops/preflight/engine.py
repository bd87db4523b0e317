"""What each vLLM engine of the job will hold: the steps' own sizing (vllm_compat.step_engine_memory)."""

from __future__ import annotations

import argparse
import os

from kimi_eagle_host.data.spool_size import host_engines
from kimi_eagle_host.engine.extract_vllm import hidden_state_bytes_per_token
from kimi_eagle_host.gpus import gpu_numbers
from kimi_eagle_host.ops.preflight.gpu import gpu_label, used_gpus
from kimi_eagle_host.ops.preflight.model import _pipeline_module
from kimi_eagle_host.ops.preflight.report import check, step_value
from kimi_eagle_host.target.model_layers import LayerIdError, default_layer_ids
from kimi_eagle_host.vllm_compat import (CPU_KV_ENV, ENGINE_OF_ENV, GPU_ENGINES_ENV, GPU_SHARE_ENV, engines_sharing_gpu,
                                         step_engine_memory)

# Steps that start a vLLM engine besides extract's: their pipeline module says, from its ENGINE_FLAGS, what one engine
# holds at once (engine_load), so preflight sizes it exactly as the step will.
ENGINE_STEPS = ("regenerate", "choose", "eval")
# extract's engine holds max(64, --batch-size) prompts of --seq-len + 1 tokens at once (extract_vllm.extract_native).
EXTRACT_PROMPTS = 64


def check_engine_memory(args, ctx: dict) -> list[dict]:
    """What each vLLM engine of this job will take: the sizing the steps use (vllm_compat.step_engine_memory), from
    the memory free now (on a GPU host that of the least free GPU the step's engines use, named in the detail; else
    the host's), one check per step that starts an engine."""
    loads, engines = {}, {}
    online = args.hidden_states == "online" and args.step in ("train", "all")
    if args.engine == "vllm" and ctx.get("vllm_path") == "native":
        # online, train runs extract's engine itself (no extract step), beside the trainer unless engine_gpus says
        if online:
            loads["train"] = (args.seq_len + 1, EXTRACT_PROMPTS)
        elif args.step in ("extract", "all"):
            loads["extract"] = (args.seq_len + 1, EXTRACT_PROMPTS)
    out = []
    for step, settings in args.step_settings_parsed.items():
        transformers = not ctx.get("vllm") or settings.get("engine") == "hf" or \
            (step == "eval" and not ctx.get("serving_ok", True))  # eval falls back when vLLM cannot serve the draft
        if step not in ENGINE_STEPS or transformers:
            continue
        try:
            loads[step] = step_engine_load(step, settings)
            engines[step] = engines_of(step, settings)
        except ValueError as e:  # the step would refuse this setting itself (exit 2)
            out.append(check("engine-memory", "fail", f"{step}: {e}", "fix that step setting in the recipe"))
    gpus = used_gpus(args)[0] if loads and ctx.get("torch_cuda") not in (None, "cpu") else None
    for step, (tokens, sequences) in loads.items():
        extra = hidden_state_bytes_per_token(args.model, captured_ids(args, ctx), "bfloat16") \
            if step in ("extract", "train") and args.model else 0
        beside = step == "train" and not args.engine_gpus
        label = f"{step} (online engine{', beside the trainer' if beside else ''})" if step == "train" else step
        n = engines.get(step, 1)
        if n > 1:
            label += f" (each of {n} engines)"
        used = engine_gpus(args, step, gpus or [], n)
        decides = least_free(used)
        # None (not measured) where nvidia-smi gives no memory figure for the GPU ([N/A] on unified-memory GPUs).
        free_total = (int(decides["free_mib"]) << 20, int(decides["total_mib"]) << 20) if decides else None
        if decides:
            label += f": {gpu_label(decides)}" + (f", the least free of its {len(used)} GPUs" if len(used) > 1 else "")
        try:
            memory = step_engine_memory(args.model, args.tp_size, tokens, sequences, gpu_free_total=free_total,
                                        beside_trainer=beside, extra_bytes_per_token=extra,
                                        environ=several_engines_environ(n, len(gpus or [])))
            out.append(check("engine-memory", "pass", f"{label}: {memory['says']}"))
        except ValueError as e:
            out.append(check("engine-memory", "fail", f"{label}: {e}",
                             f"free memory, or set {CPU_KV_ENV} (CPU) / {GPU_SHARE_ENV} (GPU) in the host's env"))
    return out


def engine_gpus(args, step: str, gpus: list[dict], n: int) -> list[dict]:
    """The GPUs (of those the job sees, in its order) that `step`'s n engines take: one engine spans --tp-size of
    them, several engines (tp 1) are dealt one a GPU (engine_processes.process_env); online, train's engine sits on
    `engine_gpus` (the split layout) or one beside each tp_size of the trainer's `train_gpus` (spool_size.host_engines,
    as the train step counts them)."""
    tp = max(1, args.tp_size)
    if step != "train" or not gpus:
        return gpus[:n * tp]
    try:
        split = gpu_numbers(step_value(args, "train", "engine_gpus", args.engine_gpus))
        own = split or gpu_numbers(step_value(args, "train", "train_gpus"))
        online = step_value(args, "train", "online_engines")
    except ValueError:   # the train step refuses a bad value in one line; size as the plain layout
        split = own = online = None
    mine = [gpus[i] for i in own if i < len(gpus)] if own else gpus
    return mine[:tp * (1 if split else host_engines(len(mine), tp, online, False, True))]


def least_free(gpus: list[dict]) -> dict | None:
    """The GPU whose memory decides whether an engine over `gpus` starts: vLLM asks each GPU for the same share of
    its memory, so the one with the least part free (on like GPUs the least free); None where none reports memory."""
    known = [g for g in gpus if g["free_mib"] is not None and g["total_mib"]]
    return min(known, key=lambda g: g["free_mib"] / g["total_mib"]) if known else None


def engines_of(step: str, settings: dict) -> int:
    """The engines `step` runs at once with these settings (regenerate's `engines`; 1 for the others)."""
    from kimi_eagle_host.settings import BY_STEP

    if step != "regenerate":
        return 1
    return int(settings.get("engines", BY_STEP[step]["engines"].default_for(step)))


def several_engines_environ(n: int, gpus: int) -> dict:
    """The environment the first of n engines sizes itself in, as engine_processes.process_env gives it: its part of
    the host's memory and, on a GPU host where the user set no share, the first of those on the GPU that takes the most
    of them (round-robin): an equal part of what is free, so that the rest fit beside it."""
    env = dict(os.environ)
    if n > 1:
        env[ENGINE_OF_ENV] = f"0/{n}"
        if gpus and GPU_SHARE_ENV not in env:
            env[GPU_ENGINES_ENV] = f"0/{engines_sharing_gpu(0, n, gpus)}"
    return env


def captured_ids(args, ctx: dict) -> list[int]:
    """The layer ids extraction will capture: those given, else the model's defaults (none known: none)."""
    if args.layer_ids_parsed:
        return list(args.layer_ids_parsed)
    try:
        return default_layer_ids(ctx["num_layers"]) if ctx.get("num_layers") else []
    except LayerIdError:
        return []


def step_engine_load(step: str, settings: dict) -> tuple[int, int]:
    """(tokens per sequence, sequences at once) of `step`'s vLLM engine with these settings ({flag name: value}, as a
    recipe's `steps:` holds them) and the step's own defaults for the rest."""
    from kimi_eagle_host.settings import BY_STEP

    module = _pipeline_module(f"pipeline.{step}")
    given = {str(k).replace("-", "_"): v for k, v in settings.items()}
    return module.engine_load(argparse.Namespace(**{f: given.get(f, BY_STEP[step][f].default_for(step))
                                                    for f in module.ENGINE_FLAGS}))
