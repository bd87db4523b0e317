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

The draft model and its export format live in draft_model.py; this file is the data and the loop.

Under torchrun (pipeline/launch.py starts it so on a host with several GPUs) every rank takes its share of each
global batch (--batch-size counts all ranks) and the update equals one process's: DDP, or FSDP2 for a draft
whose training state does not fit one GPU (--parallel). Rank 0 writes full checkpoints, so --resume works on any
world size. SIGTERM (kimi-eagle stop) ends the current step, saves a checkpoint and exits 1.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the payload root: step_runtime
from draft_model import (Eagle3Draft, RMSNorm, draft_layer_config, export_speculators, load_target_config,  # noqa: E402
                         load_target_tensors)
from hidden_state_files import check_sample_headers, list_samples  # noqa: E402
from step_runtime import (BadInput, atomic_write_json, atomic_write_via, log, model_identity, progress_line,  # noqa: E402
                          run_step, settings_changed)
from tracker import open_tracker, tracking_dir, wanted  # noqa: E402
import distributed as dist_  # noqa: E402  (ranks, collectives, DDP/FSDP, checkpoint on SIGTERM)

CKPT_RE = re.compile(r"^step_(\d{8})\.pt$")
# Test-only: seconds to sleep after each optimizer step, so a test can stop a run mid-training.
STEP_DELAY_ENV = "KIMI_EAGLE_TEST_STEP_DELAY_S"


def mask_counts(loss_mask, ttt_steps: int) -> list[float]:
    """Loss-masked positions per TTT step (step k scores loss_mask[:, k:])."""
    return [float(loss_mask[:, k:].sum()) for k in range(ttt_steps)]


def step_losses(logits_per_step, target_logits, loss_mask, decay: float, denoms=None, target_ids=None,
                draft_to_target=None):
    """Forward KL(target || draft) per TTT step over loss-masked positions, weighted decay**k.

    `denoms`: per-step position counts to divide by (default: this batch's). Data-parallel ranks pass the
    counts of the whole global batch, so their losses add up to the global batch's loss, exactly.

    Step-k logits at index j predict what the target predicts at index j+k, so compare
    logits[:, :T-k] with targets[:, k:] and mask with loss_mask[:, k:] (speculators' align_for_step).
    Top-1 agreement is what serving accepts: the draft's argmax mapped to a target id (draft id + d2t)
    equals the target's argmax over its *full* vocabulary (`target_ids` [B,T]); a target choice outside
    the draft vocabulary counts as a miss. Without target_ids it is None (not computed this step).
    Returns (total loss, per-step losses, per-step top-1 agreement or None, tokens counted at step 0).
    """
    total = 0.0
    losses, accs = [], []
    T = target_logits.shape[1]
    n0 = 0
    for k, logits in enumerate(logits_per_step):
        lg, tg, m = logits[:, : T - k], target_logits[:, k:], loss_mask[:, k:]
        n = m.sum() if denoms is None else torch.tensor(denoms[k], device=m.device)
        if k == 0:
            n0 = int(m.sum())
        logp = F.log_softmax(lg.float(), dim=-1)
        tp = F.softmax(tg.float(), dim=-1)
        kl = (tp * (torch.log(tp.clamp_min(1e-30)) - logp)).sum(-1)
        loss_k = (kl * m).sum() / n.clamp_min(1)
        total = total + (decay ** k) * loss_k
        losses.append(float(loss_k.detach()))
        if target_ids is not None:
            hit = draft_to_target[lg.argmax(-1)] == target_ids[:, k:]
            accs.append(float((hit & m).sum() / n.clamp_min(1)))
    return total, losses, (accs if target_ids is not None else None), n0


@torch.no_grad()
def full_vocab_argmax(last, target_norm, lm_head, chunk: int = 4096):
    """The target's greedy next token [B,T] over its full vocabulary, a few thousand positions at a time
    (a [B*T, V] logits tensor would not fit for Kimi's 163840-token vocabulary)."""
    flat = last.reshape(-1, last.shape[-1])
    out = torch.empty(flat.shape[0], dtype=torch.long, device=last.device)
    for i in range(0, flat.shape[0], chunk):
        h = target_norm(flat[i:i + chunk].float()).to(lm_head.dtype)
        out[i:i + chunk] = F.linear(h, lm_head).argmax(-1)
    return out.view(last.shape[:-1])


# ----------------------------------------------------------------------------------------------------
# Data

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


def save_checkpoint(ckpt_dir, step, model, opt, meta, keep: int, sharding: str = "none",
                    trainable_names=None) -> str:
    """Rank 0 writes the whole (unsharded) state, so any world size can resume it; under FSDP every rank
    must call this (the shards are gathered), and all ranks return once the file is in place."""
    path = os.path.join(ckpt_dir, f"step_{step:08d}.pt")
    msd, osd = dist_.full_state(model, opt, sharding, trainable_names or [])
    if dist_.world().main:
        state = {
            "step": step,
            "model": msd,
            "optimizer": osd,
            "rng_cpu": torch.get_rng_state(),
            "rng_cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            "meta": meta,
            "world_size": dist_.world().size,  # informative only: any world size may resume it
        }
        atomic_write_via(path, lambda tmp: torch.save(state, tmp))
        old = sorted(n for n in os.listdir(ckpt_dir) if CKPT_RE.match(n))
        for n in old[:-keep] if keep > 0 else []:
            os.unlink(os.path.join(ckpt_dir, n))
    dist_.barrier()
    return path


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
    p.add_argument("--batch-size", type=int, default=1,
                   help="samples per optimizer step over all ranks (each of N ranks takes 1/N of them)")
    p.add_argument("--ttt-steps", type=int, default=3, help="training-time-test unroll depth (default 3)")
    p.add_argument("--ttt-decay", type=float, default=0.8, help="loss weight of TTT step k is decay**k")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="compute dtype (autocast); master weights stay fp32. auto: bf16 on CUDA, fp32 on CPU; "
                        "also the export dtype")
    p.add_argument("--resume", action="store_true",
                   help="continue from the latest checkpoint (saved by any number of ranks)")
    p.add_argument("--parallel", choices=["auto", "ddp", "fsdp"], default="auto",
                   help="under torchrun: ddp (a replica per rank) or fsdp (weights, gradients and optimizer "
                        "state sharded); auto = fsdp when they would take > 60%% of one GPU")
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
    p.add_argument("--report-to", default="auto", help="metrics to tensorboard, wandb, trackio, mlflow (comma list), "
                   "none, or auto: tensorboard when installed (default)")
    p.add_argument("--tracking-dir", default=None, help="tensorboard's folder (default <output-dir>/tracking)")
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
            raise BadInput(f"--{name.replace('_', '-')}: must be >= 1")
    wanted(args.report_to)  # a tracker asked for by name and missing: said before any work

    # --- inputs ---------------------------------------------------------------------------------
    dc_path = os.path.join(hs_dir, "data_config.json")
    if not os.path.isfile(dc_path):
        raise BadInput(f"{dc_path}: missing (run extract first)")
    with open(dc_path) as f:
        dc = json.load(f)
    for field in ("layer_ids", "num_layers", "hidden_size"):
        if field not in dc:
            raise BadInput(f"{dc_path}: missing field '{field}'")
    conv = str(dc.get("layer_convention", "vllm"))
    if not conv.startswith("vllm"):
        # Features captured in another convention (e.g. "output of layer i") are shifted by one layer
        # from what vLLM feeds the draft at serving time; training on them would silently hurt acceptance.
        raise BadInput(f"{dc_path}: layer_convention {conv!r}: expected the vLLM convention")
    layer_ids, N, H = [int(i) for i in dc["layer_ids"]], int(dc["num_layers"]), int(dc["hidden_size"])
    if len(layer_ids) < 2 or layer_ids[-1] != N:
        raise BadInput(f"{dc_path}: layer_ids {layer_ids}: the last id must be num_layers={N} (the final "
                         f"hidden state that yields the training targets) after at least one aux layer")
    if layer_ids != sorted(set(layer_ids)):
        # vLLM concatenates the aux states in layer order at serving time; features stacked in another order
        # would reach the trained fc shuffled. (extract sorts them since; older extractions kept the given order.)
        raise BadInput(f"{dc_path}: layer_ids {layer_ids} are not in increasing order: vLLM feeds the draft its "
                       f"aux layers in layer order; re-extract (extract sorts them)")
    aux_ids = layer_ids[:-1]
    files = list_samples(hs_dir)
    if not files:
        raise BadInput(f"{hs_dir}: no hs_*.safetensors samples")
    n_tokens = check_sample_headers(files, len(layer_ids), H)

    for name in ("d2t.npy", "t2d.npy"):
        if not os.path.isfile(os.path.join(vocab_dir, name)):
            raise BadInput(f"{os.path.join(vocab_dir, name)}: missing (run vocab first)")
    d2t = torch.from_numpy(np.load(os.path.join(vocab_dir, "d2t.npy")).astype(np.int64))
    t2d = torch.from_numpy(np.load(os.path.join(vocab_dir, "t2d.npy")).astype(bool))
    K = d2t.shape[0]
    draft_to_target = d2t + torch.arange(K)
    if int(t2d.sum()) != K or not bool(t2d[draft_to_target].all()):
        raise BadInput(f"{vocab_dir}: d2t.npy/t2d.npy disagree (t2d has {int(t2d.sum())} true, d2t {K} ids)")
    # t2d's true positions in order are the draft ids' targets (both are built sorted by target id);
    # if not, rows of the target lm_head would land on the wrong draft ids.
    if not torch.equal(torch.nonzero(t2d).squeeze(1), draft_to_target):
        raise BadInput(f"{vocab_dir}/d2t.npy: draft ids must map to increasing target ids")

    tcfg, archs = load_target_config(args.model)
    if tcfg["hidden_size"] != H:
        raise BadInput(f"{dc_path}: hidden_size {H} != target hidden_size {tcfg['hidden_size']}")
    if tcfg["num_hidden_layers"] != N:
        raise BadInput(f"{dc_path}: num_layers {N} != target num_hidden_layers {tcfg['num_hidden_layers']}")
    if t2d.shape[0] != tcfg["vocab_size"]:
        raise BadInput(f"{vocab_dir}/t2d.npy: length {t2d.shape[0]} != target vocab_size {tcfg['vocab_size']}")
    c = draft_layer_config(tcfg, args)

    # --- device / dtype / ranks ------------------------------------------------------------------
    w = dist_.world()
    if args.batch_size < w.size:
        raise BadInput(f"--batch-size {args.batch_size} is the global batch (samples per optimizer step over "
                       f"all ranks): it must be at least the world size {w.size}")
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BadInput("--device cuda: no CUDA device visible")
    if device.type == "cuda" and w.distributed:
        if w.local_rank >= torch.cuda.device_count():
            raise BadInput(f"local rank {w.local_rank} has no GPU: {torch.cuda.device_count()} visible")
        device = torch.device("cuda", w.local_rank)
    # gloo for CPU tensors, nccl for CUDA ones; the timeout covers rank 0 writing a big checkpoint while
    # the others wait at the barrier.
    dist_.init(w, "nccl" if device.type == "cuda" else "gloo", timeout_s=3600)
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32,
             "float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    # Frozen target tensors and the feature stream are kept in the compute dtype (halves memory for
    # Kimi's 163840x7168 embedding); trainable weights stay fp32 and autocast does the mixing.
    feat_dtype = dtype

    tw = load_target_tensors(args.model, tcfg, {"embed": args.embed_key, "norm": args.norm_key,
                                               "lm-head": args.lm_head_key})
    if tuple(tw["embed"].shape) != (tcfg["vocab_size"], H):
        raise BadInput(f"{args.model}: embedding shape {tuple(tw['embed'].shape)} != ({tcfg['vocab_size']}, {H})")
    embed = tw["embed"].to(device, feat_dtype)
    target_lm_rows = tw["lm-head"][t2d].to(device, torch.float32)          # [K, H]
    # The full head only scores the logged top-1 agreement (full-vocab argmax); tied heads share the embedding.
    full_lm_head = embed if tw["lm-head"] is tw["embed"] else tw["lm-head"].to(device, feat_dtype)
    draft_to_target_dev = draft_to_target.to(device)
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
    trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    # fp32 weight + gradient + two AdamW moments per trainable parameter, frozen fp32 weights, target tensors.
    state_bytes = 16 * n_trainable + 4 * n_frozen + embed.numel() * embed.element_size() + 4 * target_lm_rows.numel()
    sharding = dist_.choose_sharding(args.parallel, w, state_bytes, device)
    model = dist_.wrap(model, sharding, device)  # before the optimizer: FSDP replaces the parameters
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)

    steps_per_epoch = math.ceil(len(files) / args.batch_size)
    total = max(1, math.ceil(args.epochs * steps_per_epoch))
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    meta = {"total_steps": total, "batch_size": args.batch_size, "ttt_steps": args.ttt_steps, "lr": args.lr,
            "seed": args.seed, "aux_ids": aux_ids, "draft_vocab": K, "n_samples": len(files),
            # the target: resuming a checkpoint against another model's features/head must refuse
            "model": model_identity(args.model)}

    start = 0
    resumed_from = None
    if args.resume:
        path = latest_checkpoint(ckpt_dir)
        if path is None:
            log(f"--resume: no checkpoint under {ckpt_dir}; starting from scratch")
        else:
            ck = torch.load(path, map_location="cpu", weights_only=False)
            diff = {k: (ck["meta"].get(k), meta[k]) for k in settings_changed(ck["meta"], meta, meta)}
            if diff:
                raise BadInput(f"{path}: checkpoint was made with different settings {diff}")
            dist_.load_full_state(model, opt, sharding, trainable_names, ck["model"], ck["optimizer"])
            torch.set_rng_state(ck["rng_cpu"])
            if ck.get("rng_cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(ck["rng_cuda"])
            start = resumed_from = int(ck["step"])
            log(f"resumed from {path} at step {start}/{total} (saved by {ck.get('world_size', 1)} rank(s), "
                f"now {w.size})")

    def embed_fn(ids):
        return F.embedding(ids, embed)

    log(f"train: {len(files)} samples, {n_tokens} tokens, aux ids {aux_ids}, draft vocab {K}, "
        f"{n_trainable} trainable params, {total} steps on {device} ({dtype})"
        + (f", rank {w.rank}/{w.size} ({sharding})" if w.distributed else ""))
    stop = total if args.stop_at_step is None else min(total, args.stop_at_step)
    history = []
    last_path = None
    interrupted = None
    t_log, tok_log = time.time(), 0
    t_loop, tok_loop, done = time.time(), 0, start
    step_delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
    model.train()
    tracker = open_tracker(args.report_to, tracking_dir(out, args.tracking_dir), config=vars(args), main=w.main)
    with tracker, dist_.StopRequest() as stop_request:
        for step in range(start, stop):
            lr = lr_at(step, total, args)
            for g in opt.param_groups:
                g["lr"] = lr
            # The global batch of a step is the same whatever the world size; rank r takes every size-th
            # sample of it. A rank left without one (a short last batch) runs a sample with an empty loss
            # mask, so that every rank still joins the gradient all-reduce.
            batch = batch_files(files, step, args.batch_size, args.seed)
            mine = dist_.stripe(batch, w.rank, w.size)
            aux, last, ids, lmask, valid = load_batch(mine or batch[:1], device, feat_dtype)
            if not mine:
                lmask = torch.zeros_like(lmask)
            denoms = dist_.all_sum(mask_counts(lmask, args.ttt_steps)) if w.distributed else None
            will_log = step + 1 == 1 or (step + 1) % args.log_every == 0 or step + 1 == stop
            target_ids = full_vocab_argmax(last, target_norm, full_lm_head) if will_log else None
            with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                with torch.no_grad():
                    # The target's next-token distribution, restricted to the draft vocabulary.
                    target_logits = F.linear(target_norm(last.float()), target_lm_rows).float()
                logits = model(aux, ids, valid, embed_fn, args.ttt_steps)
                loss, losses, accs, n_tok = step_losses(logits, target_logits, lmask, args.ttt_decay, denoms,
                                                        target_ids, draft_to_target_dev)
            opt.zero_grad(set_to_none=True)
            # Each rank's loss is its share of the global batch's; DDP/FSDP average the gradients over the
            # ranks, so scaling by the world size makes the update exactly the global batch's.
            (loss * w.size).backward()
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
            opt.step()
            n_valid = int(valid.sum()) if mine else 0
            tok_log += n_valid
            tok_loop += n_valid
            done = step + 1
            if step_delay:
                time.sleep(step_delay)
            # Every rank takes the same decision, so none waits in a collective the others skipped.
            if dist_.any_rank(stop_request.requested):
                interrupted = stop_request.received or "SIGTERM"
            if will_log or interrupted:
                dt = max(time.time() - t_log, 1e-9)
                accs = accs or []  # an interrupted step off the logging grid has no agreement figures
                tot = dist_.all_sum([loss.item(), *losses, *accs, tok_log])
                loss_v, losses, accs, tok_g = tot[0], tot[1:1 + len(losses)], tot[1 + len(losses):-1], tot[-1]
                acc_s = " ".join(f"acc[{k}]={a:.2f}" for k, a in enumerate(accs))
                if w.main:
                    log(f"step {done}/{total} loss {loss_v:.4f} {acc_s} lr {lr:.2e} tok/s {tok_g / dt:.0f}")
                    # The tracker (tensorboard, ...) and the progress bar of `kimi-eagle logs`: keep both calls.
                    tracker.log(done, {"train/loss": loss_v, "train/lr": lr, "train/tokens_per_s": tok_g / dt,
                                       **{f"train/acc_{k}": a for k, a in enumerate(accs)}})
                    progress_line("train", done, total, loss=loss_v, acc=accs[0] if accs else None, tok_s=tok_g / dt)
                history.append({"step": done, "loss": loss_v, "step_losses": losses, "acc": accs,
                                "tokens_per_s": round(tok_g / dt, 1)})
                t_log, tok_log = time.time(), 0
            if done % args.save_every == 0 or done == stop or interrupted:
                last_path = save_checkpoint(ckpt_dir, done, model, opt, meta, args.keep_checkpoints,
                                            sharding, trainable_names)
            if interrupted:
                log(f"{interrupted}: stopped after step {done}/{total}; checkpoint {last_path}; "
                    f"continue with --resume")
                break
    loop_s = time.time() - t_loop
    tok_loop = int(dist_.all_sum([tok_loop])[0])

    finished = done == total and not interrupted
    result = {"ok": not interrupted, "finished": finished, "step": max(done, start), "total_steps": total,
              "resumed_from_step": resumed_from, "samples": len(files), "tokens": n_tokens,
              "aux_layer_ids": aux_ids, "draft_vocab_size": K, "device": str(device), "dtype": str(dtype),
              "world_size": w.size, "parallel": sharding,
              "checkpoint": last_path or latest_checkpoint(ckpt_dir), "history": history,
              "train_tokens": tok_loop, "train_seconds": round(loop_s, 3),
              "train_tokens_per_s": round(tok_loop / loop_s, 1) if loop_s > 0 and tok_loop else None,
              "elapsed_s": round(time.time() - t_start, 2)}
    if interrupted:
        result["error"] = f"stopped by {interrupted} after step {done}; checkpoint saved, continue with --resume"
    if device.type == "cuda":
        result["cuda_peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if history:
        result["final_loss"], result["final_acc"] = history[-1]["loss"], history[-1]["acc"]
    if finished:
        plain = dist_.unwrap(model)
        if sharding == "fsdp":  # gather the shards into a plain copy for the export (every rank takes part)
            msd, _ = dist_.full_state(model, opt, sharding, trainable_names)
            plain = Eagle3Draft(c, len(aux_ids), K, bool(args.norm_before_residual))
            if w.main:
                plain.load_state_dict(msd)
        if w.main:
            cfg = export_speculators(export_dir, plain, c, aux_ids, d2t, t2d, args, archs, embed, dtype)
            atomic_write_json(os.path.join(export_dir, "training_info.json"),
                              {"data_config": dc, "meta": meta, "final": history[-1] if history else None})
            result["export_config"] = {k: cfg[k] for k in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size")}
            log(f"exported {export_dir}")
        result["export_dir"] = export_dir
        dist_.barrier()
    return (result, 0) if result["ok"] else (result, 1)


def main(argv=None) -> int:
    try:
        return run_step("train", train, build_parser().parse_args(argv))
    finally:
        dist_.shutdown()


if __name__ == "__main__":
    sys.exit(main())
