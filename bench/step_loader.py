"""How fast training batches reach the device: the trainer's loader (pipeline/step_batches.py: threads writing
each document straight into a ring of page-locked buffers, copies on a side stream) against the usual way, torch's
DataLoader with worker processes and pin_memory (what train.py used before), on the same sample files and steps.

    python3 bench/step_loader.py [--docs 240 --hidden 2048 --aux 3 --tokens-per-step 13824 --workers 4 --steps 60]

Writes random hidden-state files of the 1 B benchmark's shape (hidden 2048, three aux layers and the last, bf16,
documents of 400-1300 tokens) under --dir (default a fresh folder in /dev/shm), packs them as the trainer does
and times `--steps` steps of each loader after a warm-up pass over the files (both read from the page cache),
the loader alone (no training step), as tokens/s. On a CUDA machine each batch goes to the GPU
(`--device cuda`), waited for each step, so a copy that stalls shows; on a CPU box the DataLoader runs without
pinning (none there) and the batch stays in host memory. One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's kimi_eagle_host
from kimi_eagle_host.data import packing  # noqa: E402
from kimi_eagle_host.data.step_batches import StepBatches  # noqa: E402


def write_docs(folder: Path, n: int, hidden: int, layers: int, seed: int) -> list[int]:
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(400, 1300, (n,), generator=g).tolist()
    for i, T in enumerate(lengths):
        save_file({"token_ids": torch.randint(0, 32000, (T,), generator=g),
                   "hidden_states": torch.randn(T, layers, hidden, generator=g).to(torch.bfloat16),
                   "loss_mask": torch.ones(T, dtype=torch.long)}, str(folder / f"hs_{i}.safetensors"))
    return [T - 1 for T in lengths]


class DataLoaderSteps(torch.utils.data.Dataset):
    """The natural alternative: each item is one step's rows built in a worker process from full-file loads."""

    def __init__(self, plan, files, pack_len, aux_dim, hidden, feat_dtype):
        self.plan, self.files, self.args = plan, files, (pack_len, aux_dim, hidden, feat_dtype)

    def __len__(self):
        return 10**9

    def __getitem__(self, step):
        from safetensors.torch import load_file

        pack_len, aux_dim, hidden, feat_dtype = self.args
        rows = self.plan.rank_rows(step, 0, 1)
        out = {"aux": torch.zeros(len(rows), pack_len, aux_dim, dtype=feat_dtype),
               "last": torch.zeros(len(rows), pack_len, hidden, dtype=feat_dtype),
               "ids": torch.zeros(len(rows), pack_len, dtype=torch.long)}
        tokens = 0
        for r, docs in enumerate(rows):
            at = 0
            for d in docs:
                s = load_file(self.files[d])
                hs = s["hidden_states"]
                n = min(hs.shape[0] - 1, pack_len - at)
                out["aux"][r, at:at + n] = hs[:n, :-1].reshape(n, -1)
                out["last"][r, at:at + n] = hs[1:n + 1, -1]
                out["ids"][r, at:at + n] = s["token_ids"][1:n + 1]
                at += n
            tokens += at
        out["tokens"] = tokens
        return out


def timed(batches, steps: int, device) -> float:
    n, t0 = 0, None
    for i, b in zip(range(steps + 3), batches):
        if device.type == "cuda":
            b = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in b.items()}
            torch.cuda.synchronize(device)
        if i == 2:   # the first batches include the workers' start
            n, t0 = 0, time.perf_counter()
        elif i > 2:
            n += b["tokens"]
    return n / (time.perf_counter() - t0)


def same_batches(plan, files, pack_len, aux_dim, hidden, dt, device, workers, steps: int) -> bool:
    """Whether the first steps' batches on `device` (threads, ring, side stream) equal the same rows built on
    the host in this thread: a fast loader that hands out wrong rows must not report a speed."""
    args = (files, pack_len, aux_dim, hidden, dt)
    with StepBatches(plan, 0, steps, 0, 1, *args, device, workers) as fast, \
            StepBatches(plan, 0, steps, 0, 1, *args, torch.device("cpu"), 0) as host:
        for got, want in zip(fast, host):
            if got["tokens"] != want["tokens"] or any(
                    not torch.equal(got[k].cpu(), want[k]) for k in want if torch.is_tensor(want[k])):
                return False
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--docs", type=int, default=240)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--aux", type=int, default=3)
    ap.add_argument("--tokens-per-step", type=int, default=13824)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dir", default=None, help="where the sample files go (default: a new folder in /dev/shm)")
    a = ap.parse_args()
    device = torch.device(a.device)
    folder = Path(a.dir or tempfile.mkdtemp(prefix="ke-loader-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None))
    folder.mkdir(parents=True, exist_ok=True)
    try:
        lengths = write_docs(folder, a.docs, a.hidden, a.aux + 1, seed=0)
        files = [str(folder / f"hs_{i}.safetensors") for i in range(a.docs)]
        pack_len = -(-max(lengths) // 128) * 128
        plan = packing.Plan(packing.pack_rows(lengths, pack_len, 0), max(1, a.tokens_per_step // pack_len), 0)
        aux_dim, dt = a.aux * a.hidden, torch.bfloat16
        cuda = device.type == "cuda"
        for f in files:          # both loaders read from the page cache
            Path(f).read_bytes()
        theirs_data = DataLoaderSteps(plan, files, pack_len, aux_dim, a.hidden, dt)
        ahead = {"prefetch_factor": 4} if a.workers else {}   # what train.py had
        theirs = timed(iter(torch.utils.data.DataLoader(
            theirs_data, batch_size=None, num_workers=a.workers, pin_memory=cuda, sampler=range(10**6), **ahead)),
            a.steps, device)
        with StepBatches(plan, 0, a.steps + 3, 0, 1, files, pack_len, aux_dim, a.hidden, dt, device,
                         a.workers) as batches:
            ours = timed(batches, a.steps, device)
        equal = same_batches(plan, files, pack_len, aux_dim, a.hidden, dt, device, a.workers, steps=6)
        print(json.dumps({"device": str(device), "workers": a.workers, "docs": a.docs, "pack_len": pack_len,
                          "batches_equal_host_built": equal,
                          "rows_per_step": plan.rows_per_step, "bytes_per_token": (aux_dim + a.hidden) * 2,
                          "step_batches_tokens_per_s": round(ours), "dataloader_tokens_per_s": round(theirs),
                          "ratio": round(ours / theirs, 2), "cpus": os.cpu_count()}))
    finally:
        if a.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
