"""Training data as fixed shapes: documents packed into rows of --pack-len tokens, a fixed number of rows per
optimizer step, read ahead by loader workers.

A step's rows are a pure function of (seed, epoch, step), so --resume needs no sampler state and reproduces an
uninterrupted run; rank r of N takes rows r, r+N, ... of every step (the global batch does not depend on N).
Every rank gets the same number of rows (padding rows when the step is short), so shapes never change and a
compiled step is compiled once.

One document = one hidden-states file after the EAGLE shift: position j pairs the aux features of token j with
input token j+1 and the target state of position j+1 (which predicts token j+2): the draft sees what the target
saw up to j plus the token the target just emitted, and must guess the next one (speculators' shift_batch).
In a row, positions restart at 1 for every document and doc_ids say which document a position belongs to
(-1: padding); attention never crosses documents.
"""
from __future__ import annotations

import bisect
import math

import torch


def pack_rows(lengths: list[int], pack_len: int, seed: int) -> list[list[int]]:
    """Best-fit decreasing: each document (longest first, ties in a seeded random order) goes into the open row
    with the least room that still fits it. Documents longer than pack_len are cut to it."""
    g = torch.Generator().manual_seed(seed)
    tiebreak = torch.randperm(len(lengths), generator=g).tolist()
    order = sorted(range(len(lengths)), key=lambda i: (-min(lengths[i], pack_len), tiebreak[i]))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []          # sorted (room left, row index)
    for i in order:
        n = min(lengths[i], pack_len)
        at = bisect.bisect_left(free, (n, -1))
        if at < len(free):
            room, r = free.pop(at)
        else:
            room, r = pack_len, len(rows)
            rows.append([])
        rows[r].append(i)
        if room - n > 0:
            bisect.insort(free, (room - n, r))
    return rows


class Plan:
    """Which rows make up each global step."""

    def __init__(self, rows: list[list[int]], rows_per_step: int, seed: int):
        self.rows, self.rows_per_step, self.seed = rows, rows_per_step, seed
        self.steps_per_epoch = max(1, math.ceil(len(rows) / rows_per_step))

    def step_rows(self, step: int) -> list[list[int]]:
        epoch, i = divmod(step, self.steps_per_epoch)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(self.rows), generator=g).tolist()
        return [self.rows[j] for j in perm[i * self.rows_per_step:(i + 1) * self.rows_per_step]]

    def rank_rows(self, step: int, rank: int, world: int) -> list[list[int]]:
        """This rank's rows of the step, padded with empty rows to the same count on every rank and step."""
        mine = self.step_rows(step)[rank::world]
        return mine + [[] for _ in range(math.ceil(self.rows_per_step / world) - len(mine))]


def load_document(path: str, limit: int, feat_dtype):
    """(aux [n, L_aux*H], last [n, H], ids [n], loss_mask [n]) of one file after the EAGLE shift, n <= limit."""
    from safetensors.torch import load_file

    s = load_file(path)
    hs = s["hidden_states"]
    n = min(s["token_ids"].shape[0] - 1, limit)
    L, H = hs.shape[1:]
    aux = hs[:n, :-1].reshape(n, (L - 1) * H).to(feat_dtype)
    last = hs[1:n + 1, -1].to(feat_dtype)
    return aux, last, s["token_ids"][1:n + 1].long(), s["loss_mask"][1:n + 1].bool()


def build_rows(files: list[str], rows: list[list[int]], pack_len: int, aux_dim: int, hidden: int, feat_dtype,
               tops=None) -> dict:
    """The packed tensors of `rows` (lists of document indices): aux [R,P,A], last [R,P,H], ids, loss_mask,
    doc_ids (-1 = padding) and positions [R,P]; plus tokens: the real positions, counted here on the host.
    tops (per document, the target's top token at each position after the shift, found once before
    training): packed as target_ids [R,P] too."""
    R = len(rows)
    out = {"aux": torch.zeros(R, pack_len, aux_dim, dtype=feat_dtype),
           "last": torch.zeros(R, pack_len, hidden, dtype=feat_dtype),
           "ids": torch.zeros(R, pack_len, dtype=torch.long),
           "loss_mask": torch.zeros(R, pack_len, dtype=torch.bool),
           "doc_ids": torch.full((R, pack_len), -1, dtype=torch.long),
           "positions": torch.ones(R, pack_len, dtype=torch.long)}
    if tops is not None:
        out["target_ids"] = torch.zeros(R, pack_len, dtype=torch.long)
    tokens = 0
    for r, docs in enumerate(rows):
        at = 0
        for d in docs:
            aux, last, ids, lm = load_document(files[d], pack_len - at, feat_dtype)
            n = ids.shape[0]
            sl = slice(at, at + n)
            out["aux"][r, sl], out["last"][r, sl], out["ids"][r, sl], out["loss_mask"][r, sl] = aux, last, ids, lm
            out["doc_ids"][r, sl] = d
            out["positions"][r, sl] = torch.arange(1, n + 1)
            if tops is not None:
                out["target_ids"][r, sl] = tops[d][:n]
            at += n
        tokens += at
    out["tokens"] = tokens
    return out


class StepData(torch.utils.data.Dataset):
    """Item i = this rank's packed rows of global step first + i (what a loader worker builds)."""

    def __init__(self, plan: Plan, first: int, last: int, rank: int, world: int, files, pack_len, aux_dim, hidden,
                 feat_dtype, tops=None):
        self.plan, self.first, self.n = plan, first, max(0, last - first)
        self.rank, self.world = rank, world
        self.files, self.pack_len, self.aux_dim, self.hidden, self.feat_dtype = files, pack_len, aux_dim, hidden, feat_dtype
        self.tops = tops

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rows = self.plan.rank_rows(self.first + i, self.rank, self.world)
        return build_rows(self.files, rows, self.pack_len, self.aux_dim, self.hidden, self.feat_dtype, self.tops)


def loader(data: StepData, workers: int, pin: bool):
    """Batches in step order; with workers, built ahead in other processes (pinned when copying to a GPU)."""
    kw = {"num_workers": workers, "pin_memory": pin, "batch_size": None, "shuffle": False}
    if workers:
        kw.update(prefetch_factor=4, persistent_workers=False)
    return torch.utils.data.DataLoader(data, **kw)


def to_device(batch: dict, device) -> dict:
    """Host -> device copies that do not wait (from pinned memory they overlap the running step)."""
    return {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
