"""The TTT loss and the figures that predict serving, computed a few thousand positions at a time.

Step k's draft output at index j guesses what the target says at index j+k (speculators' align_for_step). The
loss is the forward KL(target || draft) over the draft vocabulary; the draft and target logits of a chunk of
positions exist only while that chunk is processed (forward and again in backward), so no fp32
[tokens, vocab] tensor is ever held for the whole step.

Which positions count, per step k (masks are [B, T-k], index j):
  scored:   loss_mask[j+k], j and j+k in the same packed document (not padding);
  in loss:  scored, and the target's own top token at j+k lies inside the draft vocabulary (a draft cannot
            say a token it has no id for; EAGLE and SpecForge leave those positions out too);
  accepted: the draft's top token, mapped to a target id, equals the target's top token over its FULL
            vocabulary (a target choice outside the draft vocabulary is a miss, as in serving).
Conditional acceptance at step k counts a guess only if the guesses of steps 0..k-1 from the same index
were all accepted, which is how vLLM counts accepted tokens per position; 1 + their sum is the mean
acceptance length at k = ttt_steps speculative tokens (on data answered by the target).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Positions per chunk x draft vocabulary: ~32M fp32 logits (128 MB) at a time.
CHUNK_ELEMENTS = 1 << 25


def step_masks(loss_mask, doc_ids, ttt_steps: int) -> list:
    """The scored positions of each step ([B, T-k] bool)."""
    T = loss_mask.shape[1]
    out = []
    for k in range(ttt_steps):
        same = (doc_ids[:, k:] == doc_ids[:, :T - k]) & (doc_ids[:, :T - k] >= 0)
        out.append(loss_mask[:, k:] & same)
    return out


def loss_masks(scored: list, in_vocab) -> list:
    """The positions in the loss: scored, and the target's top token has a draft id (in_vocab None: all)."""
    if in_vocab is None:
        return scored
    T = in_vocab.shape[1]
    return [m & in_vocab[:, k:T] for k, m in enumerate(scored)]


class _ChunkedKL(torch.autograd.Function):
    """sum_j w_j * KL(softmax(t_j @ rows^T) || softmax(h_j @ W^T)), chunk by chunk; also the draft's argmax."""

    @staticmethod
    def forward(ctx, h, weight, target_h, rows, w, chunk: int, cdt):
        N = h.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=h.device)
        top = torch.empty(N, dtype=torch.long, device=h.device)
        W = weight.to(cdt)
        for i in range(0, N, chunk):
            lg = F.linear(h[i:i + chunk].to(cdt), W).float()
            tl = F.linear(target_h[i:i + chunk].to(cdt), rows).float()
            logp, logq = F.log_softmax(lg, -1), F.log_softmax(tl, -1)
            total = total + ((logq.exp() * (logq - logp)).sum(-1) * w[i:i + chunk]).sum()
            top[i:i + chunk] = lg.argmax(-1)
        ctx.save_for_backward(h, weight, target_h, rows, w)
        ctx.chunk, ctx.cdt = chunk, cdt
        ctx.mark_non_differentiable(top)
        return total, top

    @staticmethod
    def backward(ctx, grad_total, _grad_top):
        h, weight, target_h, rows, w = ctx.saved_tensors
        chunk, cdt = ctx.chunk, ctx.cdt
        W = weight.to(cdt)
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if ctx.needs_input_grad[1] else None
        for i in range(0, h.shape[0], chunk):
            hc = h[i:i + chunk].to(cdt)
            p = F.softmax(F.linear(hc, W).float(), -1)
            q = F.softmax(F.linear(target_h[i:i + chunk].to(cdt), rows).float(), -1)
            g = ((p - q) * (w[i:i + chunk] * grad_total)[:, None]).to(cdt)   # d KL / d draft logits
            if grad_h is not None:
                grad_h[i:i + chunk] = (g @ W).to(h.dtype)
            if grad_w is not None:
                grad_w += (g.t() @ hc).float()
        return grad_h, (grad_w.to(weight.dtype) if grad_w is not None else None), None, None, None, None, None


def chunk_rows(vocab: int) -> int:
    return max(128, CHUNK_ELEMENTS // max(1, vocab))


def ttt_loss(normed, weight, target_h, rows, in_loss, denoms, decay: float, compute_dtype):
    """Weighted sum over steps of the mean KL of step k (decay**k), plus per step: the loss (detached) and
    the draft's top draft id at each position of [B, T-k].

    normed: the draft's normed hidden state per step [B,T,H]; weight: its lm_head [K,H]; target_h: the target's
    normed final hidden state [B,T,H]; rows: the target lm_head rows of the draft vocabulary [K,H];
    in_loss: masks from loss_masks; denoms: positions in the loss per step over the whole global batch (a
    tensor, so data-parallel ranks' losses add up to the global batch's and no host sync is needed)."""
    chunk = chunk_rows(weight.shape[0])
    total = 0.0
    losses, tops = [], []
    for k, h in enumerate(normed):
        B, T, H = h.shape
        hk = h[:, :T - k].reshape(-1, H)
        tk = target_h[:, k:].reshape(-1, H)
        wk = in_loss[k].reshape(-1).float() / denoms[k].clamp_min(1)
        loss_k, top = _ChunkedKL.apply(hk, weight, tk, rows, wk, chunk, compute_dtype)
        total = total + (decay ** k) * loss_k
        losses.append(loss_k.detach())
        tops.append(top.view(B, T - k))
    return total, torch.stack(losses), tops


def scored_at_every_step(scored: list) -> torch.Tensor:
    """[B, T-S+1]: the indices whose guesses are scored at every one of the S steps (a whole chain can be judged)."""
    n = scored[-1].shape[1]
    every = scored[0][:, :n]
    for m in scored[1:]:
        every = every & m[:, :n]
    return every


def acceptance_counts(tops, draft_to_target, target_ids, scored) -> torch.Tensor:
    """Counts as one float tensor (summed over ranks before dividing, at logging time only):
    [hits_k, scored_k for each step] + [conditional hits_k for each step] + [positions scored at every step].
    Conditional acceptance is taken over the indices scored at every step, so all positions share one
    denominator, like vLLM's accepted-per-position over drafts."""
    S = len(tops)
    hits = [draft_to_target[top] == target_ids[:, k:] for k, top in enumerate(tops)]
    every = scored_at_every_step(scored)
    n = every.shape[1]
    chain = every
    plain, cond = [], []
    for k in range(S):
        plain += [(hits[k] & scored[k]).sum(), scored[k].sum()]
        chain = chain & hits[k][:, :n]
        cond.append(chain.sum())
    return torch.stack([*plain, *cond, every.sum()]).double()


def chain_lengths(tops, draft_to_target, target_ids, scored) -> tuple[torch.Tensor, torch.Tensor]:
    """(every, chain), both [B, T-S+1]: whether an index is scored at every step, and there the number of
    consecutive accepted guesses from step 0 (0..S; 0 where not scored at every step)."""
    every = scored_at_every_step(scored)
    n = every.shape[1]
    chain = torch.zeros_like(every, dtype=torch.long)
    alive = every
    for k, top in enumerate(tops):
        alive = alive & (draft_to_target[top[:, :n]] == target_ids[:, k:k + n])
        chain += alive
    return every, chain


def round_counts(tops, draft_to_target, target_ids, scored, ks=None) -> torch.Tensor:
    """[rounds, accepted at step 0, ..., at step S-1] of greedy speculative decoding replayed over the text, for each k
    of `ks` (tokens served a round, each <= S; default (S,)), concatenated. A round at index j accepts the chain of
    consecutive hits from j (at most k) and the next round starts after it and the target's own token, at
    j + chain + 1, as served rounds do; a span's first round starts at its first index scored at every step (of S: a
    draft trained with more steps than it is served with is compared with another at the same k, on the same
    starts). acceptance_counts averages every index instead, and rounds skip the accepted, easy stretches: on the
    same text the served figure is this one (bench/served_vs_forced.py: 57 % at position 1 where every index gave
    66 %). For held-out evaluation (one host sync, then a loop over rounds per row), not every training step."""
    import numpy as np

    S = len(tops)
    ks = (S,) if ks is None else tuple(ks)
    every, chain = (x.cpu().numpy() for x in chain_lengths(tops, draft_to_target, target_ids, scored))
    out = np.zeros((len(ks), S + 1))
    for row, k in enumerate(ks):
        for ok, c in zip(every, np.minimum(chain, k)):
            starts = np.flatnonzero(ok)
            i = 0
            while i < len(starts):
                j = starts[i]
                out[row, 0] += 1
                out[row, 1:1 + c[j]] += 1
                i = np.searchsorted(starts, j + c[j] + 1)   # the next round, or the next span's first index
    return torch.tensor(out.ravel(), dtype=torch.float64, device=target_ids.device)


def summarize_rounds(counts, S: int) -> dict:
    """Per-position acceptance and acceptance length over replayed rounds (round_counts, summed)."""
    rounds = max(float(counts[0]), 1.0)
    pos = [round(float(c) / rounds, 4) for c in counts[1:S + 1]]
    return {"rounds": int(counts[0]), "cond_acc": pos, "accept_len": round(1.0 + sum(pos), 4)}


def summarize(counts, step_losses, S: int) -> dict:
    """Per-step accuracy, conditional acceptance and acceptance length from acceptance_counts (summed)."""
    counts = [float(c) for c in counts]
    acc = [counts[2 * k] / max(counts[2 * k + 1], 1.0) for k in range(S)]
    denom = max(counts[-1], 1.0)
    cond = [counts[2 * S + k] / denom for k in range(S)]
    return {"step_losses": [float(x) for x in step_losses], "acc": [round(a, 4) for a in acc],
            "cond_acc": [round(c, 4) for c in cond], "accept_len": round(1.0 + sum(cond), 4)}
