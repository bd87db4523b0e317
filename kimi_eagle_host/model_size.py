"""How big a target is, from its config alone (no weights, no torch): parameters by part, bytes as stored (quantized
parts at their bit width), KV-cache bytes per token. Stdlib only; preflight reads it before anything is loaded.

Covers the two attention kinds the pipeline meets: multi-head latent attention (DeepSeek-V3 / Kimi-K2.5:
q_lora_rank, kv_lora_rank, qk_nope/rope_head_dim, v_head_dim; the cache holds one kv_lora_rank + qk_rope_head_dim
latent per token and layer, the same on every tensor-parallel rank) and grouped-query attention (Llama: the cache
holds K and V of num_key_value_heads heads, split across ranks). MoE layers: n_routed_experts of
moe_intermediate_size, n_shared_experts, a router; the first first_k_dense_replace layers are dense.
"""

from __future__ import annotations

import json
import os
import re

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1, "int8": 1}


def text_config_of(cfg: dict) -> dict:
    """The text model's config: a multimodal wrapper's (Kimi-K2.5) text_config, else the config itself."""
    return cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg


def read_config(model_dir) -> dict | None:
    """<model_dir>/config.json as a dict; None where there is no readable one."""
    try:
        with open(os.path.join(str(model_dir), "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    return cfg if isinstance(cfg, dict) else None


def read_text_config(model_dir) -> dict | None:
    """The text part of <model_dir>/config.json as a dict; None where there is no readable one. Every reader of a
    target's sizes (KV bytes, hidden size, positions, layers) starts here, without importing transformers."""
    cfg = read_config(model_dir)
    return text_config_of(cfg) if cfg is not None else None


def _mla(t: dict) -> bool:
    return bool(t.get("kv_lora_rank")) and bool(t.get("qk_rope_head_dim"))


def attention_params(t: dict) -> int:
    h, heads = t["hidden_size"], t["num_attention_heads"]
    if _mla(t):
        qk = t.get("qk_nope_head_dim", 0) + t["qk_rope_head_dim"]
        q_lora, kv_lora, v = t.get("q_lora_rank"), t["kv_lora_rank"], t.get("v_head_dim") or qk
        q = h * q_lora + q_lora + q_lora * heads * qk if q_lora else h * heads * qk
        kv = h * (kv_lora + t["qk_rope_head_dim"]) + kv_lora + kv_lora * heads * (t.get("qk_nope_head_dim", 0) + v)
        return q + kv + heads * v * h
    head_dim = t.get("head_dim") or h // heads
    kv_heads = t.get("num_key_value_heads") or heads
    return h * heads * head_dim * 2 + h * kv_heads * head_dim * 2


def parameters(t: dict) -> dict:
    """Parameters of a text config by part: embed, lm_head, attention, dense_mlp, routed_experts, shared_experts,
    router, norms."""
    h, n = t["hidden_size"], t["num_hidden_layers"]
    vocab = t.get("vocab_size") or 0
    inter = t.get("intermediate_size") or 4 * h
    routed = t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts") or 0
    moe_inter = t.get("moe_intermediate_size") or inter
    dense_layers = min(n, t.get("first_k_dense_replace") or 0) if routed else n
    moe_layers = n - dense_layers
    return {
        "embed": vocab * h,
        "lm_head": 0 if t.get("tie_word_embeddings") else vocab * h,
        "attention": n * attention_params(t),
        "dense_mlp": dense_layers * 3 * h * inter,
        "routed_experts": moe_layers * routed * 3 * h * moe_inter,
        "shared_experts": moe_layers * (t.get("n_shared_experts") or 0) * 3 * h * moe_inter,
        "router": moe_layers * routed * (h + 1),
        "norms": n * 2 * h + h,
    }


def _quantized_bits(q: dict | None) -> tuple[int, int] | None:
    """(bits, group_size) of a compressed-tensors / GPTQ-style weight quantization, else None."""
    if not isinstance(q, dict):
        return None
    for group in (q.get("config_groups") or {}).values():
        w = (group or {}).get("weights") or {}
        if w.get("num_bits"):
            return int(w["num_bits"]), int(w.get("group_size") or 128)
    if q.get("bits"):
        return int(q["bits"]), int(q.get("group_size") or 128)
    return None


def _ignored(q: dict, part: str) -> bool:
    """Whether a quantization config's `ignore` list keeps a part in full precision (regexes as in the Hub configs)."""
    probe = {"attention": "model.layers.1.self_attn.q_a_proj", "shared_experts": "model.layers.1.mlp.shared_experts.up_proj",
             "dense_mlp": "model.layers.0.mlp.up_proj", "routed_experts": "model.layers.1.mlp.experts.0.up_proj",
             "lm_head": "lm_head", "embed": "model.embed_tokens", "router": "model.layers.1.mlp.gate",
             "norms": "model.norm"}[part]
    if part in ("embed", "router", "norms"):
        return True  # not Linear layers: never quantized
    for pat in q.get("ignore") or []:
        if pat.startswith("re:") and re.match(pat[3:], probe):
            return True
        if pat == probe or (pat == "lm_head" and part == "lm_head"):
            return True
    return False


def stored_weight_bytes(model_dir: str) -> tuple[int | None, str]:
    """(bytes, how they were found) of a local model folder's weights as stored: its safetensors index's total_size,
    else the sum of its *.safetensors files; (None, "unknown") without either (not a folder, other formats)."""
    try:
        with open(os.path.join(model_dir, "model.safetensors.index.json")) as f:
            total = (json.load(f).get("metadata") or {}).get("total_size")
        if total:
            return int(total), "safetensors index total_size"
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    try:
        files = [os.path.join(model_dir, n) for n in os.listdir(model_dir) if n.endswith(".safetensors")]
    except OSError:
        files = []
    if files:
        return sum(os.path.getsize(f) for f in files), f"sum of {len(files)} safetensors file(s)"
    return None, "unknown"


def model_weight_bytes(model_dir, text_config: dict | None = None, dtype: str | None = None,
                       quantization: dict | None = None) -> tuple[int | None, str]:
    """(bytes, how) of a target's weights: as stored (stored_weight_bytes), else from its config's dims (a target
    whose weights are not there yet: preflight before a download); (None, "unknown") when neither says."""
    size, how = stored_weight_bytes(model_dir) if model_dir else (None, "unknown")
    if size is not None:
        return size, how
    t = text_config if text_config is not None else (read_text_config(model_dir) if model_dir else None) or {}
    if not (t.get("hidden_size") and t.get("num_hidden_layers") and t.get("num_attention_heads")):
        return None, "unknown"
    return weight_bytes(t, dtype or "bfloat16", quantization)


def weight_bytes(t: dict, dtype: str = "bfloat16", quantization: dict | None = None) -> tuple[int, str]:
    """(bytes of the weights as stored, how). Quantized parts count bits/8 plus one bf16 scale per group."""
    parts = parameters(t)
    full = DTYPE_BYTES.get(str(dtype or "bfloat16").replace("torch.", ""), 2)
    q = quantization or t.get("quantization_config")
    qb = _quantized_bits(q)
    total, quantized = 0.0, 0
    for part, n in parts.items():
        if qb and not _ignored(q, part):
            total += n * (qb[0] / 8 + 2 / qb[1])
            quantized += n
        else:
            total += n * full
    p = sum(parts.values())
    how = f"config dims: {p / 1e9:.1f} B params"
    how += (f", {quantized / 1e9:.1f} B of them {qb[0]}-bit (groups of {qb[1]}), the rest {full} B each" if quantized
            else f" x {full} B")
    return int(total), how


def kv_bytes_per_token(t: dict, tp: int = 1, dtype_bytes: int = 2) -> int:
    """KV-cache bytes per token on one tensor-parallel rank (MLA's latent is replicated, GQA's heads are split)."""
    n = t["num_hidden_layers"]
    if _mla(t):
        return n * (t["kv_lora_rank"] + t["qk_rope_head_dim"]) * dtype_bytes
    heads = t["num_attention_heads"]
    head_dim = t.get("head_dim") or t["hidden_size"] // heads
    kv_heads = t.get("num_key_value_heads") or heads
    return n * 2 * max(1, kv_heads // max(1, tp)) * head_dim * dtype_bytes


def compute_parameters(t: dict) -> int:
    """Parameters one token's forward multiplies through: all but the embedding lookup, with an MoE layer's routed
    experts at the share a token reaches (num_experts_per_tok of n_routed_experts). What a target's tokens/s
    scales with once its matmuls are large enough to be compute-bound."""
    parts = parameters(t)
    routed = t.get("n_routed_experts") or t.get("num_experts") or t.get("num_local_experts") or 0
    per_token = t.get("num_experts_per_tok") or routed
    share = min(1.0, per_token / routed) if routed else 1.0
    return int(sum(parts.values()) - parts["embed"] - parts["routed_experts"] * (1 - share))
