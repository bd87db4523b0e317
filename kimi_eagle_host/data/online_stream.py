"""`hidden_states: online`: the trainer's documents come from an engine it runs, through a bounded buffer in memory,
never as files of the run.

Why this works exactly: the training plan (packing.Plan) is a pure function of the documents' LENGTHS and the seed,
and online the lengths come from the prepared data (token counts cut at seq_len, as extract cuts them). So before
any hidden state exists the trainer knows which documents each step takes, in which order: the *stream*. The
engine (engine/stream_producer.py, a child process of the trainer) extracts the stream's documents in that order
into a *spool*: a folder unique to the job in a memory file system (`online_spool_dir`, /dev/shm), one file per
stream position, in extract's sample format, each appearing complete by rename. The trainer's loader waits for a
step's documents, packs them (packing.fill_rows) and deletes each one once it is copied.

  <spool>/stream.npy        what the engine extracts, in order: int64 rows (kind, step, document)
  <spool>/s_<step>_<doc>    a training document of one step (kind 1): counted against `online_buffer_gb`; the
                            engine waits while the buffer is that full (backpressure)
  <spool>/held/d_<doc>      a held-out document (kind 0): extracted first, kept for the run's evaluations
  <spool>/cache/d_<doc>     a document kept for later epochs (kind 2, `online_cache_gb`) where several trainer
                            processes share the engine: extracted at its first position only, read again by
                            whichever rank takes it later
                            One trainer process keeps them in its own memory instead (kind 3): the file comes as
                            a training document's (s_<step>_<doc>, counted against the buffer), the trainer copies
                            it into memory and deletes it. Files in a memory file system are what offline costs;
                            a cache in the trainer's memory is never a file of the run.
  <spool>/engine.json       the engine's figures (tokens, seconds, time waiting for room, buffer bytes)
  <spool>/engine.error      why the engine failed: the trainer raises it as its error
  <spool>/owner.lock        locked (flock) by the trainer for its whole life: a later run removes only a spool
                            whose lock it can take, so never a live run's, wherever that runs (another container
                            sharing /dev/shm, where its pid is not seen; another machine sharing the folder)
  <spool>/owner.json        the trainer's pid, boot id and host, for a person reading the folder

The held-out documents, and a cache several trainer processes share, stay in the spool for the whole run, beside
the buffer: before the engine starts (and before anything of an earlier run is removed or the target loaded) the
trainer refuses a run whose spool would not fit the folder's free space (check_spool_room; the bytes:
data/spool_size.py).

Resume needs nothing more: a resumed run's stream starts at the checkpoint's step. The engine dying is one error
in the trainer (checked while it waits), never a hang; the trainer stops the engine and removes the spool when it
ends (done, failed, or stopped by SIGTERM after its checkpoint); the engine removes it too if the trainer dies.
A spool is removed by moving it aside first (remove_spool), so that a writer still running fails instead of
leaving files behind; nothing recreates a removed spool: the engine stops, and the trainer ends in one line.

Under torchrun each engine serves a group of a host's trainer processes (started by the group's first rank, in the
host's memory): its stream is the held-out documents and the rows its group's ranks evaluate and take
(group_held, host_rows), so N engines extract at once, and the global batch is the one a single process would
train. A group is tp_size ranks on CUDA (an engine beside each GPU's rank for a target that fits one GPU), the
host's ranks on a CPU or in the split layout (`online_engines` sets the count); the host's buffer and cache are
shared out among its engines.
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

from kimi_eagle_host import procfs
from kimi_eagle_host.data.hidden_state_files import taken_path
from kimi_eagle_host.data.spool_size import buffer_bytes, document_bytes, host_engines, spool_bytes, token_bytes
from kimi_eagle_host.gpus import cuda_visible_names, gpu_numbers
from kimi_eagle_host.step_runtime import BadInput, Refused, log
from kimi_eagle_host.storage_plan import size

SPOOL_PREFIX = "kimi-eagle-online-"
STREAM = "stream.npy"
ENGINE_FIGURES = "engine.json"
ENGINE_ERROR = "engine.error"
OWNER = "owner.json"
OWNER_LOCK = "owner.lock"
GONE = ".gone-"   # <spool>.gone-<pid>: a spool being removed (remove_spool)
ENGINE_PID = "engine.pid"
HELD, SPOOLED, CACHED, KEPT = 0, 1, 2, 3   # kinds of a stream entry
TAKEN = (SPOOLED, KEPT)   # entries the trainer deletes once read: the buffer's (the others stay until the end)
# Test-only: a folder where every document handed to the trainer is copied (tests compare them with extract's).
COPY_ENV = "KIMI_EAGLE_TEST_ONLINE_COPY_DIR"
# In the environment of the engine and of every process it starts: the spool it serves (kill_marked finds them).
SPOOL_ENV = "KIMI_EAGLE_ONLINE_SPOOL"
STOP_GRACE_S = 20.0   # how long the engine gets to shut down (vLLM stops its workers) before SIGKILL


# ----------------------------------------------------------------------------------------------------
# what the trainer knows before any hidden state exists

def inputs(args, out: str) -> tuple[dict, list[int]]:
    """(data_config, lengths) of an online run: what extract would record, and each document's length after the
    EAGLE shift, from the prepared data and the target's config alone."""
    from kimi_eagle_host.data.prepared_data import PreparedDataset
    from kimi_eagle_host.target.hf_target import resolve_device_dtype
    from kimi_eagle_host.target.model_layers import LAYER_CONVENTION, LayerIdError, parse_layer_ids
    from kimi_eagle_host.target.target_config import model_info

    if args.trainer != "ours":
        raise BadInput("hidden_states: online: only with --trainer ours (speculators' trainer reads files)")
    for name in ("seq_len", "tp_size", "engine_batch_size"):
        if getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')}: must be >= 1")
    if not args.online_buffer_gb > 0 or args.online_cache_gb < 0:
        raise BadInput("--online-buffer-gb must be > 0 and --online-cache-gb >= 0")
    if not os.path.isdir(args.online_spool_dir):
        raise BadInput(f"--online-spool-dir {args.online_spool_dir}: not a folder")
    for what in ("engine_gpus", "train_gpus"):
        parse_gpus(getattr(args, what), what)
    check_engine(args.engine)
    prepared = os.path.join(out, "prepared")
    ds = PreparedDataset(prepared)
    info = model_info(args.model)
    try:
        layer_ids = parse_layer_ids(args.layer_ids, info["num_layers"])
    except LayerIdError as e:
        raise BadInput(str(e)) from None
    _, dtype = resolve_device_dtype(args.device, args.dtype, args.engine)
    lengths = []
    for i in range(len(ds)):
        n = min(len(ds[i][0]), args.seq_len)
        if n < 2:
            raise BadInput(f"{prepared}: sample {i} has {n} token(s); training needs at least 2")
        lengths.append(n - 1)
    if not lengths:
        raise BadInput(f"{prepared}: holds no samples")
    dc = {"layer_ids": layer_ids, "num_layers": info["num_layers"], "hidden_size": info["hidden_size"],
          "layer_convention": LAYER_CONVENTION, "dtype": dtype, "engine": args.engine, "seq_len": args.seq_len,
          "prepared_sha256": ds.digest, "count": len(ds), "hidden_states": "online"}
    return dc, lengths


def check_engine(engine: str) -> None:
    """`engine: vllm` online needs vLLM's native extraction (>= 0.18; the engine has no other way to stream):
    refused here, from the installed packages' metadata (nothing imported), before the run removes an earlier run's
    checkpoints or loads anything, not by the engine once started."""
    if engine != "vllm":
        return
    from kimi_eagle_host.engine import extract_vllm

    try:
        path, _, why = extract_vllm.choose_path()
    except Refused as e:
        raise BadInput(f"{e}; hidden_states online needs vLLM >= 0.18 (its native extraction)") from None
    if path != "native":
        raise BadInput(f"--engine vllm: hidden_states online needs vLLM >= 0.18 (its native extraction): {why}")


def ranks_per_engine(args, local_size: int, device_type: str) -> int:
    """How many of a host's trainer ranks one engine serves: the host's ranks / `online_engines`. Unset: tp_size
    ranks on CUDA (a target that fits one GPU gets an engine beside each GPU's rank: N GPUs extract N times as
    fast as one), the host's ranks on a CPU (engines there would share the same cores), in the split layout (the
    one engine on engine_gpus) or where tp_size does not divide the host's ranks."""
    engines, split = args.online_engines, parse_gpus(args.engine_gpus, "engine_gpus") is not None
    if engines is not None and split and engines != 1:
        raise BadInput(f"--online-engines {engines}: the split layout (engine_gpus) has one engine a host")
    if engines is not None and local_size % engines:
        raise BadInput(f"--online-engines {engines}: must divide the host's {local_size} trainer process(es)")
    return local_size // host_engines(local_size, args.tp_size, engines, split, device_type == "cuda")


def host_rows(plan, step: int, ranks: tuple[int, int, int] | None) -> list[list[int]]:
    """The rows of a step that a group of consecutive trainer ranks take (one engine's): ranks = (its first rank,
    how many, the world's size); rank r takes rows r, r + world, ... (packing.Plan.rank_rows). None: every row."""
    rows = plan.step_rows(step)
    if ranks is None:
        return rows
    first, count, size = ranks
    return [row for j, row in enumerate(rows) if first <= j % size < first + count]


def group_held(held_docs: list[int], held_plan, ranks: tuple[int, int, int] | None) -> list[int]:
    """The held-out documents a group of ranks evaluates (host_rows of the held-out plan's one pass), in held_docs'
    order: each engine extracts those its ranks read, not every engine all of them."""
    if ranks is None or held_plan is None:
        return list(held_docs)
    mine = {d for step in range(held_plan.steps_per_epoch) for row in host_rows(held_plan, step, ranks) for d in row}
    return [d for d in held_docs if d in mine]


def stream_entries(plan, first: int, last: int, held_docs: list[int], doc_bytes, cache_bytes: float,
                   cache_kind: int = CACHED, ranks: tuple[int, int, int] | None = None):
    """The engine's work in order, as (kinds, steps, docs) lists, and the set of cached documents: the held-out
    documents, then every document of steps first..last-1 that the host's ranks take (host_rows), in the order the
    trainer takes them. A document that comes again later is cached while the first of those fit in cache_bytes;
    it is extracted once, at its first position, as cache_kind (CACHED: kept in the spool; KEPT: kept by the
    trainer). On several hosts a later epoch may give a document to another host: it is cached only where it comes
    again on the same host."""
    kinds, steps, docs = [HELD] * len(held_docs), [0] * len(held_docs), list(held_docs)
    seen, cached, room = set(), set(), cache_bytes
    repeats = set()
    if cache_bytes > 0:   # which documents come again (worth keeping)
        for step in range(first, last):
            for row in host_rows(plan, step, ranks):
                repeats.update(d for d in row if d in seen)
                seen.update(row)
        seen = set()
    for step in range(first, last):
        for row in host_rows(plan, step, ranks):
            for d in row:
                if d in cached:
                    continue   # read from the cache
                if d in repeats and d not in seen and doc_bytes(d) <= room:
                    cached.add(d)
                    room -= doc_bytes(d)
                    kinds.append(cache_kind)
                else:
                    kinds.append(SPOOLED)
                seen.add(d)
                steps.append(step)
                docs.append(d)
    return (kinds, steps, docs), cached


# The trainer's own tensors, the engine and the page cache need the rest.
MEMORY_CACHE_SHARE = 0.8


def check_memory_cache(need: int, documents: int, available: int | None) -> None:
    """Refuse, before the engine starts, a cache in the trainer's memory the host cannot hold (an OOM kill hours
    in would lose the run)."""
    if available is not None and need > MEMORY_CACHE_SHARE * available:
        raise BadInput(f"--online-cache-gb: the {documents} documents it keeps need {need / 1e9:.1f} GB of the "
                       f"trainer's memory, and the host has {available / 1e9:.1f} GB available "
                       f"(at most {MEMORY_CACHE_SHARE:.0%} of it for the cache): lower online_cache_gb")


def check_spool_room(args, dc: dict, data, lengths: list[int], w, device_type: str) -> None:
    """Refuse (BadInput, one line) a run whose spools would not fit online_spool_dir's free space on this host:
    the held-out documents its ranks evaluate and a cache its ranks share stay there for the whole run, beside the
    buffer, and both grow with the data. Called by each host's first rank before the engine starts and before an
    earlier run's checkpoints are removed or the target loaded (a full /dev/shm is the host's memory, and the
    engine's ENOSPC could come hours in). `data` is the run's DataPlan. The cache counted is an upper bound: at most
    online_cache_gb, at most every training document, none for one epoch or where each trainer process keeps its
    own in memory; so is the buffer (spool_size.buffer_bytes, preflight's too): each engine's share of
    online_buffer_gb, or one engine batch of the longest documents where that is more (a batch always goes into an
    empty buffer). The folders of dead runs are swept
    first: this run would take their room anyway."""
    base = args.online_spool_dir
    group = ranks_per_engine(args, w.local_size, device_type)
    engines = w.local_size // group   # on this host
    n_layers, hidden = len(dc["layer_ids"]), dc["hidden_size"]
    itemsize = 4 if dc["dtype"] == "float32" else 2
    host = (w.rank - w.local_rank, w.local_size, w.size) if w.distributed else None
    held = group_held(data.held_docs, data.held, host)   # this host's ranks' (its engines' together)
    train_bytes = sum(document_bytes(lengths[d], n_layers, hidden, itemsize) for d in data.train_docs)
    cache = 0.0
    if group > 1 and data.total > data.plan.steps_per_epoch:
        cache = min(args.online_cache_gb * 1e9, train_bytes)
    longest = document_bytes(max(lengths[d] for d in data.train_docs), n_layers, hidden, itemsize)
    buffer = buffer_bytes(args.online_buffer_gb, engines, args.engine_batch_size, longest, train_bytes)
    need = spool_bytes(sum(lengths[d] + 1 for d in held), len(held), token_bytes(n_layers, hidden, itemsize), cache,
                       buffer)
    sweep_stale(base)
    try:
        st = os.statvfs(base)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if not st.f_blocks or need["total"] <= free:   # no size reported (procfs, some FUSE mounts): nothing to say
        return
    parts = [(need["held"], f"{len(held)} held-out documents",
              "steps.train.holdout_max_samples, steps.train.holdout_fraction"),
             (need["cache"], "the cache for later epochs", "online_cache_gb"),
             (need["buffer"], "the buffer", "online_buffer_gb" if args.online_buffer_gb * 1e9 / engines >=
              args.engine_batch_size * longest else
              "one batch of steps.train.engine_batch_size, more than online_buffer_gb: one always goes")]
    said = ", ".join(f"{what} {size(n)} ({setting})" for n, what, setting in parts if n)
    raise BadInput(f"online_spool_dir {base}: this run would keep {size(need['total'])} there and it has "
                   f"{size(free)} free; {said}: lower those settings, or set online_spool_dir to a folder with room")


def entry_name(kind: int, step: int, doc: int) -> str:
    """A stream entry's file under the spool: named by its position (step, document), so a document seen in two
    epochs never collides with itself."""
    if kind == HELD:
        return os.path.join("held", f"d_{doc}.safetensors")
    if kind == CACHED:
        return os.path.join("cache", f"d_{doc}.safetensors")
    return f"s_{step}_{doc}.safetensors"


# ----------------------------------------------------------------------------------------------------
# the spool

def sweep_stale(base: str) -> None:
    """Remove the spools of trainers that are gone (a SIGKILL leaves them), and what is left of a removal
    (<spool>.gone-*): ours, and only where we can take its lock (owner.lock), which its trainer holds while it
    lives. A lock says it across PID namespaces (a container sharing /dev/shm by --ipc=host, where the trainer's pid
    is not seen) and machines sharing the folder (another boot id), where a pid said nothing and a live run's
    spool was removed under it. A spool without the lock file is one being made (younger than a minute) or one an
    earlier version made (its owner.json's pid and boot id decide, as they did then)."""
    try:
        names = [n for n in os.listdir(base) if n.startswith(SPOOL_PREFIX)]
    except OSError:
        return
    for name in names:
        path = os.path.join(base, name)
        try:
            if os.stat(path).st_uid != os.geteuid():
                continue
        except OSError:
            continue
        free, lock = _take_lock(path)
        try:
            if free is None:
                free = _unowned(path)
            if free:
                remove_spool(path)
                log(f"online: removed {path}, the buffer of a run that is gone")
        finally:
            if lock is not None:
                os.close(lock)


def _take_lock(path: str) -> tuple[bool | None, int | None]:
    """(whether the spool's trainer is gone: True, we hold its lock now; False, it lives, or the file system takes no
    locks, where nobody can tell; None, no lock file), and the open lock to close once the spool is removed."""
    try:
        fd = os.open(os.path.join(path, OWNER_LOCK), os.O_RDWR)
    except FileNotFoundError:
        return None, None
    except OSError:
        return False, None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False, None
    return True, fd


def _unowned(path: str) -> bool:
    """A spool without a lock file: an earlier version's, whose owner.json names a trainer no longer running on this
    machine, or one whose making stopped before its lock (more than a minute old)."""
    try:
        with open(os.path.join(path, OWNER)) as f:
            owner = json.load(f)
        return not (owner.get("boot_id") == procfs.boot_id() and _owner_alive(owner))
    except (OSError, ValueError, KeyError, TypeError):
        return time.time() - _mtime(path) >= 60   # younger: being made right now


def hold_lock(spool: str) -> int:
    """The trainer's lock on its new spool, held (the open file) until the spool is removed: sweep_stale removes no
    spool whose lock it cannot take. The file is made aside, locked, then renamed into place, so no sweep finds it
    unlocked. On a file system without locks the spool is never swept (nobody can tell it is dead)."""
    aside = os.path.join(spool, f".{OWNER_LOCK}.{os.getpid()}")
    fd = os.open(aside, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        pass
    os.rename(aside, os.path.join(spool, OWNER_LOCK))
    return fd


def remove_spool(path: str) -> None:
    """Remove a spool: first moved aside in one step (<spool>.gone-<pid>), so that a writer still running (the
    engine's threads, its engine.json) fails on the missing folder instead of adding files while rmtree empties it,
    which left the folder behind; then deleted. A later sweep removes what an interrupted deletion leaves."""
    aside = path if GONE in os.path.basename(path) else f"{path}{GONE}{os.getpid()}"
    try:
        if aside != path:
            os.rename(path, aside)
    except FileNotFoundError:
        return
    except OSError:
        aside = path
    shutil.rmtree(aside, ignore_errors=True)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def kill_marked(spool: str) -> list[int]:
    """SIGKILL our processes whose environment names this spool (the engine's leftovers); their pids."""
    mark = f"{SPOOL_ENV}={spool}".encode()
    killed = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != os.geteuid():
                continue
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark not in f.read().split(b"\0"):
                    continue
            os.kill(int(name), signal.SIGKILL)
            killed.append(int(name))
        except OSError:
            continue
    if killed:
        log(f"online: stopped what the engine left running (pids {killed})")
    return killed


def _owner_alive(owner: dict) -> bool:
    """The trainer that made a spool still runs: its pid lives and, where recorded, started when that trainer did
    (a later process given the number must not keep a dead run's buffer in memory forever)."""
    st = procfs.stat(int(owner["pid"]))
    return st is not None and st.alive and owner.get("start_ticks") in (None, st.start_ticks)


def gpu_env(env: dict, gpus: list[int] | None, what: str) -> dict:
    """env with CUDA_VISIBLE_DEVICES narrowed to `gpus` (indices among those visible now)."""
    if gpus is None:
        return env
    ids = cuda_visible_names(env) or None   # none named (or all hidden): the indices as given
    if ids is not None and max(gpus) >= len(ids):
        raise BadInput(f"{what} {gpus}: only {len(ids)} GPU(s) visible "
                       f"(CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']})")
    return {**env, "CUDA_VISIBLE_DEVICES": ",".join(ids[g] if ids else str(g) for g in gpus)}


def split_gpus(args) -> None:
    """The split layout, before anything touches CUDA: the engine's CUDA_VISIBLE_DEVICES (args.engine_visible,
    from `engine_gpus`) and this trainer's own (narrowed to `train_gpus`), both among the GPUs visible now."""
    args.engine_visible = None
    if args.hidden_states != "online":
        return
    engine = parse_gpus(args.engine_gpus, "engine_gpus")
    if engine is not None:
        args.engine_visible = gpu_env(dict(os.environ), engine, "engine_gpus")["CUDA_VISIBLE_DEVICES"]
    train = parse_gpus(args.train_gpus, "train_gpus")
    if train is not None:
        os.environ.update(gpu_env(dict(os.environ), train, "train_gpus"))


def parse_gpus(text, what: str) -> list[int] | None:
    try:
        return gpu_numbers(text)
    except ValueError as e:
        raise BadInput(f"--{what.replace('_', '-')} {text}: {e}") from None


def start(args, dc: dict, plan, held_docs: list[int], held_plan, first: int, last: int, lengths: list[int], device,
          w, gather) -> "Source":
    """The engine and its buffer for steps first..last-1 of this run (a context manager: closing it stops both).
    Under torchrun every rank calls it: the first rank of each engine's group (ranks_per_engine) starts the engine,
    which extracts the rows its group's ranks take and the held-out documents they evaluate (of held_plan, the
    held-out pass) into a spool in the host's memory;
    `gather` (every rank's value, in rank order, on every rank: the trainer's collective) tells the group's other
    ranks the spool and every rank whether every engine started. Engines add up: N of them extract at once
    (torchrun numbers a host's ranks contiguously, its first one LOCAL_RANK 0)."""
    return Source(args, dc, plan, held_docs, held_plan, first, last, lengths, device.type, w, gather)


class Source:
    """The trainer's side of the spool: start the host's engine (its first rank), hand out each step's documents as
    they appear, stop the engine and remove the spool on close (use it as a context manager)."""

    def __init__(self, args, dc: dict, plan, held_docs: list[int], held_plan, first: int, last: int,
                 lengths: list[int], device_type: str, w, gather):
        # a group's first rank starts and stops its engine; the group's ranks take its rows (host_rows)
        self.group = ranks_per_engine(args, w.local_size, device_type)
        self.args, self.main = args, w.local_rank % self.group == 0
        self.first_rank = w.rank - w.local_rank % self.group
        self.engines, here = w.size // self.group, w.local_size // self.group   # in the run, on this host
        self.proc = self.engine_pid = self.spool = self.lock = None
        self.waited_s = 0.0
        self.closed = False
        self.steps_abandoned = False   # the loop has stopped: its readers ahead stop waiting (abandon_steps)
        self.copy_to = os.environ.get(COPY_ENV)
        itemsize = 4 if dc["dtype"] == "float32" else 2
        n_layers, hidden = len(dc["layer_ids"]), dc["hidden_size"]
        # An engine of one trainer process has it keep the cache in its own memory; several share it as files in the
        # spool (a later epoch may hand a document to another of the group's ranks). The host's buffer and cache
        # are shared out among its engines.
        self.in_memory = self.group == 1
        self.buffer_bytes = int(args.online_buffer_gb * 1e9 / here)
        ranks = (self.first_rank, self.group, w.size) if w.distributed else None
        held_docs = group_held(held_docs, held_plan, ranks)
        stream, self.cached = stream_entries(   # every rank knows the stream (which documents are kept)
            plan, first, last, held_docs, lambda d: document_bytes(lengths[d], n_layers, hidden, itemsize),
            args.online_cache_gb * 1e9 / here, KEPT if self.in_memory else CACHED, ranks)
        self.first_step = {d: step for kind, step, d in zip(*stream) if kind == KEPT}
        if self.in_memory:
            from kimi_eagle_host.vllm_compat import host_memory_available

            available = host_memory_available()[0]
            check_memory_cache(sum(document_bytes(lengths[d], n_layers, hidden, itemsize) for d in self.cached),
                               len(self.cached), available // here if available else None)
        self.memory: dict[int, _Kept] = {}
        self.memory_lock = threading.Lock()
        self.held = HeldFiles(self, held_docs)
        self.to_produce = len(stream[2])
        failed = None
        if self.main:
            try:
                self._make_spool(stream)
                self._start_engine(dc, device_type, w.local_rank, w.local_size)
            except BaseException as e:   # said to the other ranks first: none is left waiting for a spool
                failed = e
        # every rank learns its engine's spool, and whether every engine started: one that failed fails the run on
        # every host, not a hang in the next collective
        mine = (self.main, self.spool if failed is None else None)
        spools = gather(mine) if w.distributed else [mine]
        if failed is not None:
            self.close()
            raise failed
        down = [rank for rank, (main, spool) in enumerate(spools) if main and spool is None]
        if down:
            self.close()
            raise Refused(f"online: the engine did not start on the host of rank {down[0]} (its error is in that "
                          "host's log)")
        if not self.main:
            self.spool = spools[self.first_rank][1]
            with open(os.path.join(self.spool, ENGINE_PID)) as f:
                self.engine_pid = int(f.read())

    def _make_spool(self, stream) -> None:
        import numpy as np

        base = self.args.online_spool_dir
        sweep_stale(base)
        job = os.environ.get("KIMI_EAGLE_JOB_ID", "")
        try:
            self.spool = tempfile.mkdtemp(prefix=SPOOL_PREFIX + (f"{job}-" if job else ""), dir=base)
        except OSError as e:
            raise Refused(f"online: the buffer's folder cannot be made in online_spool_dir {base}: "
                          f"{e.strerror or e}") from None
        self.lock = hold_lock(self.spool)
        with open(os.path.join(self.spool, OWNER), "w") as f:
            json.dump({"pid": os.getpid(), "boot_id": procfs.boot_id(),
                       "start_ticks": procfs.stat(os.getpid()).start_ticks, "host": socket.gethostname()}, f)
        for sub in ("held", "cache"):
            os.makedirs(os.path.join(self.spool, sub))
        np.save(os.path.join(self.spool, STREAM), np.array(stream, dtype=np.int64).T.reshape(-1, 3))

    def _start_engine(self, dc: dict, device_type: str, local_rank: int, local_size: int) -> None:
        a = self.args
        cmd = [sys.executable, "-m", "kimi_eagle_host.engine.stream_producer", "--spool", self.spool,
               "--model", a.model, "--prepared-dir", os.path.join(os.path.abspath(a.output_dir), "prepared"),
               "--engine", a.engine, "--layer-ids", ",".join(map(str, dc["layer_ids"])), "--seq-len", str(a.seq_len),
               "--dtype", dc["dtype"], "--device", device_type, "--batch-size", str(a.engine_batch_size),
               "--tp-size", str(a.tp_size), "--buffer-bytes", str(self.buffer_bytes),
               "--bytes-per-token", str(document_bytes(0, len(dc["layer_ids"]), dc["hidden_size"],
                                                      4 if dc["dtype"] == "float32" else 2) - 256),
               "--parent", str(os.getpid())]
        env = {**os.environ, SPOOL_ENV: self.spool}   # marks the engine and every process it starts (vLLM's)
        gpus = None   # the engine's own GPUs, where they are not the trainer's
        if getattr(a, "engine_visible", None) is not None:   # split_gpus: the engine's own GPUs
            gpus = a.engine_visible
        else:   # co-located: the engine leaves this trainer the rest of its GPU
            cmd.append("--beside-trainer")
            if self.group < local_size:   # one of the host's engines: its group's GPUs (named on a CPU too)
                names = cuda_visible_names(env) or [str(i) for i in range(local_size)]
                gpus = ",".join(names[local_rank:local_rank + self.group])
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)   # not a torchrun worker: its engine (vLLM) must not join our process group
        # Its log lines go to ours (stderr); its stdout too: ours carries only the step's JSON answer.
        self.proc = subprocess.Popen(cmd, stdout=sys.stderr, env=env)
        self.engine_pid = self.proc.pid
        with open(os.path.join(self.spool, ENGINE_PID), "w") as f:
            f.write(str(self.proc.pid))
        log(f"online: engine {a.engine} started (pid {self.proc.pid}) for {self.to_produce} documents "
            f"({len(self.held)} held out)"
            + (f" on GPU(s) {gpus}" if gpus else "") + f"; buffer {self.buffer_bytes / 1e9:g} GB in {self.spool}"
            + (f", {len(self.cached)} documents cached for later epochs "
               f"({'in the trainer' if self.in_memory else 'in the spool'})" if self.cached else ""))

    # --- handing out documents ------------------------------------------------------------------------
    def for_step(self, step: int) -> "StepFiles":
        return StepFiles(self, step)

    def abandon_steps(self) -> None:
        """The training loop has stopped (its end, a stop, a divergence): readers of later steps stop waiting. The
        engine may never write their documents: it writes in stream order, and the group's other ranks no longer
        take theirs, so the buffer stays full. The held-out documents (written first) are still handed out."""
        self.steps_abandoned = True

    def wait_for(self, path: str, for_steps: bool = False) -> str:
        """`path` once the engine has written it; the engine's failure is raised here (Refused: one line)."""
        delay = 0.001
        while not os.path.exists(path):
            if self.closed or (for_steps and self.steps_abandoned):
                raise RuntimeError("online: the buffer was closed")
            self._check_engine(path)
            time.sleep(delay)
            delay = min(2 * delay, 0.05)
        if self.copy_to:   # test-only: what reached the trainer, compared with extract's files
            shutil.copy(path, os.path.join(self.copy_to, os.path.basename(path)))
        return path

    def trainer_waited(self, seconds: float) -> None:
        """The trainer's loop was held `seconds` for a step's rows (step_batches: its own wait, not its readers')."""
        self.waited_s += seconds

    def kept(self, d: int, step: int) -> dict:
        """Document d's tensors from this process's memory (in_memory's cache): read from its file at its first
        position, which is then deleted, and from memory at the later ones. A filler thread of a later step that
        gets there first waits for the one filling the first position."""
        from kimi_eagle_host.data.packing import map_sample

        with self.memory_lock:
            entry = self.memory.setdefault(d, _Kept())
            first = step == self.first_step.get(d) and not entry.claimed
            entry.claimed = entry.claimed or first
        if first:
            try:
                path = self.wait_for(os.path.join(self.spool, entry_name(KEPT, step, d)), for_steps=True)
                entry.tensors = {k: v.clone() for k, v in map_sample(path).items()}   # off the file's pages
                take(path)
            except BaseException as e:
                entry.error = e
                raise
            finally:
                entry.ready.set()
        while not entry.ready.wait(0.05):
            if self.closed or self.steps_abandoned:
                raise RuntimeError("online: the buffer was closed")
        if entry.error is not None:
            raise RuntimeError(f"online: document {d}, kept for later epochs, was not read: {entry.error}")
        return entry.tensors

    def _check_engine(self, path: str) -> None:
        if not os.path.exists(os.path.join(self.spool, OWNER_LOCK)):   # nothing will come: said, not waited for
            raise Refused(f"online: the buffer's folder {self.spool} was removed while this run used it (by hand, or "
                          "by a program that took it for a dead run's); its documents are lost: run again, with "
                          "--resume to continue from the last checkpoint")
        err = os.path.join(self.spool, ENGINE_ERROR)
        if os.path.exists(err):
            with open(err) as f:
                raise Refused(f"online: the engine failed: {f.read().strip()}")
        if self.proc is not None:
            rc = self.proc.poll()
        else:   # the host's engine, started by its first rank: gone, or a zombie that rank has not reaped yet
            engine = procfs.stat(self.engine_pid)
            rc = None if engine is not None and engine.alive else "unknown"
        if rc is not None and not os.path.exists(path):
            if os.path.exists(err):
                return self._check_engine(path)
            raise Refused(f"online: the engine (pid {self.engine_pid}) exited with code {rc} before writing "
                          f"{os.path.relpath(path, self.spool)} (its log lines are above)")

    def figures(self) -> dict:
        """The engine's tokens/s, the buffer's fill and who waited for whom, for the progress line and tracker."""
        try:
            with open(os.path.join(self.spool, ENGINE_FIGURES)) as f:
                eng = json.load(f)
        except (OSError, ValueError):
            eng = {}
        secs = eng.get("seconds") or 0
        return {"engine_tok_s": round(eng["tokens"] / secs, 1) if secs and eng.get("tokens") else None,
                "buffer_fill": round(eng.get("buffer_bytes", 0) / self.buffer_bytes, 3),
                "engine_wait_s": round(eng.get("waited_s", 0.0), 2), "trainer_wait_s": round(self.waited_s, 2),
                # the most hidden-state bytes the spool held at once: the run's footprint (offline: every file)
                "spool_peak_bytes": eng.get("spool_peak_bytes")}

    def run_figures(self, w, gather) -> dict:
        """figures() for the whole run: with several engines (every rank calls it then; gather is the trainer's
        collective) their tokens/s added up and, of their buffers, the fullest and the longest waits; the spool peak
        of the host whose engines' spools held the most together (each host's memory holds its own), with `engines`
        = how many; with one engine its own."""
        if self.engines == 1:
            return self.figures()
        mine = (w.rank // w.local_size, self.figures()) if self.main else None   # torchrun: a host's ranks contiguous
        each = [x for x in gather(mine) if x is not None]
        rates = [f["engine_tok_s"] for _, f in each if f["engine_tok_s"] is not None]
        per_host: dict = {}
        for host, f in each:
            if f["spool_peak_bytes"] is not None:
                per_host[host] = per_host.get(host, 0) + f["spool_peak_bytes"]
        return {"engine_tok_s": round(sum(rates), 1) if rates else None,
                **{k: max(f[k] for _, f in each) for k in ("buffer_fill", "engine_wait_s", "trainer_wait_s")},
                "spool_peak_bytes": max(per_host.values()) if per_host else None, "engines": len(each)}

    # --- the end ----------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the engine (SIGINT, then SIGKILL after STOP_GRACE_S) and remove the spool."""
        self.closed = True
        if not self.main:
            return   # the group's first rank stops its engine and removes its spool
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.spool is not None:
            kill_marked(self.spool)   # an engine that died hard leaves its own children (vLLM's EngineCore)
            remove_spool(self.spool)
        if self.lock is not None:   # only now: no sweep takes the spool while we remove it
            os.close(self.lock)
            self.lock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def take(path: str) -> None:
    """A document the trainer has read leaves the buffer: the tombstone first, so that at every moment the file or
    its tombstone exists (the engine counts either as written)."""
    open(taken_path(path), "w").close()
    os.unlink(path)


class _Kept:
    """A document in the trainer's memory cache: its tensors once the first position's reader has them."""

    def __init__(self):
        self.ready = threading.Event()
        self.claimed = False
        self.tensors: dict | None = None
        self.error: BaseException | None = None


class StepFiles:
    """One step's documents: files[d] waits for document d's file, sample(d) gives its tensors; done(d) lets it
    go (unless kept)."""

    def __init__(self, source: Source, step: int):
        self.source, self.step = source, step

    def _path(self, d: int) -> str:
        kind = CACHED if d in self.source.cached else SPOOLED
        return os.path.join(self.source.spool, entry_name(kind, self.step, d))

    def __getitem__(self, d: int) -> str:
        return self.source.wait_for(self._path(d), for_steps=True)

    def sample(self, d: int) -> dict:
        """Document d's tensors (packing.map_sample's): kept in memory, or mapped from its file."""
        if self.source.in_memory and d in self.source.cached:
            return self.source.kept(d, self.step)
        from kimi_eagle_host.data.packing import map_sample

        return map_sample(self[d])

    def done(self, d: int) -> None:
        if d not in self.source.cached:
            take(self._path(d))


class HeldFiles:
    """The held-out documents: extracted first and kept for the run (a plan of its own evaluates them)."""

    def __init__(self, source: Source, docs: list[int]):
        self.source, self.docs = source, set(docs)

    def for_step(self, step: int) -> "HeldFiles":
        return self

    def trainer_waited(self, seconds: float) -> None:
        self.source.trainer_waited(seconds)

    def __getitem__(self, d: int) -> str:
        return self.source.wait_for(os.path.join(self.source.spool, entry_name(HELD, 0, d)))

    def __len__(self) -> int:
        return len(self.docs)
