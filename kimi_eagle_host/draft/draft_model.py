"""The EAGLE-3 draft head: its definition, what it reads from the target, and its speculators export.

Shared by train (which fits it), eval (which loads an export to propose tokens) and the serving tests.

The draft mirrors speculators' ``Eagle3DraftModel`` (v0.9) with a Llama first layer, tensor for tensor:
  fc: [L_aux*H -> H] fuses the aux hidden states,
  layers.0: a Llama decoder layer whose q/k/v take concat[input_layernorm(embed(tok)), hidden_norm(h)] (2H),
  layers.1..: with `draft_layers` > 1, plain Llama decoder layers on the residual stream (what vLLM's Eagle3 Llama
    serves after its first layer; speculators' trainer builds one layer),
  norm + lm_head over the draft vocabulary (initialised from the target lm_head rows selected by t2d).
We re-implement it instead of importing speculators because the host's speculators version is not pinned
and its import pulls in openai/datasets/hs_connectors; tests/test_train.py loads our export with
speculators' own class and checks the logits match.
"""
from __future__ import annotations

import glob
import json
import os

import torch
import torch.nn.functional as F
from torch import nn

from kimi_eagle_host.step_runtime import BadInput, atomic_write_json, atomic_write_via, log
from kimi_eagle_host.target.target_config import ConfigUnreadable, read_raw, read_target_config, states


# ----------------------------------------------------------------------------------------------------
# Target model: config and the three tensors we need, loaded by name without instantiating the model.

# What the draft, its checks and the target's tensors read from the target's text config (target_config.py reads it
# from config.json alone where it states every one).
CONFIG_FIELDS = ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
                 "intermediate_size", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings")


def _states_every_field(text: dict) -> bool:
    rope = text.get("rope_parameters")
    has_theta = "rope_theta" in text or (isinstance(rope, dict) and "rope_theta" in rope)
    return has_theta and states(*CONFIG_FIELDS)(text)


def load_target_config(model_dir: str) -> tuple[dict, list[str]]:
    """Return (text config as a dict, target architectures), as target_config.read_target_config reads them; where
    AutoConfig cannot (custom code missing on this host, unknown model_type), the raw config.json, which carries
    every field required."""
    raw = read_raw(model_dir)
    raw_path = os.path.join(model_dir, "config.json")
    if raw is None:
        raise BadInput(f"{raw_path}: missing or unreadable (--model must be a local model directory)")
    try:
        cfg = read_target_config(model_dir, _states_every_field)[0]
    except ConfigUnreadable as e:
        log(f"note: {e}; reading {raw_path} directly")
        cfg = raw[0]
    for field in ("hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads"):
        if field not in cfg:
            raise BadInput(f"{raw_path}: text config lacks '{field}'")
    return cfg, raw[1]


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
    def __init__(self, c: dict, in_features: int):
        super().__init__()
        H, nh, nkv, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        self.nh, self.nkv, self.hd = nh, nkv, hd
        self.q_proj = nn.Linear(in_features, nh * hd, bias=False)
        self.k_proj = nn.Linear(in_features, nkv * hd, bias=False)
        self.v_proj = nn.Linear(in_features, nkv * hd, bias=False)
        self.o_proj = nn.Linear(nh * hd, H, bias=False)
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def qkv(self, x, positions):
        """Rotated queries, keys and values [B, heads, T, hd] of x [B,T,2H] at positions [B,T]."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.nh, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.nkv, self.hd).transpose(1, 2)
        freqs = positions[:, :, None].float() * self.inv_freq[None, None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos()[:, None].to(q.dtype), emb.sin()[:, None].to(q.dtype)
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin, v

    def out(self, o):
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, self.nh * self.hd))

    def forward(self, x, positions, mask, kv_cache: list):
        """Incremental use (spec_hf's proposer): keys/values of every earlier call stay in kv_cache and `mask`
        (dense, small there) says which of them each query sees. Training uses ttt_attention instead."""
        q, k, v = self.qkv(x, positions)
        kv_cache.append((k, v))
        k = torch.cat([kk for kk, _ in kv_cache], dim=2)
        v = torch.cat([vv for _, vv in kv_cache], dim=2)
        if self.nkv != self.nh:
            k = k.repeat_interleave(self.nh // self.nkv, dim=1)
            v = v.repeat_interleave(self.nh // self.nkv, dim=1)
        return self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


def ttt_attention(q, keys, values, attn):
    """Attention of TTT step k = len(keys) - 1 without a [T, (k+1)T] mask.

    q [B,nh,T,hd]; keys/values: one [B,nkv,T,hd] per step so far (step 0 first). A query at index j sees the
    step-0 keys of its own document up to j (causal) and, of every later step, only the key at j itself: the
    chain of guesses it made there (speculators' TTT mask, EAGLE-3).

    attn a tensor: the doc ids [B,T] (-1 = padding), computed here on any device (the reference): the step-0
    scores [B,nh,T,T] under a document-causal mask plus k diagonal scores per query (q_j . k_s[j]) in one
    softmax. attn a flex BlockMask (block_masks): flex_attention over the concatenated keys, where the
    diagonal blocks are nearly empty, so a step costs about one causal attention; fast once compiled on CUDA.
    """
    B, nh, T, hd = q.shape
    nkv = keys[0].shape[1]
    scale = hd ** -0.5
    if not torch.is_tensor(attn):
        return _flex(q, torch.cat(keys, dim=2), torch.cat(values, dim=2), block_mask=attn, scale=scale,
                     enable_gqa=nh != nkv)
    rep = nh // nkv

    def heads(t):
        return t.repeat_interleave(rep, dim=1) if rep > 1 else t

    k0, v0 = heads(keys[0]), heads(values[0])
    idx = torch.arange(T, device=q.device)
    allowed = (idx[:, None] >= idx[None, :])[None] & (attn[:, :, None] == attn[:, None, :])    # [B,T,T]
    scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    later = [(heads(ks), heads(vs)) for ks, vs in zip(keys[1:], values[1:])]
    if later:
        diag = torch.stack([(q * ks).sum(-1) for ks, _ in later], dim=-1) * scale               # [B,nh,T,k]
        scores = torch.cat([scores, diag], dim=-1)
    p = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    o = torch.matmul(p[..., :T], v0)
    for s, (_, vs) in enumerate(later):
        o = o + p[..., T + s, None] * vs
    return o


_COMPILED = {}


def _flex(*args, **kw):
    from torch.nn.attention.flex_attention import flex_attention

    if args[0].device.type != "cuda":   # eager flex_attention: a dense reference, fine for tests on CPU
        return flex_attention(*args, **kw)
    fn = _COMPILED.setdefault("flex", torch.compile(flex_attention, dynamic=False))
    return fn(*args, **kw)


def block_masks(doc_ids, ttt_steps: int) -> list:
    """flex BlockMasks of steps 0..ttt_steps-1 (step k: T queries x (k+1)T keys), built without a dense mask."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, T = doc_ids.shape

    def mask_mod(b, h, qi, kv):
        step, j = kv // T, kv % T
        first = (j <= qi) & (doc_ids[b, j] == doc_ids[b, qi])
        return torch.where(step == 0, first, j == qi)

    cuda = doc_ids.device.type == "cuda"
    return [create_block_mask(mask_mod, B, None, T, (k + 1) * T, device=doc_ids.device, _compile=cuda)
            for k in range(ttt_steps)]


class MLP(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(H, I, bias=False)
        self.up_proj = nn.Linear(H, I, bias=False)
        self.down_proj = nn.Linear(I, H, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _ResidualAttentionMLP:
    """What every draft layer ends with: the attention output added to the residual stream, then the MLP's."""

    def _finish(self, residual, attn_out):
        h = residual + attn_out
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3FirstLayer(_ResidualAttentionMLP, nn.Module):
    def __init__(self, c: dict, norm_before_residual: bool):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(H, eps)   # normalises the token embeddings
        self.hidden_norm = RMSNorm(H, eps)       # normalises the fused / previous-step hidden state
        self.post_attention_layernorm = RMSNorm(H, eps)
        # q/k/v read concat[embeds, hidden] (2H), the EAGLE-3 change to a Llama layer.
        self.self_attn = Attention(c, 2 * H)
        self.mlp = MLP(c)
        self.norm_before_residual = norm_before_residual

    def _mix_in(self, embeds, hidden):
        # The residual stream carries the hidden part only; embeddings just condition attention.
        residual = hidden
        hidden = self.hidden_norm(hidden)
        if self.norm_before_residual:
            residual = hidden
        return torch.cat([self.input_layernorm(embeds), hidden], dim=-1), residual

    def incremental(self, embeds, hidden, positions, mask, kv_cache):
        """Incremental use (spec_hf's proposer): kv_cache is a list this call appends its keys/values to."""
        x, residual = self._mix_in(embeds, hidden)
        return self._finish(residual, self.self_attn(x, positions, mask, kv_cache))

    def forward(self, embeds, hidden, positions, attn, keys: tuple, values: tuple):
        """One TTT step of training: returns (hidden, keys, values) with this step's keys/values appended.
        The state goes in and out as tensors, not a list mutated in place: FSDP2 copies a unit's inputs (a
        list appended to inside the unit was lost there, and step k>0 then met a mask for k+1 key blocks)."""
        x, residual = self._mix_in(embeds, hidden)
        q, k, v = self.self_attn.qkv(x, positions)
        keys, values = (*keys, k), (*values, v)
        o = ttt_attention(q, keys, values, attn)
        return self._finish(residual, self.self_attn.out(o)), keys, values


class Eagle3LaterLayer(_ResidualAttentionMLP, nn.Module):
    """A draft layer after the first (draft_layers > 1): a plain pre-norm Llama decoder layer on the residual stream,
    as vLLM's Eagle3 Llama runs its layers 1.. (q/k/v read the normed stream alone, no embeddings). Same call
    signatures as Eagle3FirstLayer; `embeds` is unused."""

    def __init__(self, c: dict):
        super().__init__()
        H, eps = c["hidden_size"], c["rms_norm_eps"]
        self.input_layernorm = RMSNorm(H, eps)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(c, H)
        self.mlp = MLP(c)

    def incremental(self, embeds, hidden, positions, mask, kv_cache):
        return self._finish(hidden, self.self_attn(self.input_layernorm(hidden), positions, mask, kv_cache))

    def forward(self, embeds, hidden, positions, attn, keys: tuple, values: tuple):
        q, k, v = self.self_attn.qkv(self.input_layernorm(hidden), positions)
        keys, values = (*keys, k), (*values, v)
        o = ttt_attention(q, keys, values, attn)
        return self._finish(hidden, self.self_attn.out(o)), keys, values


class Eagle3Draft(nn.Module):
    """Trainable draft. The frozen target tensors (embedding table, target norm, target lm_head rows)
    live outside the parameter set, so checkpoints stay small and the optimizer never sees them."""

    fsdp_root_modules = ("lm_head",)   # used by weight inside forward's loss (distributed.wrap)

    def __init__(self, c: dict, num_aux: int, draft_vocab: int, norm_before_residual: bool):
        super().__init__()
        H = c["hidden_size"]
        self.fc = nn.Linear(num_aux * H, H, bias=False)
        self.layers = nn.ModuleList([Eagle3FirstLayer(c, norm_before_residual),
                                     *(Eagle3LaterLayer(c) for _ in range(c.get("num_hidden_layers", 1) - 1))])
        self.norm = RMSNorm(H, c["rms_norm_eps"])
        self.lm_head = nn.Linear(H, draft_vocab, bias=False)

    def forward(self, aux, input_ids, embed_fn, ttt_steps: int, positions=None, doc_ids=None, flex: bool = False,
                loss_fn=None):
        """aux [B,T,L_aux*H] (aux features of position j), input_ids [B,T] (token j+1); positions [B,T] (from 1
        within each document, as speculators numbers them after its shift) and doc_ids [B,T] (which packed
        document a position belongs to, -1 = padding) default to one document per row.

        Step 0 sees the target's fused features; step k sees the draft's own step k-1 output at the same index
        plus the ground-truth token k positions further on, i.e. it rehearses speculating k tokens ahead
        (EAGLE-3 training-time test). flex: attention by flex_attention (CUDA), else ttt_attention's reference
        path. Without loss_fn: one [B,T,K] logits tensor per step. With it: whatever
        loss_fn(normed hidden per step, lm_head weight) returns, so the loss runs inside this forward (DDP/FSDP
        see one forward; the lm_head is never applied to every position at once).
        """
        B, T = input_ids.shape
        if positions is None:
            positions = (1 + torch.arange(T, device=input_ids.device)).expand(B, T)
        if doc_ids is None:
            doc_ids = torch.zeros_like(input_ids)
        masks = block_masks(doc_ids, ttt_steps) if flex else [doc_ids] * ttt_steps
        hidden = self.fc(aux)
        compute_dtype = hidden.dtype      # the residual stream stays in it (RMSNorm's fp32 weight would widen it)
        keys = [()] * len(self.layers)     # per layer: its keys/values of each TTT step so far
        values = [()] * len(self.layers)
        normed = []
        ids = input_ids
        for k in range(ttt_steps):
            embeds = embed_fn(ids)
            for i, layer in enumerate(self.layers):
                hidden, keys[i], values[i] = layer(embeds, hidden, positions + k, masks[k], keys[i], values[i])
            hidden = hidden.to(compute_dtype)
            normed.append(self.norm(hidden))
            # Teacher forcing for the next step: ground-truth tokens shifted k+1 left, zero padded. In a packed
            # row the shift reaches into the next document there; those positions are left out of the loss.
            ids = torch.cat([input_ids[:, k + 1:], input_ids.new_zeros(B, min(k + 1, T))], dim=1)[:, :T]
        if loss_fn is not None:
            return loss_fn(normed, self.lm_head.weight)
        return [self.lm_head(h) for h in normed]

    def incremental(self, embeds, hidden, positions, mask, kv_caches: list):
        """Incremental use (spec_hf's proposer): every layer in turn, kv_caches[i] the list layer i appends to."""
        for layer, kv in zip(self.layers, kv_caches):
            hidden = layer.incremental(embeds, hidden, positions, mask, kv)
        return hidden


def nonfinite_weights(st_path: str) -> list[str]:
    """The tensors of a safetensors file holding NaN or Inf, as problems. A diverged run's weights load and serve
    without complaint and accept nothing, so an export is checked before anything trusts it."""
    from safetensors import safe_open

    bad = []
    with safe_open(st_path, "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if t.is_floating_point() and not bool(torch.isfinite(t).all()):
                bad.append(f"tensor {name} holds NaN or Inf (training diverged)")
    return bad


def draft_layer_config(tcfg: dict, args) -> dict:
    """The Llama decoder-layer shape of the draft, derived from the target's text config.

    The draft is always Llama-style (speculators/vLLM load 'llama' and 'qwen3' Eagle3 layers; DeepSeek/
    Kimi targets have MLA, which a GQA Llama layer replaces). Heads default to the target's count with
    head_dim = H / heads; plain RoPE with the target's theta (the target's YaRN scaling is not needed for
    a draft head trained on <= seq-len tokens).
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
        "num_hidden_layers": args.draft_layers,
        "rms_norm_eps": tcfg.get("rms_norm_eps", 1e-6),
        "rope_theta": float(theta),
        "max_position_embeddings": tcfg.get("max_position_embeddings", 4096),
        "vocab_size": tcfg["vocab_size"],
    }


def llama_layer_config(c: dict) -> dict:
    """The draft's decoder layer as the LlamaConfig that speculators writes (`transformer_layer_config`): every field
    stated, so any transformers a serving host has reads the same layer, whatever its own defaults. Written out
    rather than through transformers' LlamaConfig, whose import is most of what a train process would still pay for
    transformers; tests/test_target_config.py reads it back through LlamaConfig on transformers 4 and 5."""
    from importlib import metadata

    try:
        written_by = {"transformers_version": metadata.version("transformers")}
    except metadata.PackageNotFoundError:
        written_by = {}
    theta = float(c["rope_theta"])
    return {
        **written_by,
        "model_type": "llama",
        "vocab_size": c["vocab_size"], "hidden_size": c["hidden_size"], "intermediate_size": c["intermediate_size"],
        "num_hidden_layers": c["num_hidden_layers"], "num_attention_heads": c["num_attention_heads"],
        "num_key_value_heads": c["num_key_value_heads"], "head_dim": c["head_dim"], "hidden_act": "silu",
        "max_position_embeddings": c["max_position_embeddings"], "initializer_range": 0.02,
        "rms_norm_eps": c["rms_norm_eps"], "use_cache": True, "pad_token_id": None, "bos_token_id": 1,
        "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": False,
        "attention_bias": False, "attention_dropout": 0.0, "mlp_bias": False,
        # transformers 5 reads rope_parameters; transformers 4 (vLLM <= 0.16 hosts) reads rope_theta: both.
        "rope_parameters": {"rope_type": "default", "rope_theta": theta}, "rope_theta": theta,
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

    layer_config = llama_layer_config(c)
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
