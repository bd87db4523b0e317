"""Disk: the margin every step keeps free, and the storage plan of the hidden states (storage_plan.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kimi_eagle_host import storage_plan
from kimi_eagle_host.ops.preflight.gpu import query_gpus
from kimi_eagle_host.ops.preflight.report import check

# Test-only: the free bytes preflight sees under the output folder (a host whose disk is "full" without filling it).
FREE_DISK_ENV = "KIMI_EAGLE_TEST_FREE_DISK_BYTES"

def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_disk(args) -> tuple[Path, int, str]:
    """(the output folder's nearest existing folder, its free bytes, how they were found)."""
    where = _existing_parent(Path(args.output_dir))
    if args.assume_free_disk_bytes is not None:
        return where, args.assume_free_disk_bytes, " (--assume-free-disk-bytes override)"
    if os.environ.get(FREE_DISK_ENV):   # a test's host whose disk is "full", for the steps that run preflight
        return where, int(os.environ[FREE_DISK_ENV]), f" ({FREE_DISK_ENV})"
    return where, shutil.disk_usage(where).free, ""


def check_disk(args, ctx: dict) -> dict:
    """The margin every step keeps free; the hidden states' volume is the storage check's."""
    if not args.output_dir:
        return check("disk", "fail", "no --output-dir given", "set pipeline.output_dir in the inventory")
    where, free, src = free_disk(args)
    gib = 1 << 30
    what = "hidden states: see the storage check" if args.step in ("extract", "all") else \
        "no hidden states for this step"
    detail = f"{where}: {free / gib:.2f} GiB free{src}; {what}; margin {args.min_free_disk_gib:g} GiB"
    if free < args.min_free_disk_gib * gib:
        return check("disk", "fail", detail, f"free {(args.min_free_disk_gib * gib - free) / gib:.2f} GiB under "
                     f"{where}, or choose another --output-dir")
    return check("disk", "pass", detail)


def planned_data(args, ctx: dict) -> dict | None:
    """What extract will read: the prepared manifest's counts once prepare has run, else an estimate from the
    dataset check (its rows x their average length capped at seq_len; rows x seq_len when regenerate writes the
    answers first), else None."""
    data = storage_plan.prepared_data(args.output_dir)
    if data or not ctx.get("rows"):
        return data
    if "regenerate" in args.step_settings_parsed:
        return {"tokens": ctx["rows"] * args.seq_len, "samples": ctx["rows"], "estimate": True,
                "source": f"{ctx['rows']:,} prompts x seq_len {args.seq_len}, answers not generated yet"}
    return {"tokens": ctx["tokens"], "samples": ctx["rows"], "estimate": True,
            "source": f"{args.dataset}: {ctx['rows']:,} rows x their average length, capped at seq_len {args.seq_len}; "
                      "prepare has not run"}


def check_storage(args, ctx: dict) -> dict:
    """The planner (storage_plan.py): do this run's hidden states fit as files, and what would online cost."""
    text, ids = ctx.get("text_config"), ctx.get("layer_ids")
    data = planned_data(args, ctx) if args.output_dir else None
    if not text or not ids or not data:
        unknown = "the model's config and layer ids" if not text or not ids else \
            "the data's size (run prepare first, or give a dataset file)"
        return check("storage", "pass", f"not planned: {unknown} unknown here")
    where, free, src = free_disk(args)
    gpus, _ = query_gpus(args.smi_path)
    plan = storage_plan.plan(text, ids, data, disk_path=str(where), disk_free=free,
                             keep_free=int(args.min_free_disk_gib * (1 << 30)), seq_len=args.seq_len,
                             gpus=len(gpus or []), epochs=args.epochs, free_note=src,
                             shm_free=storage_plan.free_bytes(storage_plan.SHM),
                             stored=storage_plan.already_stored(args.output_dir))
    short = plan["offline_needs_free"] - free
    if args.hidden_states == "online":   # no hidden-state files: the plan is what the run costs instead
        result = check("storage", "pass", f"hidden_states: online, no hidden-state files; {plan['summary']}")
        result["plan"] = plan
        return result
    fix = (f"offline does not fit: set hidden_states=online (the engine feeds the trainer through a buffer in "
           f"memory; no files), or use less data (--max-samples, a shorter seq_len), free "
           f"{storage_plan.size(short)} under {where}, or choose an output_dir with room")
    result = check("storage", "pass" if plan["offline_fits"] else "fail", plan["summary"], fix)
    result["plan"] = plan
    return result
