"""Which documents train trains on and which it holds out, how they are packed into rows, how many rows a step takes
and how many steps the run has: a pure function of the inputs, the flags and the seed (data/packing.py packs)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kimi_eagle_host.data import packing  # (packed rows, the step plan)
from kimi_eagle_host.data.spool_size import held_count  # (the held-out count the storage planner counts too)
from kimi_eagle_host.data.step_batches import default_workers  # (rows read ahead onto the device)
from kimi_eagle_host.step_runtime import BadInput


@dataclass
class DataPlan:
    train_docs: list[int]
    held_docs: list[int]           # never trained on: one pass over them is an evaluation
    pack_len: int                  # tokens per packed row
    aux_dim: int                   # the aux features' width: (layers - 1) * hidden
    n_rows: int                    # rows per optimizer step, all ranks together
    plan: packing.Plan             # the training documents' rows, step by step
    held: packing.Plan | None      # the held-out documents' plan: one pass of it is an evaluation
    total: int                     # optimizer steps of the whole run
    workers: int                   # threads reading batches ahead


def split_holdout(n: int, fraction: float, seed: int, keys: list | None = None,
                  cap: int | None = None) -> tuple[list[int], list[int]]:
    """(training, held-out) document indices: a seeded random fraction of the documents, at most `cap` of them
    (held_count), is never trained on. For the same documents, keys and seed the split follows from the count
    alone, and counts (fraction or cap) that hold out as many documents hold out the same ones: run_meta's
    `holdout`, that number, is what a resume compares.
    `keys`: each document's prompt (prepared_data.prompt_keys; None: its own). Documents that open with the same
    prompt stay on one side, so no prompt the choose step serves from the held-out documents was trained on:
    whole groups are held out in the seeded order, a group that would pass the held-out count left in training
    (with no shared prompt, the split is the plain one)."""
    k = held_count(n, fraction, cap)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + 1)).tolist()
    if keys is None:
        return sorted(perm[k:]), sorted(perm[:k])
    group = [d if keys[d] is None else keys[d] for d in range(n)]
    members: dict = {}
    for d in range(n):
        members.setdefault(group[d], []).append(d)
    held, seen = [], set()
    for d in perm:
        if len(held) == k:
            break
        if group[d] in seen:
            continue
        seen.add(group[d])
        if len(held) + len(members[group[d]]) <= k:
            held += members[group[d]]
    out = set(held)
    return [d for d in range(n) if d not in out], sorted(held)


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


def packed(docs: list[int], lengths: list[int], pack_len: int, n_rows: int, seed: int) -> packing.Plan:
    """The plan of `docs` (document indices) packed into rows of pack_len tokens, n_rows a step."""
    rows = packing.pack_rows([lengths[i] for i in docs], pack_len, seed)
    return packing.Plan([[docs[i] for i in row] for row in rows], n_rows, seed)


def plan_data(args, lengths: list[int], n_layer_ids: int, hidden: int, device, flex: bool, world_size: int,
              prompt_keys: list | None = None) -> DataPlan:
    """The run's data plan (`prompt_keys`: see split_holdout); BadInput when a step would leave a rank without a
    row."""
    train_docs, held_docs = split_holdout(len(lengths), args.holdout_fraction, args.seed, prompt_keys,
                                          args.holdout_max_samples)
    if getattr(args, "choose_checkpoints", 0) and not held_docs:   # refused now, not after the training
        raise BadInput(f"--choose-checkpoints {args.choose_checkpoints}: the choose step serves documents training "
                       f"never saw, but --holdout-fraction {args.holdout_fraction} of {len(lengths)} documents holds "
                       f"none out (at least {1 / len(lengths):.3g} would hold one)")
    pack_len = args.pack_len or max(lengths[i] for i in train_docs)
    if args.pack_len is None and flex:
        pack_len = -(-pack_len // 128) * 128   # whole attention blocks
    aux_dim = (n_layer_ids - 1) * hidden
    n_rows = rows_per_step(args, pack_len, device, hidden, aux_dim)
    if n_rows < world_size:
        raise BadInput(f"{n_rows} row(s) of {pack_len} tokens per step (--batch-size / --tokens-per-step count all "
                       f"ranks): need at least one per rank, world size {world_size}")
    plan = packed(train_docs, lengths, pack_len, n_rows, args.seed)
    total = max(1, math.ceil(args.epochs * plan.steps_per_epoch))
    if args.max_steps is not None:
        total = min(total, args.max_steps)
    held = packed(held_docs, lengths, pack_len, n_rows, args.seed) if held_docs else None
    workers = args.loader_workers if args.loader_workers is not None else default_workers(device)
    return DataPlan(train_docs, held_docs, pack_len, aux_dim, n_rows, plan, held, total, workers)
