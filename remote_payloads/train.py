#!/usr/bin/env python3
"""Train an EAGLE-3 draft head on extracted hidden states; export it in speculators' Eagle3 format.

Runs on the GPU host under the host's Python (see docs/CONTRACTS.md): one JSON document on stdout,
progress on stderr, exit 0 ok / 1 failed / 2 bad usage or input.

Inputs (all under --output-dir):
  hidden_states/hs_{i}.safetensors  token_ids [T] int, hidden_states [T, L, H], loss_mask [T]
  hidden_states/data_config.json    layer_ids (vLLM convention, last one == num_layers), hidden_size, ...
  vocab/d2t.npy, vocab/t2d.npy      d2t[i] = target_id - i (int64 [K]); t2d bool [target_vocab]
and --model: the target (only its embedding table, final norm and lm_head are read, by tensor name).

Outputs:
  draft/checkpoints/step_XXXXXXXX.pt  model + optimizer + step + rng (atomic), resumable with --resume
  draft/export/config.json + model.safetensors   speculators Eagle3 format (what vLLM loads)

The draft mirrors speculators' ``Eagle3DraftModel`` (v0.9) with a Llama first layer, tensor for tensor:
  fc: [L_aux*H -> H] fuses the aux hidden states,
  layers.0: a Llama decoder layer whose q/k/v take concat[input_layernorm(embed(tok)), hidden_norm(h)] (2H),
  norm + lm_head over the draft vocabulary (initialised from the target lm_head rows selected by t2d).
We re-implement it (~150 lines below) instead of importing speculators because the host's speculators
version is not pinned and its import pulls in openai/datasets/hs_connectors; tests/test_train.py loads our
export with speculators' own class and checks the logits match.
"""
from __future__ import annotations

import argparse
import glob
import json
import math
import os
import re
import sys
import tempfile
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

CKPT_RE = re.compile(r"^step_(\d{8})\.pt$")


class UsageError(Exception):
    """Bad flags or inputs: exit 2, one line on stderr naming the file/field."""


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# Atomic writes (temp name in the same directory + os.replace), as the contract requires.

def atomic_write_bytes_via(path: str, writer) -> None:
    d = os.path.dirname(path) or "."
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    os.close(fd)
    try:
        writer(tmp)
        # mkstemp makes 0600; give the file the mode a plain open() would (vLLM may run as another user).
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_json(path: str, obj) -> None:
    def w(tmp):
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=2, sort_keys=True)
            f.write("\n")
    atomic_write_bytes_via(path, w)


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
        raise UsageError(f"{raw_path}: missing (--model must be a local model directory)")
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
            raise UsageError(f"{raw_path}: text config lacks '{field}'")
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
        raise UsageError(f"{model_dir}: no model.safetensors.index.json and no *.safetensors files")
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
        raise UsageError(f"{model_dir}: {what}: several tensors end with '{suffix}': {sorted(hits)}; "
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
            raise UsageError(f"{model_dir}: --{what}-key {name!r} is not a tensor of this model")
        names[what] = name
    if names["embed"] is None:
        raise UsageError(f"{model_dir}: no tensor named '*embed_tokens.weight' (use --embed-key)")
    if names["norm"] is None:
        raise UsageError(f"{model_dir}: no tensor named '*model.norm.weight' (use --norm-key)")
    if names["lm-head"] is None:
        if not cfg.get("tie_word_embeddings", False):
            raise UsageError(f"{model_dir}: no tensor named '*lm_head.weight' and tie_word_embeddings "
                             f"is false (use --lm-head-key)")
        names["lm-head"] = names["embed"]
    out = {}
    for what, name in names.items():
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


def step_losses(logits_per_step, target_logits, loss_mask, decay: float):
    """Forward KL(target || draft) per TTT step over loss-masked positions, weighted decay**k.

    Step-k logits at index j predict what the target predicts at index j+k, so compare
    logits[:, :T-k] with targets[:, k:] and mask with loss_mask[:, k:] (speculators' align_for_step).
    Returns (total loss, per-step losses, per-step top-1 agreement, tokens counted at step 0).
    """
    total = 0.0
    losses, accs = [], []
    T = target_logits.shape[1]
    n0 = 0
    for k, logits in enumerate(logits_per_step):
        lg, tg, m = logits[:, : T - k], target_logits[:, k:], loss_mask[:, k:]
        n = m.sum()
        if k == 0:
            n0 = int(n)
        logp = F.log_softmax(lg.float(), dim=-1)
        tp = F.softmax(tg.float(), dim=-1)
        kl = (tp * (torch.log(tp.clamp_min(1e-30)) - logp)).sum(-1)
        loss_k = (kl * m).sum() / n.clamp_min(1)
        agree = ((lg.argmax(-1) == tg.argmax(-1)) & m).sum() / n.clamp_min(1)
        total = total + (decay ** k) * loss_k
        losses.append(float(loss_k.detach()))
        accs.append(float(agree))
    return total, losses, accs, n0


# ----------------------------------------------------------------------------------------------------
# Data

def list_samples(hs_dir: str) -> list[str]:
    files = glob.glob(os.path.join(hs_dir, "hs_*.safetensors"))
    keyed = []
    for p in files:
        m = re.match(r"^hs_(\d+)\.safetensors$", os.path.basename(p))
        if m:
            keyed.append((int(m.group(1)), p))
    return [p for _, p in sorted(keyed)]


def check_sample_headers(files, num_ids: int, hidden: int) -> int:
    """Validate shapes from the safetensors headers (no data read); return total token count."""
    from safetensors import safe_open

    tokens = 0
    for p in files:
        with safe_open(p, "pt") as f:
            keys = set(f.keys())
            for need in ("token_ids", "hidden_states", "loss_mask"):
                if need not in keys:
                    raise UsageError(f"{p}: missing tensor '{need}'")
            hs = f.get_slice("hidden_states").get_shape()
            T = f.get_slice("token_ids").get_shape()
            lm = f.get_slice("loss_mask").get_shape()
        if len(hs) != 3 or hs[1] != num_ids or hs[2] != hidden or len(T) != 1 or hs[0] != T[0] or lm != T:
            raise UsageError(f"{p}: hidden_states {hs} / token_ids {T} / loss_mask {lm} do not match "
                             f"[T, {num_ids}, {hidden}] / [T] / [T]")
        if T[0] < 2:
            raise UsageError(f"{p}: token_ids: need at least 2 tokens, got {T[0]}")
        tokens += T[0] - 1
    return tokens


def load_batch(files, device, feat_dtype):
    """Read samples, apply the EAGLE shift, right-pad to the longest.

    Position j pairs the aux features of token j with input token j+1, and the target state of
    position j+1 (which predicts token j+2): the draft sees what the target saw up to j plus the token
    the target just emitted, and must guess the next one (speculators' shift_batch).
    """
    from safetensors.torch import load_file

    samples = [load_file(p) for p in files]
    T = max(s["token_ids"].shape[0] - 1 for s in samples)
    B = len(samples)
    L, H = samples[0]["hidden_states"].shape[1:]
    aux = torch.zeros(B, T, (L - 1) * H, dtype=feat_dtype)
    last = torch.zeros(B, T, H, dtype=feat_dtype)
    ids = torch.zeros(B, T, dtype=torch.long)
    lmask = torch.zeros(B, T, dtype=torch.bool)
    valid = torch.zeros(B, T, dtype=torch.bool)
    for b, s in enumerate(samples):
        n = s["token_ids"].shape[0] - 1
        hs = s["hidden_states"]
        aux[b, :n] = hs[:-1, :-1].reshape(n, (L - 1) * H).to(feat_dtype)
        last[b, :n] = hs[1:, -1].to(feat_dtype)
        ids[b, :n] = s["token_ids"][1:].long()
        lmask[b, :n] = s["loss_mask"][1:].bool()
        valid[b, :n] = True
    return (aux.to(device), last.to(device), ids.to(device), (lmask & valid).to(device), valid.to(device))


def batch_files(files, step: int, batch_size: int, seed: int):
    """Files of global step `step`: a pure function of (seed, epoch, step), so --resume needs no
    sampler state and reproduces an uninterrupted run exactly."""
    steps_per_epoch = math.ceil(len(files) / batch_size)
    epoch, i = divmod(step, steps_per_epoch)
    g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
    perm = torch.randperm(len(files), generator=g).tolist()
    return [files[j] for j in perm[i * batch_size:(i + 1) * batch_size]]


# ----------------------------------------------------------------------------------------------------
# Checkpoints and export

def latest_checkpoint(ckpt_dir: str) -> str | None:
    if not os.path.isdir(ckpt_dir):
        return None
    names = sorted(n for n in os.listdir(ckpt_dir) if CKPT_RE.match(n))
    return os.path.join(ckpt_dir, names[-1]) if names else None


def save_checkpoint(ckpt_dir, step, model, opt, meta, keep: int) -> str:
    path = os.path.join(ckpt_dir, f"step_{step:08d}.pt")
    state = {
        "step": step,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng_cpu": torch.get_rng_state(),
        "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        "meta": meta,
    }
    atomic_write_bytes_via(path, lambda tmp: torch.save(state, tmp))
    old = sorted(n for n in os.listdir(ckpt_dir) if CKPT_RE.match(n))
    for n in old[:-keep] if keep > 0 else []:
        os.unlink(os.path.join(ckpt_dir, n))
    return path


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
        raise UsageError(f"--draft-num-heads {nh} / --draft-num-kv-heads {nkv} do not divide hidden {H}")
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
    dtype_name = str(dtype).replace("torch.", "")
    config = {
        "architectures": ["Eagle3DraftModel"],  # what speculators >= 0.9 save_pretrained writes
        "speculators_model_type": "eagle3",
        # Format tag: the layout mirrors speculators 0.9.0's Eagle3 config (read by vLLM's speculators
        # config parser and by speculators' own loader).
        "speculators_version": "0.9.0",
        "transformer_layer_config": tl.to_diff_dict(),
        "draft_vocab_size": int(d2t.shape[0]),
        "norm_before_residual": bool(args.norm_before_residual),
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_ids],
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
    tensors["d2t"] = d2t.to("cpu", torch.int64).contiguous()
    tensors["t2d"] = t2d.to("cpu", torch.bool).contiguous()
    if args.export_embed_tokens:
        # Included by default, like speculators' save_pretrained: speculators' loader only fills a
        # missing embed_tokens from the verifier when the freshly allocated tensor happens to hold NaN
        # (observed flaky with transformers 5.17). vLLM can share the target's embedding instead, so
        # --no-export-embed-tokens saves ~2.3 GB for Kimi when only vLLM reads the export.
        tensors["embed_tokens.weight"] = embed.detach().to("cpu", dtype).contiguous()
    os.makedirs(export_dir, exist_ok=True)
    atomic_write_bytes_via(os.path.join(export_dir, "model.safetensors"),
                           lambda tmp: save_file(tensors, tmp, metadata={"format": "pt"}))
    atomic_write_json(os.path.join(export_dir, "config.json"), config)
    return config


# ----------------------------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="train.py",
        description="Train an EAGLE-3 draft head from <output-dir>/hidden_states + vocab and export it to "
                    "<output-dir>/draft/export in speculators' Eagle3 format. JSON result on stdout.")
    p.add_argument("--model", required=True, help="target model directory (config + safetensors)")
    p.add_argument("--output-dir", required=True, help="pipeline root (reads hidden_states/, vocab/)")
    p.add_argument("--epochs", type=float, default=1.0, help="passes over the samples (default 1)")
    p.add_argument("--lr", type=float, default=1e-4, help="peak learning rate (default 1e-4)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per optimizer step (padded)")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll depth (default 3)")
    p.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of TTT step k is decay**k")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype (autocast); master weights stay fp32. auto: bf16 on CUDA, fp32 on CPU; "
                        "also the export dtype")
    p.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    p.add_argument("--max-steps", type=int, default=None,
                   help="cap the total number of optimizer steps (defines the LR schedule length)")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="checkpoint and exit after this step without changing the schedule "
                        "(time-boxing / preemption; finish later with --resume)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--save-every", type=int, default=500, help="checkpoint every N steps (and at the end)")
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--lr-schedule", choices=["cosine", "constant"], default="cosine")
    p.add_argument("--warmup-steps", type=int, default=0)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=0.5, help="max grad norm, 0 = off (default 0.5)")
    p.add_argument("--norm-before-residual", type=int, choices=[0, 1], default=1,
                   help="speculators' norm_before_residual (default 1, speculators' training default)")
    p.add_argument("--train-lm-head", action="store_true",
                   help="also train the draft lm_head (speculators 0.9 keeps it frozen at target rows)")
    p.add_argument("--draft-num-heads", type=int, default=None)
    p.add_argument("--draft-num-kv-heads", type=int, default=None)
    p.add_argument("--draft-intermediate-size", type=int, default=None)
    p.add_argument("--export-embed-tokens", action=argparse.BooleanOptionalAction, default=True,
                   help="include the (frozen, target) embed_tokens.weight in the export (default: yes)")
    p.add_argument("--embed-key", default=None, help="exact tensor name of the target embedding")
    p.add_argument("--norm-key", default=None, help="exact tensor name of the target final norm")
    p.add_argument("--lm-head-key", default=None, help="exact tensor name of the target lm_head")
    return p


def lr_at(step: int, total: int, args) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine to 10% or constant."""
    if args.warmup_steps and step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant" or total <= args.warmup_steps:
        return args.lr
    t = (step - args.warmup_steps) / max(1, total - args.warmup_steps)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


def train(args) -> dict:
    t_start = time.time()
    out = os.path.abspath(args.output_dir)
    hs_dir, vocab_dir = os.path.join(out, "hidden_states"), os.path.join(out, "vocab")
    ckpt_dir, export_dir = os.path.join(out, "draft", "checkpoints"), os.path.join(out, "draft", "export")
    for name in ("batch_size", "ttt_steps", "log_every", "save_every"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: must be >= 1")

    # --- inputs ---------------------------------------------------------------------------------
    dc_path = os.path.join(hs_dir, "data_config.json")
    if not os.path.isfile(dc_path):
        raise UsageError(f"{dc_path}: missing (run extract first)")
    with open(dc_path) as f:
        dc = json.load(f)
    for field in ("layer_ids", "num_layers", "hidden_size"):
        if field not in dc:
            raise UsageError(f"{dc_path}: missing field '{field}'")
    conv = str(dc.get("layer_convention", "vllm"))
    if not conv.startswith("vllm"):
        # Features captured in another convention (e.g. "output of layer i") are shifted by one layer
        # from what vLLM feeds the draft at serving time; training on them would silently hurt acceptance.
        raise UsageError(f"{dc_path}: layer_convention {conv!r}: expected the vLLM convention")
    layer_ids, N, H = [int(i) for i in dc["layer_ids"]], int(dc["num_layers"]), int(dc["hidden_size"])
    if len(layer_ids) < 2 or layer_ids[-1] != N:
        raise UsageError(f"{dc_path}: layer_ids {layer_ids}: the last id must be num_layers={N} (the final "
                         f"hidden state that yields the training targets) after at least one aux layer")
    aux_ids = layer_ids[:-1]
    files = list_samples(hs_dir)
    if not files:
        raise UsageError(f"{hs_dir}: no hs_*.safetensors samples")
    n_tokens = check_sample_headers(files, len(layer_ids), H)

    for name in ("d2t.npy", "t2d.npy"):
        if not os.path.isfile(os.path.join(vocab_dir, name)):
            raise UsageError(f"{os.path.join(vocab_dir, name)}: missing (run vocab first)")
    d2t = torch.from_numpy(np.load(os.path.join(vocab_dir, "d2t.npy")).astype(np.int64))
    t2d = torch.from_numpy(np.load(os.path.join(vocab_dir, "t2d.npy")).astype(bool))
    K = d2t.shape[0]
    draft_to_target = d2t + torch.arange(K)
    if int(t2d.sum()) != K or not bool(t2d[draft_to_target].all()):
        raise UsageError(f"{vocab_dir}: d2t.npy/t2d.npy disagree (t2d has {int(t2d.sum())} true, d2t {K} ids)")
    # t2d's true positions in order are the draft ids' targets (both are built sorted by target id);
    # if not, rows of the target lm_head would land on the wrong draft ids.
    if not torch.equal(torch.nonzero(t2d).squeeze(1), draft_to_target):
        raise UsageError(f"{vocab_dir}/d2t.npy: draft ids must map to increasing target ids")

    tcfg, archs = load_target_config(args.model)
    if tcfg["hidden_size"] != H:
        raise UsageError(f"{dc_path}: hidden_size {H} != target hidden_size {tcfg['hidden_size']}")
    if tcfg["num_hidden_layers"] != N:
        raise UsageError(f"{dc_path}: num_layers {N} != target num_hidden_layers {tcfg['num_hidden_layers']}")
    if t2d.shape[0] != tcfg["vocab_size"]:
        raise UsageError(f"{vocab_dir}/t2d.npy: length {t2d.shape[0]} != target vocab_size {tcfg['vocab_size']}")
    c = draft_layer_config(tcfg, args)

    # --- device / dtype -------------------------------------------------------------------------
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError("--device cuda: no CUDA device visible")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    # Frozen target tensors and the feature stream are kept in the compute dtype (halves memory for
    # Kimi's 163840x7168 embedding); trainable weights stay fp32 and autocast does the mixing.
    feat_dtype = dtype

    tw = load_target_tensors(args.model, tcfg, {"embed": args.embed_key, "norm": args.norm_key,
                                               "lm-head": args.lm_head_key})
    if tuple(tw["embed"].shape) != (tcfg["vocab_size"], H):
        raise UsageError(f"{args.model}: embedding shape {tuple(tw['embed'].shape)} != ({tcfg['vocab_size']}, {H})")
    embed = tw["embed"].to(device, feat_dtype)
    target_lm_rows = tw["lm-head"][t2d].to(device, torch.float32)          # [K, H]
    target_norm = RMSNorm(H, c["rms_norm_eps"]).to(device)
    target_norm.weight.data.copy_(tw["norm"].float())
    target_norm.requires_grad_(False)
    del tw

    # --- model / optimizer ----------------------------------------------------------------------
    torch.manual_seed(args.seed)
    model = Eagle3Draft(c, len(aux_ids), K, bool(args.norm_before_residual))
    for mod in model.modules():  # Llama-style init; the RMSNorm weights start at 1
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=0.02)
    model.lm_head.weight.data.copy_(target_lm_rows)  # start from the target's own head (speculators)
    model.lm_head.weight.requires_grad_(bool(args.train_lm_head))
    model.to(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    steps_per_epoch = math.ceil(len(files) / args.batch_size)
    total = max(1, math.ceil(args.epochs * steps_per_epoch))
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    meta = {"total_steps": total, "batch_size": args.batch_size, "ttt_steps": args.ttt_steps, "lr": args.lr,
            "seed": args.seed, "aux_ids": aux_ids, "draft_vocab": K, "n_samples": len(files)}

    start = 0
    resumed_from = None
    if args.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            log(f"--resume: no checkpoint under {ckpt_dir}; starting from scratch")
        else:
            ck = torch.load(path, map_location="cpu", weights_only=False)
            diff = {k: (ck["meta"].get(k), v) for k, v in meta.items() if ck["meta"].get(k) != v}
            if diff:
                raise UsageError(f"{path}: checkpoint was made with different settings {diff}")
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["optimizer"])
            torch.set_rng_state(ck["rng_cpu"])
            if ck.get("rng_cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(ck["rng_cuda"])
            start = resumed_from = int(ck["step"])
            log(f"resumed from {path} at step {start}/{total}")

    def embed_fn(ids):
        return F.embedding(ids, embed)

    log(f"train: {len(files)} samples, {n_tokens} tokens, aux ids {aux_ids}, draft vocab {K}, "
        f"{sum(p.numel() for p in params)} trainable params, {total} steps on {device} ({dtype})")
    stop = total if args.stop_at_step is None else min(total, args.stop_at_step)
    history = []
    last_path = None
    t_log, tok_log = time.time(), 0
    model.train()
    for step in range(start, stop):
        lr = lr_at(step, total, args)
        for g in opt.param_groups:
            g["lr"] = lr
        aux, last, ids, lmask, valid = load_batch(batch_files(files, step, args.batch_size, args.seed),
                                                  device, feat_dtype)
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            with torch.no_grad():
                # The target's next-token distribution, restricted to the draft vocabulary.
                target_logits = F.linear(target_norm(last.float()), target_lm_rows).float()
            logits = model(aux, ids, valid, embed_fn, args.ttt_steps)
            loss, losses, accs, n_tok = step_losses(logits, target_logits, lmask, args.ttt_decay)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if args.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        tok_log += int(valid.sum())
        done = step + 1
        if done == 1 or done % args.log_every == 0 or done == stop:
            dt = max(time.time() - t_log, 1e-9)
            acc_s = " ".join(f"acc[{k}]={a:.2f}" for k, a in enumerate(accs))
            log(f"step {done}/{total} loss {loss.item():.4f} {acc_s} lr {lr:.2e} tok/s {tok_log / dt:.0f}")
            history.append({"step": done, "loss": loss.item(), "step_losses": losses, "acc": accs})
            t_log, tok_log = time.time(), 0
        if done % args.save_every == 0 or done == stop:
            last_path = save_checkpoint(ckpt_dir, done, model, opt, meta, args.keep_checkpoints)

    finished = stop == total
    result = {"ok": True, "finished": finished, "step": max(stop, start), "total_steps": total,
              "resumed_from_step": resumed_from, "samples": len(files), "tokens": n_tokens,
              "aux_layer_ids": aux_ids, "draft_vocab_size": K, "device": str(device), "dtype": str(dtype),
              "checkpoint": last_path or latest_checkpoint(ckpt_dir), "history": history,
              "elapsed_s": round(time.time() - t_start, 2)}
    if device.type == "cuda":
        result["cuda_peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if history:
        result["final_loss"], result["final_acc"] = history[-1]["loss"], history[-1]["acc"]
    if finished:
        cfg = export_speculators(export_dir, model, c, aux_ids, d2t, t2d, args, archs, embed, dtype)
        atomic_write_json(os.path.join(export_dir, "training_info.json"),
                          {"data_config": dc, "meta": meta, "final": history[-1] if history else None})
        result["export_dir"] = export_dir
        result["export_config"] = {k: cfg[k] for k in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size")}
        log(f"exported {export_dir}")
    return result


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = train(args)
    except UsageError as e:
        log(f"error: {e}")
        print(json.dumps({"ok": False, "error": str(e), "kind": "usage"}))
        return 2
    except Exception as e:  # noqa: BLE001 - report any failure as JSON, with a traceback on stderr
        import traceback

        traceback.print_exc()
        print(json.dumps({"ok": False, "error": f"{type(e).__name__}: {e}"}))
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
