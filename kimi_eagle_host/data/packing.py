"""Training data as fixed shapes: documents packed into rows of --pack-len tokens, a fixed number of rows per
optimizer step (step_batches.py reads them ahead and onto the device).

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
import json
import math
import mmap
import os
import struct

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
        self._order = None   # (epoch, its row order)

    def epoch_order(self, epoch: int) -> list[int]:
        """The rows of one epoch in the order its steps take them (the last epoch's order is kept: a step asks
        for it again)."""
        kept = self._order
        if kept is None or kept[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            kept = self._order = (epoch, torch.randperm(len(self.rows), generator=g).tolist())
        return kept[1]

    def step_rows(self, step: int) -> list[list[int]]:
        epoch, i = divmod(step, self.steps_per_epoch)
        perm = self.epoch_order(epoch)
        return [self.rows[j] for j in perm[i * self.rows_per_step:(i + 1) * self.rows_per_step]]

    def rank_rows(self, step: int, rank: int, world: int) -> list[list[int]]:
        """This rank's rows of the step, padded with empty rows to the same count on every rank and step."""
        mine = self.step_rows(step)[rank::world]
        return mine + [[] for _ in range(math.ceil(self.rows_per_step / world) - len(mine))]


# safetensors' dtype names -> torch (the ones a hidden-state file holds)
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def map_sample(path: str) -> dict:
    """The tensors of one safetensors file as views of its pages (a private mapping: nothing is read until a view
    is copied from, and then only the rows copied), so a document reaches its packed row in one copy."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes)")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)   # copy-on-write: torch.frombuffer wants it writable
    (n,) = struct.unpack("<Q", mm[:8])
    if 8 + n > size:
        raise ValueError(f"{path}: truncated ({size} bytes, its header says {8 + n})")
    try:
        header = json.loads(mm[8:8 + n])
    except ValueError as e:
        raise ValueError(f"{path}: unreadable safetensors header ({e})") from None
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        dtype = _DTYPES.get(meta.get("dtype"))
        if dtype is None:
            raise ValueError(f"{path}: tensor '{name}' has dtype {meta.get('dtype')}, not one a sample file holds")
        lo, hi = (8 + n + o for o in meta["data_offsets"])
        if hi > size:
            raise ValueError(f"{path}: truncated ({size} bytes, tensor '{name}' ends at {hi})")
        count = (hi - lo) // dtype.itemsize
        flat = torch.frombuffer(mm, dtype=dtype, offset=lo, count=count) if count else torch.empty(0, dtype=dtype)
        out[name] = flat.view(meta["shape"])
    return out


def load_document(path: str, limit: int, feat_dtype):
    """(aux [n, L_aux*H], last [n, H], ids [n], loss_mask [n]) of one file after the EAGLE shift, n <= limit."""
    s = map_sample(path)
    hs = s["hidden_states"]
    n = min(s["token_ids"].shape[0] - 1, limit)
    L, H = hs.shape[1:]
    aux = hs[:n, :-1].reshape(n, (L - 1) * H).to(feat_dtype)
    last = hs[1:n + 1, -1].to(feat_dtype)
    return aux, last, s["token_ids"][1:n + 1].long(), s["loss_mask"][1:n + 1].bool()


def new_slot(rows: int, pack_len: int, aux_dim: int, hidden: int, feat_dtype, tops: bool, pin: bool = False) -> dict:
    """Host tensors for one step's packed rows: aux [R,P,A], last [R,P,H], ids, loss_mask, doc_ids (-1 = padding),
    positions [R,P] and, with tops, target_ids [R,P]. pin: page-locked, so copies to a GPU do not wait."""
    def empty(*shape, dtype):
        return torch.empty(*shape, dtype=dtype, pin_memory=pin)
    slot = {"aux": empty(rows, pack_len, aux_dim, dtype=feat_dtype), "last": empty(rows, pack_len, hidden, dtype=feat_dtype),
            "ids": empty(rows, pack_len, dtype=torch.long), "loss_mask": empty(rows, pack_len, dtype=torch.bool),
            "doc_ids": empty(rows, pack_len, dtype=torch.long), "positions": empty(rows, pack_len, dtype=torch.long)}
    if tops:
        slot["target_ids"] = empty(rows, pack_len, dtype=torch.long)
    return slot


_PADDING = {"aux": 0, "last": 0, "ids": 0, "loss_mask": False, "doc_ids": -1, "positions": 1, "target_ids": 0}


def fill_rows(slot: dict, files, rows: list[list[int]], tops=None, done=None) -> int:
    """Write the packed rows (lists of document indices) into slot and return the real positions' count. Every
    position is written, padding included, so a slot is reused without clearing it first. files[d] is document
    d's file (a list, or online a mapping that waits for it); done(d), when given, is called once document d is
    copied (online: its file may go); files.sample(d), where it has one, gives the document's tensors (online: a
    document kept in memory)."""
    sample = getattr(files, "sample", None) or (lambda d: map_sample(files[d]))
    pack_len = slot["ids"].shape[1]
    counting = torch.arange(1, pack_len + 1)
    tokens = 0
    for r, docs in enumerate(rows):
        at = 0
        for d in docs:
            s = sample(d)
            hs, ids = s["hidden_states"], s["token_ids"]
            n = min(ids.shape[0] - 1, pack_len - at)
            L, H = hs.shape[1:]
            sl = slice(at, at + n)
            slot["aux"][r, sl].view(n, L - 1, H).copy_(hs[:n, :-1])
            slot["last"][r, sl].copy_(hs[1:n + 1, -1])
            slot["ids"][r, sl].copy_(ids[1:n + 1])
            slot["loss_mask"][r, sl].copy_(s["loss_mask"][1:n + 1])
            slot["doc_ids"][r, sl].fill_(d)
            slot["positions"][r, sl].copy_(counting[:n])
            if tops is not None:
                slot["target_ids"][r, sl].copy_(tops[d][:n])
            del s, hs, ids   # the file's pages: nothing of it stays mapped once it is copied
            if done is not None:
                done(d)
            at += n
        for name, t in slot.items():
            t[r, at:].fill_(_PADDING[name])
        tokens += at
    return tokens


def build_rows(files: list[str], rows: list[list[int]], pack_len: int, aux_dim: int, hidden: int, feat_dtype,
               tops=None) -> dict:
    """The packed tensors of `rows` in new host tensors (new_slot's), plus tokens: the real positions.
    tops (per document, the target's top token at each position after the shift, found once before
    training): packed as target_ids [R,P] too."""
    slot = new_slot(len(rows), pack_len, aux_dim, hidden, feat_dtype, tops is not None)
    return {**slot, "tokens": fill_rows(slot, files, rows, tops)}
