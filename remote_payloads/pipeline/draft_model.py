"""The EAGLE-3 draft head: its definition, what it reads from the target, and its speculators export.

Shared by train (which fits it), eval (which loads an export to propose tokens) and the serving tests.

The draft mirrors speculators' ``Eagle3DraftModel`` (v0.9) with a Llama first layer, tensor for tensor:
  fc: [L_aux*H -> H] fuses the aux hidden states,
  layers.0: a Llama decoder layer whose q/k/v take concat[input_layernorm(embed(tok)), hidden_norm(h)] (2H),
  norm + lm_head over the draft vocabulary (initialised from the target lm_head rows selected by t2d).
We re-implement it instead of importing speculators because the host's speculators version is not pinned
and its import pulls in openai/datasets/hs_connectors; tests/test_train.py loads our export with
speculators' own class and checks the logits match.
"""
from __future__ import annotations

import glob
import json
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the payload root: step_runtime
from step_runtime import BadInput, atomic_write_json, atomic_write_via, log  # noqa: E402


# ----------------------------------------------------------------------------------------------------
# Target model: config and the three tensors we need, loaded by name without instantiating the model.

def load_target_config(model_dir: str) -> tuple[dict, list[str]]:
    """Return (text config as a dict, target architectures).

    AutoConfig with trust_remote_code handles Kimi's custom config class; if that fails (custom code
    missing on this host, unknown model_type) we fall back to the raw config.json, which carries every
    field we read. Multimodal wrappers (KimiK25ForConditionalGeneration) nest the LM under text_config.
    """
    raw_path = os.path.join(model_dir, "config.json")
    if not os.path.isfile(raw_path):
        raise BadInput(f"{raw_path}: missing (--model must be a local model directory)")
    with open(raw_path) as f:
        raw = json.load(f)
    archs = list(raw.get("architectures") or [])
    cfg = None
    try:
        from transformers import AutoConfig

        c = AutoConfig.from_pretrained(model_dir, trust_remote_code=True)
        c = getattr(c, "text_config", None) or c
        cfg = c.to_dict()
    except Exception as e:  # noqa: BLE001 - any failure means: use the raw JSON
        log(f"note: AutoConfig failed ({type(e).__name__}: {e}); reading {raw_path} directly")
    if cfg is None:
        cfg = raw.get("text_config") or raw
    for field in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        if field not in cfg:
            raise BadInput(f"{raw_path}: text config lacks '{field}'")
    return cfg, archs


def _weight_names(model_dir: str) -> dict[str, str]:
    """tensor name -> safetensors file (relative to model_dir), from the index or the single file(s)."""
    from safetensors import safe_open

    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise BadInput(f"{model_dir}: no model.safetensors.index.json and no *.safetensors files")
    out = {}
    for p in files:
        with safe_open(p, "pt") as f:
            for k in f.keys():
                out[k] = os.path.basename(p)
    return out


# Towers that may carry tensors with the same suffix (e.g. a vision encoder's final norm); a language
# model tensor never lives under these prefixes.
_NON_LM_PARTS = ("vision", "visual", "mm_projector", "multi_modal_projector", "audio")


def resolve_weight_name(names, suffix: str, what: str, model_dir: str) -> str | None:
    """Find the tensor whose name is `suffix` or ends with '.'+suffix (wrappers add prefixes such as
    'language_model.'); ignore vision/audio towers. Ambiguity is an error, absence returns None."""
    hits = [n for n in names if n == suffix or n.endswith("." + suffix)]
    hits = [n for n in hits if not any(p in n.split(".")[0] for p in _NON_LM_PARTS)]
    if len(hits) > 1:
        raise BadInput(f"{model_dir}: {what}: several tensors end with '{suffix}': {sorted(hits)}; "
                         f"pass the exact name with --{what}-key")
    return hits[0] if hits else None


def load_target_tensors(model_dir: str, cfg: dict, keys: dict[str, str | None]) -> dict[str, torch.Tensor]:
    """Load embed_tokens, final norm and lm_head (tied to embed when the config says so)."""
    from safetensors import safe_open

    wmap = _weight_names(model_dir)
    suffixes = {"embed": "embed_tokens.weight", "norm": "model.norm.weight", "lm-head": "lm_head.weight"}
    names = {}
    for what, suffix in suffixes.items():
        name = keys.get(what) or resolve_weight_name(wmap, suffix, what, model_dir)
        if name is not None and name not in wmap:
            raise BadInput(f"{model_dir}: --{what}-key {name!r} is not a tensor of this model")
        names[what] = name
    if names["embed"] is None:
        raise BadInput(f"{model_dir}: no tensor named '*embed_tokens.weight' (use --embed-key)")
    if names["norm"] is None:
        raise BadInput(f"{model_dir}: no tensor named '*model.norm.weight' (use --norm-key)")
    if names["lm-head"] is None:
        if not cfg.get("tie_word_embeddings", False):
            raise BadInput(f"{model_dir}: no tensor named '*lm_head.weight' and tie_word_embeddings "
                             f"is false (use --lm-head-key)")
        names["lm-head"] = names["embed"]
    out = {}
    for what, name in names.items():
        if what == "lm-head" and name == names["embed"]:
            out[what] = out["embed"]  # tied: the same tensor object (the trainer relies on `is`)
            continue
        with safe_open(os.path.join(model_dir, wmap[name]), "pt") as f:
            out[what] = f.get_tensor(name)
        log(f"target {what}: {name} {tuple(out[what].shape)} {out[what].dtype}")
    return out


# ----------------------------------------------------------------------------------------------------
# The draft model. Names and math follow speculators' Eagle3DraftModel + LlamaDecoderEagle3FirstLayer.

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.nh, self.nkv, self.hd = nh, nkv, hd
        # q/k/v read concat[embeds, hidden] (2H), the EAGLE-3 change to a Llama layer.
        self.q_proj = nn.Linear(2 * H, nh * hd, bias=False)
        self.k_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.v_proj = nn.Linear(2 * H, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x, positions, mask, kv_cache: list):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        freqs = positions[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None].to(q.dtype), emb.sin()[:, None].to(q.dtype)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        # TTT: keys/values of every earlier step stay visible (speculators keeps them in a DynamicCache);
        # the mask below decides which of them each query may see.
        kv_cache.append((k, v))
        k = torch.cat([kk for kk, _ in kv_cache], dim=2)
        v = torch.cat([vv for _, vv in kv_cache], dim=2)
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3FirstLayer(nn.Module):
    def __init__(self, c: dict, norm_before_residual: bool):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(H, eps)   # normalises the token embeddings
        self.hidden_norm = RMSNorm(H, eps)       # normalises the fused / previous-step hidden state
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.norm_before_residual = norm_before_residual

    def forward(self, embeds, hidden, positions, mask, kv_cache):
        # The residual stream carries the hidden part only; embeddings just condition attention.
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        x = torch.cat([self.input_layernorm(embeds), hidden], dim=-1)
        h = residual + self.self_attn(x, positions, mask, kv_cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Draft(nn.Module):
    """Trainable draft. The frozen target tensors (embedding table, target norm, target lm_head rows)
    live outside the parameter set, so checkpoints stay small and the optimizer never sees them."""

    def __init__(self, c: dict, num_aux: int, draft_vocab: int, norm_before_residual: bool):
        super().__init__()
        H = c["hidden_size"]
        self.fc = nn.Linear(num_aux * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3FirstLayer(c, norm_before_residual)])
        self.norm = RMSNorm(H, c["rms_norm_eps"])
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)

    def forward(self, aux, input_ids, key_valid, embed_fn, ttt_steps: int):
        """aux [B,T,L_aux*H] (aux features of position j), input_ids [B,T] (token j+1), key_valid [B,T].

        Returns one [B,T,K] logits tensor per TTT step. Step 0 sees the target's fused features; step k
        sees the draft's own step k-1 output at the same index plus the ground-truth token k positions
        further on, i.e. it rehearses speculating k tokens ahead (EAGLE-3 training-time test).
        """
        B, T = input_ids.shape
        dev = input_ids.device
        # speculators numbers positions from 1 after its one-token shift (shift_batch); RoPE is relative,
        # so this only matters for bit-exact agreement with speculators.
        positions = (1 + torch.arange(T, device=dev)).expand(B, T)
        idx = torch.arange(T, device=dev)
        causal = (idx[:, None] >= idx[None, :])[None] & key_valid[:, None, :]   # [B,T,T]
        diag = torch.eye(T, dtype=torch.bool, device=dev).expand(B, T, T)
        hidden = self.fc(aux)
        kv_cache: list = []
        logits_per_step = []
        ids = input_ids
        for k in range(ttt_steps):
            # Step k's queries see step-0 keys causally and, for every earlier step s>=1 and the current
            # one, only the key at their own index (the draft's own chain), exactly like speculators'
            # create_combined_mask_mod + extend_mask_for_draft_tokens.
            mask = torch.cat([causal] + [diag] * k, dim=-1)[:, None]            # [B,1,T,(k+1)T]
            hidden = self.layers[0](embed_fn(ids), hidden, positions + k, mask, kv_cache)
            logits_per_step.append(self.lm_head(self.norm(hidden)))
            # Teacher forcing for the next step: ground-truth tokens shifted k+1 left, zero padded.
            ids = torch.cat([input_ids[:, k + 1:], input_ids.new_zeros(B, min(k + 1, T))], dim=1)[:, :T]
        return logits_per_step


def draft_layer_config(tcfg: dict, args) -> dict:
    """The Llama decoder-layer shape of the draft, derived from the target's text config.

    The draft is always Llama-style (speculators/vLLM load 'llama' and 'qwen3' Eagle3 layers; DeepSeek/
    Kimi targets have MLA, which a GQA Llama layer replaces). Heads default to the target's count with
    head_dim = H / heads; plain RoPE with the target's theta (the target's YaRN scaling is not needed for
    a one-layer head trained on <= seq-len tokens).
    """
    H = tcfg["hidden_size"]
    nh = args.draft_num_heads or tcfg["num_attention_heads"]
    nkv = args.draft_num_kv_heads or tcfg.get("num_key_value_heads") or nh
    if H % nh or nh % nkv:
        raise BadInput(f"--draft-num-heads {nh} / --draft-num-kv-heads {nkv} do not divide hidden {H}")
    rope = tcfg.get("rope_parameters") or {}
    theta = rope.get("rope_theta") or tcfg.get("rope_theta") or 10000.0
    return {
        "hidden_size": H,
        "num_attention_heads": nh,
        "num_key_value_heads": nkv,
        "head_dim": H // nh,
        "intermediate_size": args.draft_intermediate_size or tcfg.get("intermediate_size") or 4 * H,
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_theta": float(theta),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "vocab_size": tcfg["vocab_size"],
    }


def export_speculators(export_dir, model, c, aux_ids, d2t, t2d, args, verifier_archs, embed, dtype):
    """Write config.json + model.safetensors exactly as speculators' Eagle3DraftModel.save_pretrained.

    eagle_aux_hidden_state_layer_ids: our data_config layer ids are in vLLM's serving convention
    (id i = the residual stream entering decoder layer i; id N = last layer output before the final
    norm), and vLLM's Eagle3 target models capture `eagle_aux_hidden_state_layer_ids` with the same
    convention (aux_hidden_state_layers: hidden state *before* layer i). So the ids the draft was
    trained on are written unchanged; the final id N is not an aux layer (it only produced the
    training targets) and is dropped. Writing them explicitly also stops vLLM from falling back to its
    own default (2, N//2, N-3), which would silently differ for custom --layer-ids.
    """
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    tl = LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
        num_hidden_layers=1, num_attention_heads=c["num_attention_heads"],
        num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"], rms_norm_eps=c["rms_norm_eps"],
        max_position_embeddings=c["max_position_embeddings"],
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
        tie_word_embeddings=False,
    )
    layer_config = tl.to_diff_dict()
    # transformers 4.x (vLLM <= 0.16 hosts) reads rope_theta, not rope_parameters: write both.
    layer_config["rope_theta"] = float(c["rope_theta"])
    # vLLM >= 0.25 sizes the draft's fc from num_aux_hidden_states (else len(aux ids), else 3); say it outright.
    # Releases that hard-code 3 cannot serve other counts: vllm_compat.eagle3_aux_count_ok says which.
    layer_config["num_aux_hidden_states"] = len(aux_ids)
    # A draft vocabulary as large as the target's maps every id to itself: vLLM then has no d2t buffer to load
    # them into (it allocates one only when the sizes differ), so they are left out.
    full_vocab = int(d2t.shape[0]) == int(t2d.shape[0])
    dtype_name = str(dtype).replace("torch.", "")
    config = {
        "architectures": ["Eagle3DraftModel"],  # what speculators >= 0.9 save_pretrained writes
        "speculators_model_type": "eagle3",
        # Format tag: the layout mirrors speculators 0.9.0's Eagle3 config (read by vLLM's speculators
        # config parser and by speculators' own loader).
        "speculators_version": "0.9.0",
        "transformer_layer_config": layer_config,
        "draft_vocab_size": int(d2t.shape[0]),
        "norm_before_residual": bool(args.norm_before_residual),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_ids],
        "num_aux_hidden_states": len(aux_ids),
        "tie_word_embeddings": False,
        "dtype": dtype_name,
        "speculators_config": {
            "algorithm": "eagle3",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": int(args.ttt_steps),
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": os.path.abspath(args.model), "architectures": verifier_archs},
        },
    }
    tensors = {k: v.detach().to("cpu", dtype).contiguous() for k, v in model.state_dict().items()
               if not k.endswith("inv_freq")}
    if not full_vocab:
        tensors["d2t"] = d2t.to("cpu", torch.int64).contiguous()
        tensors["t2d"] = t2d.to("cpu", torch.bool).contiguous()
    if args.export_embed_tokens:
        # Included by default, like speculators' save_pretrained: speculators' loader only fills a
        # missing embed_tokens from the verifier when the freshly allocated tensor happens to hold NaN
        # (observed flaky with transformers 5.17). vLLM can share the target's embedding instead, so
        # --no-export-embed-tokens saves ~2.3 GB for Kimi when only vLLM reads the export.
        tensors["embed_tokens.weight"] = embed.detach().to("cpu", dtype).contiguous()
    os.makedirs(export_dir, exist_ok=True)
    atomic_write_via(os.path.join(export_dir, "model.safetensors"),
                           lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_json(os.path.join(export_dir, "config.json"), config)
    return config
