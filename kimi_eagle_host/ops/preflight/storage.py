"""Disk: the margin every step keeps free, and the storage plan of the hidden states (storage_plan.py).

The plan decides whether `run all` goes online, so its inputs are the ones this run will have: the steps' own
settings (--step-settings: where extract writes and reads, prepare's max_samples, regenerate's prompt counts,
train's epochs, trainer and online buffer), the data prepare is about to write (not an earlier run's), and the
dtype extract will write."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from kimi_eagle_host import compute_dtype, storage_plan
from kimi_eagle_host.data.spool_size import host_engines
from kimi_eagle_host.gpus import gpu_numbers, visible_names
from kimi_eagle_host.ops.preflight.gpu import query_gpus
from kimi_eagle_host.ops.preflight.report import check, prepared_dir, step_value

# Test-only: the free bytes preflight sees where the hidden states go (a host whose disk is "full" without filling it).
FREE_DISK_ENV = "KIMI_EAGLE_TEST_FREE_DISK_BYTES"

def _existing_parent(p: Path) -> Path:
    p = p.absolute()
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_disk(args, folder: str) -> tuple[Path, int, str]:
    """(`folder`'s nearest existing folder, its free bytes, how they were found)."""
    where = _existing_parent(Path(folder))
    if args.assume_free_disk_bytes is not None:
        return where, args.assume_free_disk_bytes, " (--assume-free-disk-bytes override)"
    if os.environ.get(FREE_DISK_ENV):   # a test's host whose disk is "full", for the steps that run preflight
        return where, int(os.environ[FREE_DISK_ENV]), f" ({FREE_DISK_ENV})"
    return where, shutil.disk_usage(where).free, ""


def hidden_states_dir(args) -> str:
    """Where extract writes the sample files: its `out` when set, else <output-dir>/hidden_states."""
    return step_value(args, "extract", "out") or os.path.join(args.output_dir, "hidden_states")


def check_disk(args, ctx: dict) -> dict:
    """The margin every step keeps free; the hidden states' volume is the storage check's."""
    if not args.output_dir:
        return check("disk", "fail", "no --output-dir given", "set pipeline.output_dir in the inventory")
    where, free, src = free_disk(args, args.output_dir)
    gib = 1 << 30
    what = "hidden states: see the storage check" if args.step in ("extract", "all") else \
        "no hidden states for this step"
    detail = f"{where}: {free / gib:.2f} GiB free{src}; {what}; margin {args.min_free_disk_gib:g} GiB"
    if free < args.min_free_disk_gib * gib:
        return check("disk", "fail", detail, f"free {(args.min_free_disk_gib * gib - free) / gib:.2f} GiB under "
                     f"{where}, or choose another --output-dir")
    return check("disk", "pass", detail)


def planned_data(args, ctx: dict) -> dict | None:
    """What extract (online: train's engine) will read. In `all`, prepare (after regenerate) writes it first, so an
    estimate from the dataset check whatever an earlier run left in prepared/: its rows (regenerate's max_prompts
    and self_prompts, prepare's max_samples applied) x their average length capped at seq_len, or x seq_len when
    regenerate writes the answers first. A step alone reads the prepared manifest's counts. None: not knowable."""
    folder = prepared_dir(args)
    if args.step != "all":
        return storage_plan.prepared_data(folder)
    if not ctx.get("rows"):
        return None
    rows, how = ctx["rows"], []
    regenerate = "regenerate" in args.step_settings_parsed
    if regenerate:
        max_prompts, self_prompts = (step_value(args, "regenerate", k) for k in ("max_prompts", "self_prompts"))
        if max_prompts and rows > max_prompts:
            rows = max_prompts
            how.append(f"the first {max_prompts:,} (max_prompts)")
        if self_prompts > rows:
            rows = self_prompts
            how.append(f"filled to {self_prompts:,} by the target (self_prompts)")
    if args.max_samples and rows > args.max_samples:
        rows = args.max_samples
        how.append(f"{rows:,} kept (steps.prepare.max_samples)")
    per_row = args.seq_len if regenerate else ctx["row_tokens"]
    earlier = storage_plan.prepared_data(folder)
    source = (f"{args.dataset}: {ctx['rows']:,} rows{' (' + ', '.join(how) + ')' if how else ''} x "
              + (f"seq_len {args.seq_len}, answers not generated yet" if regenerate else
                 f"their average length, capped at seq_len {args.seq_len}")
              + ("; prepare runs first in this job, so the earlier run's "
                 f"{earlier['samples']:,} samples in {earlier['source']} are not what it will read"
                 if earlier else "; prepare has not run"))
    return {"tokens": int(rows * per_row), "samples": rows, "estimate": True, "source": source}


def job_gpus(args, listed: list | None) -> tuple[int, int]:
    """(GPUs that extract, GPUs that train): those the job's steps will use, not every GPU nvidia-smi lists (a host
    shared with other jobs): the ones CUDA_VISIBLE_DEVICES names, the first --gpus of them (the host's `gpus:`),
    as the launcher narrows them (pipeline/launch.py); online's split layout gives the engine `engine_gpus` and the
    trainer `train_gpus` of them (unset: all). 0 on a host without GPUs."""
    if not listed:
        return 0, 0
    n = len(visible_names(os.environ, driver_count=len(listed)))
    if args.gpus is not None:
        n = min(n, args.gpus)
    if args.hidden_states != "online":
        return n, n
    try:
        engine = gpu_numbers(step_value(args, "train", "engine_gpus", args.engine_gpus))
        train = gpu_numbers(step_value(args, "train", "train_gpus"))
    except ValueError:   # the train step refuses them in one line; the plan counts what the launcher would
        engine = train = None
    return (min(n, len(engine)) if engine else n), (min(n, len(train)) if train else n)


def online_engines(args, train_gpus: int) -> int:
    """The engines one host starts online (spool_size.host_engines, as the train step counts them): each keeps an
    engine batch in the buffer at least."""
    split = bool(step_value(args, "train", "engine_gpus", args.engine_gpus))
    tp = step_value(args, "train", "tp_size", args.tp_size)
    return host_engines(max(1, train_gpus), max(1, tp), step_value(args, "train", "online_engines"), split,
                        cuda=train_gpus > 0)


def written_dtype(args, gpus: list | None) -> str:
    """The dtype the hidden states will be in, resolved as extract (online: train's engine) resolves it
    (hf_target.resolve_device_dtype): `auto` is bfloat16 in vLLM; in transformers bfloat16 on CUDA and float32 on a
    CPU, a GPU that nvidia-smi lists standing for torch's CUDA."""
    step = "train" if args.hidden_states == "online" else "extract"
    dtype = step_value(args, step, "dtype")
    if dtype == "auto" and args.engine == "vllm":
        return "bfloat16"
    device = step_value(args, step, "device")
    if device == "auto":
        device = "cuda" if gpus else "cpu"
    return compute_dtype.resolve(dtype, device)


def not_planned(args, ctx: dict) -> dict:
    """A warning, never a silent pass: nothing is chosen for this run where the plan cannot be made."""
    if getattr(args, "model_source", None) == "tiny" and not ctx.get("text_config"):
        # The demo's own target: a few MB of hidden states by construction, nothing to choose.
        return check("storage", "pass", "not planned: the job builds a tiny random target first (its hidden states "
                                        "are small)")
    if not ctx.get("text_config") or not ctx.get("layer_ids"):
        unknown, remedy = "the model's config and layer ids", "give a model folder with its config.json"
        if getattr(args, "model_source", None):
            remedy = "the job builds the model first (model_source); preflight plans once it exists"
    else:
        unknown, remedy = "the data's size", "run prepare first, or give a dataset file or name"
    return check("storage", "warn", f"not planned: {unknown} unknown here",
                 f"{remedy}; until then nothing is chosen for you: hidden_states stays {args.hidden_states}"
                 + (" and the online buffer's folder is not checked" if args.hidden_states == "online" else
                    " (set hidden_states=online yourself where the hidden states would not fit as files)"))


def check_storage(args, ctx: dict) -> dict:
    """The planner (storage_plan.py): do this run's hidden states fit as files where extract writes them, and what
    online would keep in its buffer's folder instead."""
    text, ids = ctx.get("text_config"), ctx.get("layer_ids")
    data = planned_data(args, ctx) if args.output_dir and text and ids else None
    if not data:
        return not_planned(args, ctx)
    gpus, _ = query_gpus(args.smi_path)
    extract_gpus, train_gpus = job_gpus(args, gpus)
    hs_dir = hidden_states_dir(args)
    where, free, src = free_disk(args, hs_dir)
    spool = step_value(args, "train", "online_spool_dir")
    plan = storage_plan.plan(text, ids, data, disk_path=str(where), disk_free=free,
                             keep_free=int(args.min_free_disk_gib * (1 << 30)), seq_len=args.seq_len,
                             spool_dir=spool, spool_free=storage_plan.free_bytes(spool),
                             online_buffer_gb=step_value(args, "train", "online_buffer_gb"),
                             holdout_fraction=step_value(args, "train", "holdout_fraction"),
                             holdout_max_samples=step_value(args, "train", "holdout_max_samples"),
                             gpus=extract_gpus, train_gpus=train_gpus, engines=online_engines(args, train_gpus),
                             engine_batch_size=step_value(args, "train", "engine_batch_size"), epochs=step_value(args, "train", "epochs", args.epochs),
                             dtype=written_dtype(args, gpus), free_note=src, stored=storage_plan.already_stored(hs_dir))
    if args.hidden_states == "online":   # no hidden-state files: the plan is what the run costs instead
        if not os.path.isdir(spool):
            result = check("storage", "fail", f"hidden_states: online: online_spool_dir {spool}: not a folder",
                           "point online_spool_dir at a memory file system (/dev/shm) or create the folder")
        elif plan["spool_fits"] is False:
            result = check("storage", "fail", f"hidden_states: online, but {storage_plan.spool_verdict(plan)}",
                           storage_plan.spool_fix(plan))
        else:
            result = check("storage", "pass", f"hidden_states: online, no hidden-state files; {plan['summary']}")
        result["plan"] = plan
        return result
    if step_value(args, "train", "trainer") != "ours":
        online = ("steps.train.trainer speculators reads the hidden states as files (hidden_states=online needs "
                  "trainer ours), so ")
    elif plan["spool_fits"] is False:
        online = f"online would not fit either ({storage_plan.spool_fix(plan)}); or "
    else:
        online = ("set hidden_states=online (the engine feeds the trainer through a buffer in memory; no files), "
                  "or ")
    moved = step_value(args, "extract", "out")
    fix = (f"offline does not fit: {online}use less data (steps.prepare.max_samples, a shorter seq_len), free "
           f"{storage_plan.size(plan['offline_needs_free'] - free)} under {where}, or choose "
           + ("a steps.extract.out" if moved else "an output_dir") + " with room")
    result = check("storage", "pass" if plan["offline_fits"] else "fail", plan["summary"], fix)
    result["plan"] = plan
    return result
