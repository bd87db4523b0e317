"""train's resumable checkpoints: draft/checkpoints/step_XXXXXXXX.pt (model + optimizer + step + every rank's RNG
state + the settings that must match on --resume), written whole by rank 0 so that any world size resumes them."""
from __future__ import annotations

import os
import re

import torch

from kimi_eagle_host.step_runtime import BadInput, atomic_write_via, log, settings_changed
from kimi_eagle_host.training import distributed as dist_  # (ranks, collectives, DDP/FSDP state)

CKPT_RE = re.compile(r"^step_(\d{8})\.pt$")


def latest_checkpoint(ckpt_dir: str) -> str | None:
    if not os.path.isdir(ckpt_dir):
        return None
    names = sorted(n for n in os.listdir(ckpt_dir) if CKPT_RE.match(n))
    return os.path.join(ckpt_dir, names[-1]) if names else None


def clear_earlier(ckpt_dir: str, meta: dict) -> None:
    """A run from step 0 (no --resume) removes an earlier run's checkpoints, saying so: kept, they would outrank its
    own (keep_checkpoints keeps the highest steps) and a later --resume would continue them. Refused where the
    latest is this very run stopped before its end (the same settings): a forgotten --resume must not cost it."""
    names = sorted(n for n in os.listdir(ckpt_dir) if CKPT_RE.match(n)) if os.path.isdir(ckpt_dir) else []
    if not names:
        return
    latest = os.path.join(ckpt_dir, names[-1])
    ck = torch.load(latest, map_location="cpu", weights_only=False, mmap=True)  # the record, not the tensors
    step, total = int(ck["step"]), int(ck["meta"].get("total_steps", 0))
    if step < total and not settings_changed(ck["meta"], meta, meta):
        raise BadInput(f"{latest}: this run, with these settings, stopped at step {step} of {total}: continue it "
                       f"with --resume (steps.train.resume=true), or remove {ckpt_dir} to start it again from step 0")
    del ck
    for n in names:
        os.unlink(os.path.join(ckpt_dir, n))
    log(f"starting from step 0 (no --resume): removed {len(names)} checkpoint(s) of an earlier run from {ckpt_dir} "
        f"(the latest at step {step} of {total})")


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


def resume(ckpt_dir: str, meta: dict, model, opt, sharding: str, trainable_names, w, device,
           total: int, others_are_earlier: bool = False) -> int | None:
    """--resume: the latest checkpoint's weights, optimizer and RNG state put back; the step it was saved at (None
    when there is none: the run starts from scratch). Refused when it was made with other settings, unless
    `others_are_earlier` (a resume implied by a restarted job, which may have stopped before its train cleared
    an earlier run's checkpoints): then None, and the run from step 0 clears them (clear_earlier)."""
    path = latest_checkpoint(ckpt_dir)
    if path is None:
        log(f"--resume: no checkpoint under {ckpt_dir}; starting from scratch")
        return None
    ck = torch.load(path, map_location="cpu", weights_only=False)
    diff = {k: (ck["meta"].get(k), meta[k]) for k in settings_changed(ck["meta"], meta, meta)}
    if diff and others_are_earlier:
        log(f"--resume: {path} was made with other settings {diff}, by an earlier run; starting from scratch")
        return None
    if diff:
        raise BadInput(f"{path}: checkpoint was made with different settings {diff}")
    dist_.load_full_state(model, opt, sharding, trainable_names, ck["model"], ck["optimizer"])
    said = restore_rng(ck, w.rank, w.size, torch.cuda.device_count() if device.type == "cuda" else 0,
                       torch.set_rng_state, lambda st: torch.cuda.set_rng_state(st, device))
    start = int(ck["step"])
    log(f"resumed from {path} at step {start}/{total} (saved by {ck.get('world_size', 1)} rank(s), "
        f"now {w.size}; {said})")
    del ck
    return start
