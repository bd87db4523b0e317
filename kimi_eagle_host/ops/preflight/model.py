"""The target model: its config, layer ids, size, and a model the job builds first."""

from __future__ import annotations

import json
import os
from pathlib import Path

from kimi_eagle_host.model_size import model_weight_bytes
from kimi_eagle_host.ops.preflight.report import check
from kimi_eagle_host.target.model_layers import LayerIdError, default_layer_ids
from kimi_eagle_host.vllm_compat import final_layer_capture

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
    if args.engine != "vllm" or not inst or args.step not in ("extract", "all"):
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
    return model_weight_bytes(model, ctx.get("text_config") or {}, ctx.get("dtype"), ctx.get("quantization"))


def model_source_checks(args) -> list[dict]:
    """A model the job builds before its steps (--model-source), when it is not there yet: whether it can be built."""
    if not args.model_source or os.path.isfile(os.path.join(args.model, "config.json")):
        return []
    if args.model_source == "tiny":
        return [check("model", "pass", f"{args.model}: a tiny random model the job builds first")]
    from kimi_eagle_host.target.model_sources import GGUF_READERS, SOURCES, locate, missing_gguf_readers
    from kimi_eagle_host.step_runtime import BadInput

    cannot = f"{args.model} does not exist yet and cannot be built: "
    try:
        weights = locate(args.model_source)
    except BadInput as e:
        return [check("model", "fail", cannot + str(e).removeprefix("--source "), SOURCES[args.model_source][2])]
    # the models step runs as the job's second step: a missing reader would fail it after the record is written
    missing = missing_gguf_readers()
    if missing:
        return [check("model", "fail", cannot + missing,
                      f"install them in the host's Python: pip install {' '.join(GGUF_READERS)}")]
    return [check("model", "pass", f"{args.model}: built by the job from {weights}")]


def _pipeline_module(name: str):
    """A module of the host package by its dotted name under kimi_eagle_host (the steps and their data modules are
    stdlib at import: they import torch and the rest when they run)."""
    import importlib

    return importlib.import_module(f"kimi_eagle_host.{name}")
