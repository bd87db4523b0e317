"""The frozen pieces of the target that train uses on the device: its embedding table, final norm and lm_head (read
by tensor name from --model), and the target's greedy next token over its full vocabulary."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kimi_eagle_host.data import packing  # (a document's features, as a step reads them)
from kimi_eagle_host.draft import parity
from kimi_eagle_host.draft.draft_model import RMSNorm, load_target_tensors
from kimi_eagle_host.step_runtime import BadInput


@dataclass
class TargetHead:
    """The target's frozen tensors on the training device, in the compute dtype unless said otherwise."""
    embed: torch.Tensor             # [V, H] the input embedding table
    target_rows: torch.Tensor       # [K, H] the lm_head rows of the draft vocabulary: what the target logits use
    full_lm_head: torch.Tensor      # [V, H] the whole head (the embedding itself when tied)
    norm: RMSNorm                   # the final norm, fp32
    draft_to_target: torch.Tensor   # [K] the target id of each draft id
    t2d: torch.Tensor               # [V] whether a target id is in the draft vocabulary

    def embed_fn(self, ids):
        return F.embedding(ids, self.embed)


def load_target_head(args, inputs, device, dtype, feat_dtype) -> tuple[TargetHead, torch.Tensor]:
    """(the target's head on `device`, the fp32 lm_head rows of the draft vocabulary: the draft lm_head's start)."""
    H, t2d, tcfg = inputs.hidden, inputs.t2d, inputs.tcfg
    tw = load_target_tensors(args.model, tcfg, {"embed": args.embed_key, "norm": args.norm_key,
                                               "lm-head": args.lm_head_key})
    if tuple(tw["embed"].shape) != (tcfg["vocab_size"], H):
        raise BadInput(f"{args.model}: embedding shape {tuple(tw['embed'].shape)} != ({tcfg['vocab_size']}, {H})")
    embed = tw["embed"].to(device, feat_dtype)
    parity.refuse_first([parity.lm_head_problem(tw["lm-head"], inputs.d2t, t2d, f"{args.model}, {inputs.vocab_dir}")])
    target_lm_rows = tw["lm-head"][t2d].to(device, torch.float32)          # [K, H]: the draft lm_head's start
    target_rows = target_lm_rows.to(dtype)                                # what the target logits use
    # The full head finds the target's top token over its whole vocabulary; tied heads share the embedding.
    full_lm_head = embed if tw["lm-head"] is tw["embed"] else tw["lm-head"].to(device, feat_dtype)
    draft_to_target_dev = inputs.draft_to_target.to(device)
    t2d_dev = t2d.to(device)
    target_norm = RMSNorm(H, inputs.draft_cfg["rms_norm_eps"]).to(device)
    target_norm.weight.data.copy_(tw["norm"].float())
    target_norm.requires_grad_(False)
    del tw
    return TargetHead(embed, target_rows, full_lm_head, target_norm, draft_to_target_dev, t2d_dev), target_lm_rows


@torch.no_grad()
def full_vocab_argmax(last, target_norm, lm_head, chunk: int = 4096):
    """The target's greedy next token [B,T] over its full vocabulary, a few thousand positions at a time
    (a [B*T, V] logits tensor would not fit for Kimi's 163840-token vocabulary)."""
    flat = last.reshape(-1, last.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=last.device)
    for i in range(0, flat.shape[0], chunk):
        h = target_norm(flat[i:i + chunk].float()).to(lm_head.dtype)
        # max(-1).indices, not argmax: the same first-maximum index, 2.5x faster on CPU in bfloat16 (torch 2.13)
        out[i:i + chunk] = F.linear(h, lm_head).max(-1).indices
    return out.view(last.shape[:-1])


def document_tops(files, docs, pack_len, feat_dtype, target_norm, lm_head, chunk: int = 4096) -> dict:
    """The target's top token at every position of each document (after the EAGLE shift, cut to pack_len),
    found once: {document index: [n] ids}. Documents are stacked a few thousand positions at a time, so the
    head runs on full-sized matrices."""
    tops, pending, rows = {}, [], 0

    def flush():
        nonlocal pending, rows
        if pending:
            ids = full_vocab_argmax(torch.cat([last for _, last in pending]), target_norm, lm_head, chunk)
            for (d, last), part in zip(pending, ids.split([last.shape[0] for _, last in pending])):
                tops[d] = part.cpu()
        pending, rows = [], 0

    for d in docs:
        _, last, _, _ = packing.load_document(files[d], pack_len, feat_dtype)
        pending.append((d, last.to(lm_head.device)))
        rows += last.shape[0]
        if rows >= chunk:
            flush()
    flush()
    return tops
