#!/usr/bin/env python3
"""Train an EAGLE-3 draft head on extracted hidden states; export it in speculators' Eagle3 format.

Runs on the GPU host under the host's Python (see docs/CONTRACTS.md): one JSON document on stdout,
progress on stderr, exit 0 ok / 1 failed / 2 bad usage or input.

Inputs (all under --output-dir):
  hidden_states/hs_{i}.safetensors  token_ids [T] int, hidden_states [T, L, H], loss_mask [T]
  hidden_states/data_config.json    layer_ids (vLLM convention, last one == num_layers), hidden_size, ...
  vocab/d2t.npy, vocab/t2d.npy      d2t[i] = target_id - i (int64 [K]); t2d bool [target_vocab]
and --model: the target (only its embedding table, final norm and lm_head are read, by tensor name).
With --hidden-states online there is no hidden_states/: the target runs here, in an engine the step starts, and
its hidden states reach the loop through a bounded buffer in memory (data/online_stream.py).

Outputs:
  draft/checkpoints/step_XXXXXXXX.pt  model + optimizer + step + rng (atomic), resumable with --resume
  draft/export/config.json + model.safetensors   speculators Eagle3 format (what vLLM loads)
  draft/candidates/step_XXXXXXXX/ + candidates.json   with --choose-checkpoints N: N exports spread over the run and
                                    the held-out documents, for the choose step to serve (draft/candidates.py)

The draft model and its export format live in draft_model.py; this file is the data and the loop.

Under torchrun (pipeline/launch.py starts it so on a host with several GPUs) every rank takes its share of each
global batch (--batch-size counts all ranks) and the update equals one process's: DDP, or FSDP2 for a draft
whose training state does not fit one GPU (--parallel). Rank 0 writes full checkpoints, so --resume works on any
world size. SIGTERM (kimi-eagle stop) ends the current step, saves a checkpoint and exits 1.
"""
from __future__ import annotations

import contextlib
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

from kimi_eagle_host.draft import candidates  # (choose_checkpoints: the exports the choose step serves)
from kimi_eagle_host.draft import parity
from kimi_eagle_host.step_runtime import parse_step_args
from kimi_eagle_host.draft.draft_model import (Eagle3Draft, RMSNorm, draft_layer_config, export_speculators,
                                               load_target_config, load_target_tensors)
from kimi_eagle_host.data.hidden_state_files import check_sample_headers
from kimi_eagle_host.data import hs_manifest  # (the samples of one extraction, never a folder listing)
from kimi_eagle_host.data.prepared_data import check_vocab_built_from, manifest_digest
from kimi_eagle_host.step_runtime import (BadInput, atomic_write_json, atomic_write_via, log, model_identity,
                                          progress_line, settings_changed)
from kimi_eagle_host.training.tracker import open_tracker, tracking_dir, wanted
from kimi_eagle_host.data import online_stream  # (hidden_states online: the engine feeds the trainer)
from kimi_eagle_host.data import packing  # (packed rows, the step plan)
from kimi_eagle_host.data.step_batches import StepBatches, default_workers  # (rows read ahead onto the device)
from kimi_eagle_host.training import spec_trainer  # (--trainer speculators)
from kimi_eagle_host.training import ttt_loss  # (chunked KL, conditional acceptance)
from kimi_eagle_host.training import distributed as dist_  # (ranks, collectives, DDP/FSDP, checkpoint on SIGTERM)

CKPT_RE = re.compile(r"^step_(\d{8})\.pt$")
# Test-only: seconds to sleep after each optimizer step, so a test can stop a run mid-training.
STEP_DELAY_ENV = "KIMI_EAGLE_TEST_STEP_DELAY_S"


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


# ----------------------------------------------------------------------------------------------------
# Data

def split_holdout(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(training, held-out) document indices: a seeded random fraction of the documents is never trained on."""
    k = int(n * fraction)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + 1)).tolist()
    return sorted(perm[k:]), sorted(perm[:k])


def rows_per_step(args, pack_len: int, device, hidden: int, aux_dim: int) -> int:
    """Rows of pack_len tokens per optimizer step: from --tokens-per-step, else --batch-size rows, else sized
    from the GPU's memory (about a quarter of it for the step's activations), else 1 row."""
    if args.tokens_per_step:
        return max(1, args.tokens_per_step // pack_len)
    if args.batch_size:
        return args.batch_size
    if device.type == "cuda":
        free = torch.cuda.get_device_properties(device).total_memory
        # bytes per token: inputs (aux + target state) plus ~40 hidden-sized bf16 activations per TTT step.
        per_token = 2 * (aux_dim + hidden) + args.ttt_steps * 40 * hidden * 2
        tokens = min(65536, max(pack_len, int(0.25 * free / per_token)))
        return max(1, tokens // pack_len)
    return 1


def restore_rng(ck: dict, rank: int, world_size: int, cuda_devices: int, set_cpu, set_cuda) -> str:
    """Put back this rank's RNG state from a checkpoint where it applies; say what was done.

    A checkpoint keeps every rank's state ("rng": one entry per rank). It applies only on the same world size
    (rank r continues rank r's stream); on another world size no state is restored, which changes nothing the
    run depends on: feature noise is drawn from generators seeded by (seed, step, rank). Checkpoints of older
    versions kept rank 0's CPU state and *all* of its visible GPUs' states: only the entry of this rank's own
    GPU is used, if it exists (a 2-GPU checkpoint resumed on 1 GPU used to fail with an IndexError here)."""
    saved_world = int(ck.get("world_size", 1))
    per_rank = ck.get("rng")
    if per_rank is not None:
        if len(per_rank) != world_size or saved_world != world_size:
            return f"RNG state of {len(per_rank)} rank(s) not restored on {world_size}"
        mine = per_rank[rank]
        set_cpu(mine["cpu"])
        if mine.get("cuda") is not None and cuda_devices:
            set_cuda(mine["cuda"])
        return "RNG state restored"
    if ck.get("rng_cpu") is None or saved_world != world_size:
        return f"RNG state of {saved_world} rank(s) not restored on {world_size}"
    set_cpu(ck["rng_cpu"])
    old = ck.get("rng_cuda")
    if old is not None and cuda_devices and rank < len(old):
        set_cuda(old[rank])
    return "RNG state restored"


# ----------------------------------------------------------------------------------------------------
# Checkpoints and export

def nonfinite(loss_sum, params) -> str | None:
    """What is no longer finite on some rank: the losses summed since the last logging step, or a weight (this
    rank's shard of it); None when all is finite. One collective: every rank calls it at the same step."""
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in params]   # FSDP2: DTensor -> this rank's part
    weights_bad = bool(torch.stack([(~torch.isfinite(x.detach())).any() for x in shards]).any()) if shards else False
    loss_bad, weights_bad = dist_.all_sum([not math.isfinite(float(loss_sum)), weights_bad])
    if loss_bad:
        return "the loss is not finite"
    return "a weight is not finite" if weights_bad else None


def steps_span(first: int, last: int) -> str:
    """Where a figure summed over steps first..last (since the last logging step) comes from, in words."""
    return f"at step {last}" if first >= last else f"in steps {first}-{last}"


def finite_or_none(value):
    """`value` with every non-finite float, also inside lists and dicts, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


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
    mine = {"cpu": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() else None}  # this rank's GPU only
    rng = dist_.gather(mine)
    if dist_.world().main:
        state = {
            "step": step,
            "model": msd,
            "optimizer": osd,
            "rng": rng,
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

def lr_at(step: int, total: int, args) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine to 10%, linear to 0, or constant."""
    if args.warmup_steps and step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant" or total <= args.warmup_steps:
        return args.lr
    t = min((step - args.warmup_steps) / max(1, total - args.warmup_steps), 1.0)
    if args.lr_schedule == "linear":
        return args.lr * (1.0 - t)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(args) -> dict:
    """The step: what _train does, with whatever it opened (an online engine and its buffer) closed at the end."""
    online_stream.split_gpus(args)   # engine_gpus / train_gpus, before anything initialises CUDA
    with contextlib.ExitStack() as closing:
        return _train(args, closing)


def _train(args, closing: contextlib.ExitStack) -> dict:
    t_start = time.time()
    out = os.path.abspath(args.output_dir)
    hs_dir, vocab_dir = os.path.join(out, "hidden_states"), os.path.join(out, "vocab")
    ckpt_dir, export_dir = os.path.join(out, "draft", "checkpoints"), os.path.join(out, "draft", "export")
    for name in ("batch_size", "tokens_per_step", "pack_len", "ttt_steps", "log_every", "save_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')}: must be >= 1")
    wanted(args.report_to)  # a tracker asked for by name and missing: said before any work
    if args.ttt_steps > 7:
        raise BadInput(f"--ttt-steps {args.ttt_steps}: at most 7 (EAGLE-3's depth)")
    if not 0 <= args.holdout_fraction < 1:
        raise BadInput(f"--holdout-fraction {args.holdout_fraction}: must be in [0, 1)")

    # --- inputs ---------------------------------------------------------------------------------
    online = args.hidden_states == "online"
    dc_path = os.path.join(hs_dir, "data_config.json")
    if online:   # what extract would record, and the lengths, from the prepared data and the target's config
        dc, lengths = online_stream.inputs(args, out)
        dc_path, files = os.path.join(out, "prepared", "manifest.json"), None
    elif not os.path.isfile(dc_path):
        raise BadInput(f"{dc_path}: missing (run extract first)")
    else:
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
    # Exactly the samples of this extraction, and only if they come from the prepared data at hand (when the
    # folder has one: hidden states copied alone to a training host carry their own manifest).
    if not online:
        files = hs_manifest.read_samples(hs_dir, dc, manifest_digest(os.path.join(out, "prepared")))
        lengths = check_sample_headers(files, len(layer_ids), H)
    check_vocab_built_from(vocab_dir, dc.get("prepared_sha256"))
    n_tokens = sum(lengths)

    for name in ("d2t.npy", "t2d.npy"):
        if not os.path.isfile(os.path.join(vocab_dir, name)):
            raise BadInput(f"{os.path.join(vocab_dir, name)}: missing (run vocab first)")
    d2t = torch.from_numpy(np.load(os.path.join(vocab_dir, "d2t.npy")).astype(np.int64))
    t2d = torch.from_numpy(np.load(os.path.join(vocab_dir, "t2d.npy")).astype(bool))
    K = d2t.shape[0]

    tcfg, archs = load_target_config(args.model)
    if tcfg["hidden_size"] != H:
        raise BadInput(f"{dc_path}: hidden_size {H} != target hidden_size {tcfg['hidden_size']}")
    if tcfg["num_hidden_layers"] != N:
        raise BadInput(f"{dc_path}: num_layers {N} != target num_hidden_layers {tcfg['num_hidden_layers']}")
    if t2d.shape[0] != tcfg["vocab_size"]:
        raise BadInput(f"{vocab_dir}/t2d.npy: length {t2d.shape[0]} != target vocab_size {tcfg['vocab_size']}")
    c = draft_layer_config(tcfg, args)
    parity.check_before_training(tcfg, c, aux_ids, dc_path, d2t.numpy(), t2d.numpy(), vocab_dir)
    # t2d's true positions in order are the draft ids' targets (both are built sorted by target id);
    # if not, rows of the target lm_head would land on the wrong draft ids.
    draft_to_target = d2t + torch.arange(K)
    if not torch.equal(torch.nonzero(t2d).squeeze(1), draft_to_target):
        raise BadInput(f"{vocab_dir}/d2t.npy: draft ids must map to increasing target ids")

    if args.trainer == "speculators":   # same inputs, checked above; its own process group and loop
        if args.choose_checkpoints:
            raise BadInput("--choose-checkpoints: only with --trainer ours (speculators' trainer exports the last)")
        result = spec_trainer.train(args, out=out, files=files, aux_ids=aux_ids, d2t=d2t.numpy(), t2d=t2d.numpy(),
                                    hidden=H, lengths=lengths, log=log)
        parity.check_export(result["export_dir"], tcfg, aux_ids, vocab_dir)
        return result, 0

    # --- device / dtype / ranks ------------------------------------------------------------------
    w = dist_.world()
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
    flex = args.attention == "flex" or (args.attention == "auto" and device.type == "cuda")
    compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")

    train_docs, held_docs = split_holdout(len(lengths), args.holdout_fraction, args.seed)
    pack_len = args.pack_len or max(lengths[i] for i in train_docs)
    if args.pack_len is None and flex:
        pack_len = -(-pack_len // 128) * 128   # whole attention blocks
    aux_dim = (len(layer_ids) - 1) * H
    n_rows = rows_per_step(args, pack_len, device, H, aux_dim)
    if n_rows < w.size:
        raise BadInput(f"{n_rows} row(s) of {pack_len} tokens per step (--batch-size / --tokens-per-step count all "
                       f"ranks): need at least one per rank, world size {w.size}")
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
    parity.refuse_first([parity.lm_head_problem(tw["lm-head"], d2t, t2d, f"{args.model}, {vocab_dir}")])
    target_lm_rows = tw["lm-head"][t2d].to(device, torch.float32)          # [K, H]: the draft lm_head's start
    target_rows = target_lm_rows.to(dtype)                                # what the target logits use
    # The full head finds the target's top token over its whole vocabulary; tied heads share the embedding.
    full_lm_head = embed if tw["lm-head"] is tw["embed"] else tw["lm-head"].to(device, feat_dtype)
    draft_to_target_dev = draft_to_target.to(device)
    t2d_dev = t2d.to(device)
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
    if args.optimizer == "muon" and sharding == "fsdp":
        raise BadInput("--optimizer muon: not with --parallel fsdp (Muon orthogonalises whole matrices)")
    model = dist_.wrap(model, sharding, device)  # before the optimizer: FSDP replaces the parameters
    if compiled:
        dist_.unwrap(model).layers[0].compile(dynamic=False)
    opt = make_optimizer(model, args, device)
    del target_lm_rows

    plan = packing.Plan([[train_docs[i] for i in row]
                         for row in packing.pack_rows([lengths[i] for i in train_docs], pack_len, args.seed)],
                        n_rows, args.seed)
    total = max(1, math.ceil(args.epochs * plan.steps_per_epoch))
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    meta = {"total_steps": total, "batch_size": n_rows, "pack_len": pack_len, "ttt_steps": args.ttt_steps,
            "lr": args.lr, "seed": args.seed, "aux_ids": aux_ids, "draft_vocab": K, "n_samples": len(lengths),
            "holdout": len(held_docs), "optimizer": args.optimizer,
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
            said = restore_rng(ck, w.rank, w.size, torch.cuda.device_count() if device.type == "cuda" else 0,
                               torch.set_rng_state, lambda st: torch.cuda.set_rng_state(st, device))
            start = resumed_from = int(ck["step"])
            log(f"resumed from {path} at step {start}/{total} (saved by {ck.get('world_size', 1)} rank(s), "
                f"now {w.size}; {said})")
            del ck

    cand_steps = candidates.steps(total, args.choose_checkpoints)
    if cand_steps and start == 0 and w.main:
        candidates.reset(out)

    def plain_copy():
        """The draft as one plain module on rank 0 (FSDP: its shards gathered, so every rank must call this)."""
        plain = dist_.unwrap(model)
        if sharding == "fsdp":
            msd, _ = dist_.full_state(model, opt, sharding, trainable_names)
            plain = Eagle3Draft(c, len(aux_ids), K, bool(args.norm_before_residual))
            if w.main:
                plain.load_state_dict(msd)
        return plain

    def export_candidate(step):
        """This step's weights as an export the choose step will serve (every rank calls it)."""
        plain = plain_copy()
        if w.main:
            export_speculators(candidates.folder(out, step), plain, c, aux_ids, d2t, t2d, args, archs, embed, dtype)
            candidates.record(out, held_docs, dc.get("prepared_sha256"), total)
            log(f"candidate for choose: step {step} exported to {candidates.folder(out, step)}")
        dist_.barrier()

    def embed_fn(ids):
        return F.embedding(ids, embed)

    S = args.ttt_steps
    workers = args.loader_workers if args.loader_workers is not None else default_workers(device)

    # The target's top token over its full vocabulary, at every position: on a CPU the full head is ~40 % of a
    # step (SmolLM2: 576 x 49,152 per token, 3 TTT steps of a 5 M draft) and the data is small, so each
    # document's tops are found once before the first step when training sees the data more than once. On a
    # GPU the head is cheap next to reading every hidden-state file a second time, so it runs in each step.
    tops = None
    if device.type == "cpu" and total * n_rows > len(plan.rows) and not online:
        t0 = time.time()
        tops = document_tops(files, train_docs + held_docs, pack_len, feat_dtype, target_norm, full_lm_head)
        log(f"target's top tokens of {len(tops)} documents found once in {time.time() - t0:.1f}s")

    def measure(batch, noise_gen=None):
        """Forward (and the loss) of one batch already on the device: (loss, per-step losses, counts)."""
        with torch.no_grad():
            target_h = target_norm(batch["last"].float()).to(dtype)
            target_ids = (batch["target_ids"] if "target_ids" in batch
                          else full_vocab_argmax(batch["last"], target_norm, full_lm_head))
            in_vocab = t2d_dev[target_ids] if args.oov_positions == "mask" else None
            scored = ttt_loss.step_masks(batch["loss_mask"], batch["doc_ids"], S)
            in_loss = ttt_loss.loss_masks(scored, in_vocab)
            denoms = torch.stack([m.sum() for m in in_loss]).float()
            dist_.all_reduce_(denoms)   # the global batch's counts; a device collective, no host sync
        aux = batch["aux"]
        if noise_gen is not None:
            aux = aux + args.feature_noise * torch.randn(aux.shape, generator=noise_gen, device=device, dtype=aux.dtype)

        def loss_fn(normed, weight):
            return ttt_loss.ttt_loss(normed, weight, target_h, target_rows, in_loss, denoms, args.ttt_decay, dtype)

        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss, step_l, tops = model(aux, batch["ids"], embed_fn, S, batch["positions"], batch["doc_ids"], flex,
                                       loss_fn=loss_fn)
        with torch.no_grad():
            counts = ttt_loss.acceptance_counts(tops, draft_to_target_dev, target_ids, scored)
        return loss, step_l, counts

    held = None   # the held-out documents' plan: one pass of it is an evaluation
    if held_docs:
        held = packing.Plan([[held_docs[i] for i in row]
                             for row in packing.pack_rows([lengths[i] for i in held_docs], pack_len, args.seed)],
                            n_rows, args.seed)

    def evaluate() -> dict:
        """Loss, accuracy and conditional acceptance per position on the held-out documents (all ranks)."""
        model.eval()
        tot_l = torch.zeros(S, dtype=torch.float64, device=device)
        tot_c = torch.zeros(3 * S + 1, dtype=torch.float64, device=device)
        with torch.no_grad():
            with StepBatches(held, 0, held.steps_per_epoch, w.rank, w.size, files, pack_len, aux_dim, H,
                             feat_dtype, device, 0, tops) as batches:
                for batch in batches:
                    _, step_l, counts = measure(batch)
                    tot_l += step_l.double()
                    tot_c += counts
        model.train()
        sums = dist_.all_sum([*tot_l.tolist(), *tot_c.tolist()])
        n_batches = held.steps_per_epoch
        res = ttt_loss.summarize(sums[S:], [x / n_batches for x in sums[:S]], S)
        res["documents"] = len(held_docs)
        return res

    log(f"train: {len(lengths)} samples ({len(held_docs)} held out), {n_tokens} tokens, aux ids {aux_ids}, draft "
        f"vocab {K}, {n_trainable} trainable params, {total} steps of {n_rows} x {pack_len} tokens on {device} "
        f"({dtype}, {'flex' if flex else 'math'} attention{', compiled' if compiled else ''})"
        + (f", rank {w.rank}/{w.size} ({sharding})" if w.distributed else ""))
    stop = total if args.stop_at_step is None else min(total, args.stop_at_step)
    history, evals = [], []
    last_path = None
    interrupted = None
    t_log, tok_log = time.time(), 0
    t_loop, tok_loop, done = time.time(), 0, start
    step_delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
    stats_l = torch.zeros(S, dtype=torch.float64, device=device)
    stats_c = torch.zeros(3 * S + 1, dtype=torch.float64, device=device)
    stats_loss = torch.zeros((), dtype=torch.float64, device=device)
    n_since = 0
    diverged = None   # what the loss or the weights turned into, once they are no longer finite
    model.train()
    source = files
    if online:   # the engine starts now, on the stream of the steps this run trains; `files`: the held-out ones
        source = closing.enter_context(online_stream.start(args, dc, plan, held_docs, start, stop, lengths, device, w))
        files = source.held
    batches = StepBatches(plan, start, stop, w.rank, w.size, source, pack_len, aux_dim, H, feat_dtype, device,
                          workers, tops)
    tracker = open_tracker(args.report_to, tracking_dir(out, args.tracking_dir), config=vars(args), main=w.main)
    progress_line("train", start, total)  # the bar's start: its ETA counts from here
    with tracker, dist_.StopRequest() as stop_request, batches:
        for step in range(start, stop):
            lr = lr_at(step, total, args)
            for g in opt.param_groups:
                g["lr"] = lr
            batch = next(batches)   # its copy to the GPU was queued during the step before
            noise = None
            if args.feature_noise > 0:   # seeded by (seed, step, rank): the same after a resume, no RNG state
                noise = torch.Generator(device=device).manual_seed(
                    (args.seed * 1_000_003 + step) * 1024 + w.rank)
            loss, step_l, counts = measure(batch, noise)
            opt.zero_grad(set_to_none=True)
            # Each rank's loss is its share of the global batch's; DDP/FSDP average the gradients over the
            # ranks, so scaling by the world size makes the update exactly the global batch's.
            (loss * w.size).backward()
            if args.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(opt.params, args.grad_clip)
            opt.step()
            # Figures stay on the device until a logging step: no host sync per step.
            stats_loss += loss.detach().double()
            stats_l += step_l.double()
            stats_c += counts
            n_since += 1
            tok_log += batch["tokens"]
            tok_loop += batch["tokens"]
            done = step + 1
            if step_delay:
                time.sleep(step_delay)
            will_log = done == 1 or done % args.log_every == 0 or done == stop
            # Every rank takes the same decision, so none waits in a collective the others skipped; asked every
            # 8 steps (a collective is a host sync) and on logging steps.
            if (will_log or done % 8 == 0) and dist_.any_rank(stop_request.requested):
                interrupted = stop_request.received or "SIGTERM"
            if will_log or interrupted:
                dt = max(time.time() - t_log, 1e-9)
                sums = dist_.all_sum([float(stats_loss), *stats_l.tolist(), *stats_c.tolist(), tok_log])
                tok_g = sums[-1]
                fig = ttt_loss.summarize(sums[1 + S:-1], [x / n_since for x in sums[1:1 + S]], S)
                entry = {"step": done, "loss": sums[0] / n_since, **fig, "lr": lr, "tokens_per_s": round(tok_g / dt, 1),
                         "tokens": int(tok_g), "seconds": round(dt, 4)}   # the interval since the last log
                if w.main:
                    # online: the engine's tokens/s, the buffer's fill, and who waited for whom
                    flow = source.figures() if online else {}
                    acc_s = " ".join(f"acc[{k}]={a:.2f}" for k, a in enumerate(fig["acc"]))
                    log(f"step {done}/{total} loss {entry['loss']:.4f} {acc_s} accept_len {fig['accept_len']:.2f} "
                        f"lr {lr:.2e} tok/s {tok_g / dt:.0f}")
                    # The tracker (tensorboard, ...) and the progress bar of `kimi-eagle logs`: keep both calls.
                    tracker.log(done, {"train/loss": entry["loss"], "train/lr": lr, "train/tokens_per_s": tok_g / dt,
                                       "train/accept_len": fig["accept_len"],
                                       **{f"train/acc_{k}": a for k, a in enumerate(fig["acc"])},
                                       **{f"train/cond_acc_{k}": a for k, a in enumerate(fig["cond_acc"])},
                                       **{f"online/{k}": v for k, v in flow.items() if v is not None}})
                    progress_line("train", done, total, every_s=0, loss=entry["loss"], acc=fig["acc"][0],
                                  accept_len=fig["accept_len"], tok_s=tok_g / dt, **flow)
                history.append(entry)
                if not math.isfinite(entry["loss"]):
                    diverged = f"the loss is not finite ({entry['loss']}) {steps_span(done - n_since + 1, done)}"
                    history[-1] = finite_or_none(entry)   # the result stays strict JSON (no NaN)
                    break
                stats_l.zero_(), stats_c.zero_(), stats_loss.zero_()
                t_log, tok_log, n_since = time.time(), 0, 0
            if held is not None and args.eval_every and done % args.eval_every == 0 and done != stop:
                evals.append({"step": done, **evaluate()})
                if w.main:
                    log(f"held-out at step {done}: {json.dumps(evals[-1])}")
                    tracker.log(done, {"heldout/accept_len": evals[-1]["accept_len"],
                                       **{f"heldout/cond_acc_{k}": a for k, a in enumerate(evals[-1]["cond_acc"])}})
                t_log = time.time()
            if done % args.save_every == 0 or done == stop or interrupted:
                # A checkpoint is only written of finite weights reached by finite losses (one host sync per save).
                bad = nonfinite(stats_loss, opt.params)
                if bad:
                    diverged = f"{bad} {steps_span(done - n_since + 1, done)}"
                    break
                last_path = save_checkpoint(ckpt_dir, done, model, opt, meta, args.keep_checkpoints,
                                            sharding, trainable_names)
            if done in cand_steps:
                export_candidate(done)
            if interrupted:
                log(f"{interrupted}: stopped after step {done}/{total}; checkpoint {last_path}; "
                    f"continue with --resume")
                break
    loop_s = time.time() - t_loop
    tok_loop = int(dist_.all_sum([tok_loop])[0])

    finished = done == total and not interrupted and not diverged
    result = {"ok": not (interrupted or diverged), "finished": finished, "step": max(done, start), "total_steps": total,
              "resumed_from_step": resumed_from, "samples": len(lengths), "tokens": n_tokens,
              "aux_layer_ids": aux_ids, "draft_vocab_size": K, "device": str(device), "dtype": str(dtype),
              "world_size": w.size, "parallel": sharding, "rows_per_step": n_rows, "pack_len": pack_len,
              "attention": "flex" if flex else "math", "compiled": compiled, "optimizer": args.optimizer,
              "target_tops": "once" if tops is not None else "every step",
              "checkpoint": last_path or latest_checkpoint(ckpt_dir), "history": history,
              "train_tokens": tok_loop, "train_seconds": round(loop_s, 3),
              "train_tokens_per_s": round(tok_loop / loop_s, 1) if loop_s > 0 and tok_loop else None,
              "elapsed_s": round(time.time() - t_start, 2), "hidden_states": args.hidden_states}
    if online:
        result["online"] = {**source.figures(), "cached_documents": len(source.cached)}
    if interrupted:
        result["error"] = f"stopped by {interrupted} after step {done}; checkpoint saved, continue with --resume"
    if diverged:
        kept = last_path or latest_checkpoint(ckpt_dir)
        result["error"] = (f"{diverged}: stopped there, nothing exported and no checkpoint of it written (last "
                           f"checkpoint: {kept or 'none'}); start again with a lower --lr (now {args.lr:g}), "
                           f"--warmup-steps or --grad-clip")
        if w.main:
            log(f"train: {result['error']}")
    if device.type == "cuda":
        result["cuda_peak_mem_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 2)
    if history:
        result["final_loss"], result["final_acc"] = history[-1]["loss"], history[-1]["acc"]
        result["final_cond_acc"] = history[-1]["cond_acc"]
    if held is not None and done == stop and not diverged:
        evals.append({"step": done, **evaluate()})
        if w.main:
            log(f"held-out at step {done}: {json.dumps(evals[-1])}")
    if evals:
        result["heldout"] = evals[-1]
        result["heldout_history"] = evals
    if cand_steps:
        result["candidates"] = candidates.folder(out)
    if finished:
        plain = plain_copy()
        if w.main:
            cfg = export_speculators(export_dir, plain, c, aux_ids, d2t, t2d, args, archs, embed, dtype)
            atomic_write_json(os.path.join(export_dir, "training_info.json"),
                              {"data_config": dc, "meta": meta, "final": history[-1] if history else None,
                               "heldout": evals[-1] if evals else None,
                               # which job wrote this export: `pull JOB` takes it only for that job
                               "job_id": os.environ.get("KIMI_EAGLE_JOB_ID")})
            result["export_config"] = {k: cfg[k] for k in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size")}
            parity.check_export(export_dir, tcfg, aux_ids, vocab_dir)   # as vLLM will read it: else not a success
            log(f"exported {export_dir}")
        result["export_dir"] = export_dir
        dist_.barrier()
    return (result, 0) if result["ok"] else (result, 1)


class Optimizers:
    """One optimizer or two (Muon on weight matrices + AdamW on the rest) behind one interface: param_groups
    for the schedule, a single state dict for checkpoints."""

    def __init__(self, named: dict):
        self.named = named
        self.params = [p for o in named.values() for g in o.param_groups for p in g["params"]]

    @property
    def param_groups(self):
        return [g for o in self.named.values() for g in o.param_groups]

    def zero_grad(self, set_to_none=True):
        for o in self.named.values():
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.named.values():
            o.step()

    def state_dict(self):
        if list(self.named) == ["adamw"]:
            return self.named["adamw"].state_dict()   # the plain layout (FSDP's full_state reads it)
        return {name: o.state_dict() for name, o in self.named.items()}

    def load_state_dict(self, sd):
        if list(self.named) == ["adamw"]:
            return self.named["adamw"].load_state_dict(sd)
        for name, o in self.named.items():
            o.load_state_dict(sd[name])


def make_optimizer(model, args, device):
    """AdamW (fused on CUDA), or Muon on the 2-D weights (not the lm_head) with AdamW on the rest."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {}
    adam_kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, **fused)
    if args.optimizer == "adamw":
        return Optimizers({"adamw": torch.optim.AdamW([p for _, p in trainable], **adam_kw)})
    if not hasattr(torch.optim, "Muon"):
        raise BadInput(f"--optimizer muon: torch {torch.__version__} has no torch.optim.Muon (2.9 and later)")
    matrices = [p for n, p in trainable if p.ndim == 2 and "lm_head" not in n]
    rest = [p for n, p in trainable if not (p.ndim == 2 and "lm_head" not in n)]
    # match_rms_adamw scales Muon's update to AdamW's size, so one --lr serves both.
    named = {"muon": torch.optim.Muon(matrices, lr=args.lr, weight_decay=args.weight_decay,
                                      adjust_lr_fn="match_rms_adamw")}
    if rest:
        named["adamw"] = torch.optim.AdamW(rest, **adam_kw)
    return Optimizers(named)


def main(argv=None) -> int:
    args = parse_step_args("train", argv, __doc__)
    # Our loop compiles in processes of the job's group; speculators' trainer is stopped by the signal itself.
    spared = dist_.sparing_children() if args.trainer == "ours" else contextlib.nullcontext()
    with spared:
        return dist_.run_step_then_leave("train", train, args)


if __name__ == "__main__":
    sys.exit(main())
