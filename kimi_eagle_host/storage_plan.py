"""Whether a run's hidden states fit on the host as files (offline), and what streaming them would cost instead
(online): preflight's `storage` check. Stdlib only, from the target's config (no weights), the captured layer ids
and the prepared data's size.

Offline, `extract` writes every sample as hs_{i}.safetensors (data/hidden_state_files.py): per token L layers x
hidden x dtype bytes of hidden states plus an int64 token id and an int64 loss-mask entry, and per file a small
safetensors header. Online (`hidden_states: online`, data/online_stream.py) stores none of it as files of the run:
a bounded buffer in a memory file system (`online_spool_dir`, /dev/shm) holds what the engine has extracted and the
trainer not yet taken (`online_buffer_gb`, and at least one engine batch per engine, which always goes:
spool_size.buffer_bytes, as the train step counts it), the held-out documents stay
there for the run's evaluations (`holdout_fraction` of the data, at most `holdout_max_samples` documents: the
trainer's own count, spool_size.held_count), and every epoch runs the target again (unless
`online_cache_gb` keeps documents: in the trainer's memory where one process trains, so a cache as large as the
offline files costs memory, never files).

Hours are estimates from one-H200 measurements (docs/benchmarks.md), scaled by a rough rule:
- extraction (vLLM native): 153.6 k tokens/s at a 1.06 B target, 37.4 k at 7.2 B; between them log-linear in the
  parameters a token multiplies through (model_size.compute_parameters: MoE experts at their routed share); above
  7.2 B the forward is compute-bound (53.7 % of peak there), so tokens/s falls as 1 / parameters; below 1.06 B it
  stays at the 1 B figure (small matmuls and writing the files bound it, not FLOPs);
- training (our trainer): 255 k tokens/s with a hidden-2048 draft, falling as 1 / hidden^2 above it (the draft's
  matmuls are hidden x hidden); not faster below it;
- both per GPU, times the GPUs the job uses (at least one; preflight counts them as the step would see them:
  CUDA_VISIBLE_DEVICES, the host's `gpus:`, online's engine_gpus / train_gpus).
"""

from __future__ import annotations

import json
import math
import os

from kimi_eagle_host.data.hidden_state_files import SAMPLE_RE
# A sample file's layout (token id and loss mask per token, a header per file) and what online keeps in its spool:
# one reckoning for the planner and the online trainer's own check.
from kimi_eagle_host.data.spool_size import FILE_HEADER_BYTES, ID_AND_MASK_BYTES, buffer_bytes, held_count, spool_bytes
from kimi_eagle_host.model_size import DTYPE_BYTES, compute_parameters

# Offline must leave this share of the estimate free on top of the step's own margin (--min-free-disk-gib):
# token counts estimated from a dataset's first rows, file-system blocks.
FIT_MARGIN = 0.05

# docs/benchmarks.md, one H200: (parameters a token multiplies through, tokens/s) of vLLM-native extraction.
EXTRACT_ANCHORS = ((1.06e9, 153_600.0), (7.2e9, 37_400.0))
TRAIN_TOKENS_PER_S, TRAIN_HIDDEN = 255_000.0, 2048


def bytes_per_token(hidden: int, layers: int, dtype: str = "bfloat16") -> dict:
    """What one token costs on disk offline: {"hidden_states": L x hidden x dtype bytes, "ids_and_mask", "total"}."""
    states = layers * hidden * DTYPE_BYTES.get(str(dtype).replace("torch.", ""), 2)
    return {"hidden_states": states, "ids_and_mask": ID_AND_MASK_BYTES, "total": states + ID_AND_MASK_BYTES}


def extract_tokens_per_s(params: int) -> float:
    """One H200's vLLM-native extraction tokens/s for a target of `params` (compute_parameters), by the rule above."""
    (p1, r1), (p8, r8) = EXTRACT_ANCHORS
    if params <= p1:
        return r1
    if params >= p8:
        return r8 * p8 / params
    slope = math.log(r8 / r1) / math.log(p8 / p1)
    return r1 * (params / p1) ** slope


def train_tokens_per_s(hidden: int) -> float:
    """One H200's training tokens/s for a draft of the target's hidden size, by the rule above."""
    return TRAIN_TOKENS_PER_S * min(1.0, (TRAIN_HIDDEN / hidden) ** 2)


def prepared_data(prepared_dir: str | None) -> dict | None:
    """{tokens, samples, source} from <prepared_dir>/manifest.json once prepare has run, else None."""
    if not prepared_dir:
        return None
    path = os.path.join(prepared_dir, "manifest.json")
    try:
        with open(path) as f:
            doc = json.load(f)
        return {"tokens": int(doc["tokens"]), "samples": int(doc["count"]), "source": path, "estimate": False}
    except (OSError, ValueError, KeyError, TypeError):
        return None


def already_stored(hs_dir: str | None) -> int:
    """Bytes of the sample files an earlier extract left in `hs_dir` (where extract writes): a resume writes only the
    rest, and those bytes are no longer free."""
    try:
        with os.scandir(hs_dir or "") as entries:
            return sum(e.stat().st_size for e in entries if SAMPLE_RE.match(e.name))
    except OSError:
        return 0


def free_bytes(path: str) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def size(n: float) -> str:
    """Bytes as people read disk sizes (decimal units): 344.2 TB, 16.1 GB, 920 kB."""
    for unit, scale in (("PB", 1e15), ("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def count(n: int) -> str:
    """A parameter count as model cards say it: 31.7 B, 135.0 M."""
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def plan(text_config: dict, layer_ids: list[int], data: dict, *, disk_path: str, disk_free: int, keep_free: int,
         seq_len: int, spool_dir: str, spool_free: int | None, online_buffer_gb: float, holdout_fraction: float,
         holdout_max_samples: int | None = None, gpus: int = 1, train_gpus: int | None = None, epochs: float = 1,
         engines: int = 1, engine_batch_size: int = 1, dtype: str = "bfloat16", free_note: str = "",
         stored: int = 0) -> dict:
    """The storage plan: bytes per token and in all, whether offline fits `disk_free` (with FIT_MARGIN and
    `keep_free` bytes left over), what online keeps in its spool folder instead (`spool_dir`, `spool_free` bytes
    free there: the buffer of `online_buffer_gb`, at least one batch of `engine_batch_size` samples of `seq_len`
    for each of a host's `engines` (spool_size.host_engines), and the held-out documents:
    `holdout_fraction` of the samples, at most `holdout_max_samples`, at the data's mean tokens a sample), and
    the hours each way. `data` is prepared_data()'s answer or an estimate of the same shape ({tokens, samples,
    source, estimate}); `dtype` what extract writes (compute_dtype); `free_note` says where `disk_free` came from
    when not from the file system; `stored` the bytes already written (already_stored()); `gpus` the GPUs that
    extract, `train_gpus` those that train (None: the same; online's split layout gives each side its own).
    Everything the check prints is in "summary" (one line) and "lines"."""
    hidden = int(text_config["hidden_size"])
    per = bytes_per_token(hidden, len(layer_ids), dtype)
    tokens, samples = int(data["tokens"]), int(data["samples"])
    offline = tokens * per["total"] + samples * FILE_HEADER_BYTES
    needed = int(max(0, offline - stored) * (1 + FIT_MARGIN)) + keep_free
    # Online's spool: each engine waits while its share of the buffer is full, but one engine batch always goes
    # into an empty one (the train step's own floor, buffer_bytes, here of samples of seq_len, the longest there
    # are); it never holds more than the documents the engine runs. The held-out documents stay for the whole run.
    one_sample = seq_len * per["total"] + FILE_HEADER_BYTES
    streamed = offline * max(1, math.ceil(epochs))
    buffer = buffer_bytes(online_buffer_gb, engines, engine_batch_size, one_sample, streamed)
    floor = buffer_bytes(0, engines, engine_batch_size, one_sample, streamed)
    held = held_count(samples, holdout_fraction, holdout_max_samples)
    spool = spool_bytes(int(tokens * held / max(1, samples)), held, per["total"], cache_bytes=0, buffer_bytes=buffer)
    gpus = max(1, gpus)
    train_gpus = gpus if train_gpus is None else max(1, train_gpus)
    params = compute_parameters(text_config)
    extract_rate = extract_tokens_per_s(params) * gpus
    train_rate = train_tokens_per_s(hidden) * train_gpus
    extract_h, train_h = tokens / extract_rate / 3600, tokens / train_rate / 3600
    fits = disk_free >= needed
    p = {"hidden_size": hidden, "layer_ids": list(layer_ids), "dtype": dtype,
         "bytes_per_token": per["total"], "hidden_state_bytes_per_token": per["hidden_states"],
         "tokens": tokens, "samples": samples, "data_from": data["source"], "estimate": bool(data["estimate"]),
         "offline_bytes": offline, "already_stored_bytes": stored, "offline_needs_free": needed,
         "disk_path": disk_path, "disk_free": disk_free, "free_note": free_note, "offline_fits": fits,
         "seq_len": seq_len, "spool_dir": spool_dir, "spool_free": spool_free, "online_buffer_gb": online_buffer_gb,
         "online_buffer_bytes": buffer, "one_sample_bytes": one_sample, "engines": engines,
         "engine_batch_size": engine_batch_size, "min_buffer_bytes": floor, "holdout_fraction": holdout_fraction,
         "holdout_max_samples": holdout_max_samples, "heldout_documents": held, "heldout_bytes": spool["held"], "spool_needs": spool["total"],
         "spool_fits": None if spool_free is None else spool_free >= spool["total"],
         "gpus": gpus, "train_gpus": train_gpus, "epochs": epochs,
         "compute_parameters": params, "extract_tokens_per_s": round(extract_rate),
         "train_tokens_per_s": round(train_rate), "extract_hours": extract_h, "train_hours_per_epoch": train_h,
         "offline_hours": extract_h + epochs * train_h, "online_hours": epochs * (extract_h + train_h)}
    p["summary"] = summary(p)
    p["lines"] = details(p)
    return p


def summary(p: dict) -> str:
    est = "~" if p["estimate"] else ""
    verdict = "offline fits" if p["offline_fits"] else "offline does not fit"
    return (f"offline needs {est}{size(p['offline_bytes'])} of hidden states ({p['bytes_per_token']:,} B/token x "
            f"{est}{p['tokens']:,} tokens in {p['samples']:,} samples), {size(p['disk_free'])} free on "
            f"{p['disk_path']}{p['free_note']}: {verdict}; online stores none as files (it keeps up to "
            f"~{size(p['spool_needs'])} in {p['spool_dir']}) but runs extraction again every epoch")


def spool_verdict(p: dict) -> str:
    """Online's spool in one line: what it keeps, and whether its folder has room."""
    free = "free unknown" if p["spool_free"] is None else f"{size(p['spool_free'])} free"
    verdict = "" if p["spool_fits"] is None else ": fits" if p["spool_fits"] else ": does not fit"
    return (f"online keeps up to ~{size(p['spool_needs'])} in {p['spool_dir']} ({free}){verdict}: a buffer of "
            f"{size(p['online_buffer_bytes'])} (online_buffer_gb {p['online_buffer_gb']:g}, at least {batch(p)}: "
            f"{size(p['min_buffer_bytes'])}) and {p['heldout_documents']:,} held-out "
            f"documents, ~{size(p['heldout_bytes'])} (holdout_fraction {p['holdout_fraction']:g}, at most "
            f"holdout_max_samples {p['holdout_max_samples']})")


def batch(p: dict) -> str:
    """The buffer's floor in words: one engine batch of samples of seq_len, for each engine of a host."""
    engines = f" for each of {p['engines']} engines" if p["engines"] > 1 else ""
    return (f"one batch of engine_batch_size {p['engine_batch_size']} samples of seq_len {p['seq_len']} "
            f"({size(p['one_sample_bytes'])} each){engines}")


def spool_fix(p: dict) -> str:
    """What to change when online's spool folder cannot hold what the run keeps there."""
    room = f"point online_spool_dir at a memory file system with {size(p['spool_needs'])} free"
    one = p["min_buffer_bytes"]
    if p["spool_free"] < one:
        return (f"{p['spool_dir']} cannot hold even {batch(p)} ({size(one)}): {room} (in a container: a larger "
                f"--shm-size), or lower steps.train.engine_batch_size or seq_len")
    left = p["spool_free"] - p["heldout_bytes"]   # what a buffer may take beside the held-out documents
    if left >= one:
        return f"set online_buffer_gb={math.floor(left / 1e6) / 1e3:g} (what fits there), or {room}"
    return f"{room}, or hold out fewer documents (steps.train.holdout_max_samples, steps.train.holdout_fraction)"


def details(p: dict) -> list[str]:
    """The plan's figures, one line each, for the printed block under the check."""
    n = len(p["layer_ids"])
    states = p["hidden_state_bytes_per_token"]
    gpus = f"{p['gpus']} GPU{'s' if p['gpus'] > 1 else ''}"
    if p["train_gpus"] != p["gpus"]:   # online's split layout: the engine on some, the trainer on others
        gpus = f"{gpus} extracting, {p['train_gpus']} training"
    epochs = f"{p['epochs']:g} epoch{'' if p['epochs'] == 1 else 's'}"
    return [
        f"per token: {n} layers {p['layer_ids']} x hidden {p['hidden_size']} x {states // (n * p['hidden_size'])} B "
        f"({p['dtype']}) = {states:,} B, + token id and loss mask {p['bytes_per_token'] - states} B "
        f"= {p['bytes_per_token']:,} B",
        f"data: {p['tokens']:,} tokens in {p['samples']:,} samples "
        + (f"(an estimate: {p['data_from']})" if p["estimate"] else f"({p['data_from']})"),
        f"disk: offline needs {size(p['offline_needs_free'])} free (+{FIT_MARGIN:.0%} and the kept margin"
        + (f"; {size(p['already_stored_bytes'])} already written" if p["already_stored_bytes"] else "") + "); "
        f"{p['disk_path']} has {size(p['disk_free'])}",
        spool_verdict(p),
        f"time (estimate from one-H200 figures, {gpus}): extraction ~{p['extract_hours']:.1f} h at "
        f"~{p['extract_tokens_per_s']:,} tokens/s ({count(p['compute_parameters'])} parameters per token); "
        f"training ~{p['train_hours_per_epoch']:.1f} h per epoch at ~{p['train_tokens_per_s']:,} tokens/s",
        f"{epochs}: offline ~{p['offline_hours']:.1f} h (extract once, train from the files); online "
        f"~{p['online_hours']:.1f} h co-located (extraction recomputed every epoch; less where engine and trainer "
        f"overlap on separate GPUs)",
    ] + ([f"online with online_cache_gb >= {p['offline_bytes'] / 1e9:.1f} (in the trainer's memory, not files) "
          f"extracts once and trains the later epochs from memory: ~{p['offline_hours']:.1f} h, less where the "
          f"first epoch's extraction and training overlap"] if p["epochs"] > 1 else [])
