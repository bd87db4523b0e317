"""Rank awareness for pipeline steps run under torchrun (one process per GPU, or per GPU group) or alone.

torchrun (`python -m torch.distributed.run`, started by pipeline/launch.py) sets RANK, WORLD_SIZE,
LOCAL_RANK and LOCAL_WORLD_SIZE in each worker. A step asks `world()` where it stands, joins the
process group with `init()` and uses the helpers below; every one of them is a no-op in a world of
one, so the same code runs alone, under torchrun on one host, or across hosts.

Only `world()`, `stripe()` and `StopRequest` are needed before torch is imported: torch is imported
lazily, inside the functions that talk to the process group.
"""
from __future__ import annotations

import contextlib
import os
import signal
import sys
from dataclasses import dataclass

# Extraction ranks may wait at the final barrier for a slower rank for a long time (a resumed run where
# one rank has everything left to do); torchrun tears the group down when a worker dies, so a long
# timeout cannot hang a failed job.
LONG_TIMEOUT_S = 48 * 3600


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def world(environ=None) -> World:
    """This process's place, from torchrun's environment; a world of one when it is absent."""
    env = os.environ if environ is None else environ
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return World()
    try:
        w = World(int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", env["RANK"])),
                  int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])))
    except ValueError:
        raise ValueError(f"RANK/WORLD_SIZE/LOCAL_RANK/LOCAL_WORLD_SIZE must be integers, got "
                         f"{[env.get(k) for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')]}") from None
    if not (0 <= w.rank < w.size and 0 <= w.local_rank < w.local_size <= w.size):
        raise ValueError(f"inconsistent torchrun environment: {w}")
    return w


def stripe(items, rank: int, size: int) -> list:
    """Every size-th item from rank on: with items sorted by length, each rank gets the same mix of long
    and short ones (contiguous ranges of a length-sorted list would give one rank all the long ones)."""
    return list(items)[rank::size]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------
# the process group (torch imported lazily)

_state = {"device": None}


def init(w: World, backend: str, timeout_s: float = LONG_TIMEOUT_S) -> None:
    """Join the process group: gloo for CPU tensors, nccl for CUDA ones (then the collectives below use
    this rank's GPU, cuda:LOCAL_RANK). A world of one joins nothing."""
    if not w.distributed:
        return
    import datetime

    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return
    if backend == "nccl":
        torch.cuda.set_device(w.local_rank)
        _state["device"] = torch.device("cuda", w.local_rank)
    else:
        _state["device"] = torch.device("cpu")
    kwargs = {"device_id": _state["device"]} if backend == "nccl" else {}
    dist.init_process_group(backend=backend, timeout=datetime.timedelta(seconds=timeout_s), **kwargs)


def active() -> bool:
    if "torch" not in sys.modules:
        return False
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def barrier() -> None:
    if active():
        import torch.distributed as dist

        dist.barrier()


def all_sum(values):
    """Element-wise sum over the ranks of a list of numbers (float64 on the wire)."""
    if not active():
        return [float(v) for v in values]
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=_state["device"])
    dist.all_reduce(t)
    return t.tolist()


def all_reduce_(tensor) -> None:
    """Sum a device tensor over the ranks in place. The host does not wait for it (no .tolist()), so it can
    run every step without a host sync."""
    if active():
        import torch.distributed as dist

        dist.all_reduce(tensor)


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on one: all ranks then take the same branch (e.g. stop after
    this step), so none is left waiting in a collective the others skipped."""
    return all_sum([1.0 if flag else 0.0])[0] > 0


def gather(obj) -> list:
    """Every rank's `obj` (any picklable value), in rank order, on every rank."""
    if not active():
        return [obj]
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def shutdown(completed: bool = True) -> None:
    """Leave the process group. After a step that completed on this rank, wait for every rank first: a rank
    that tears gloo's connections down while a peer is still using them dies at exit with "terminate called
    without an active exception" (SIGABRT) even though its work is done — torchrun then reports the job
    failed. After a failure, leave at once: torchrun stops the peers."""
    if not active():
        return
    import torch.distributed as dist

    if completed:
        dist.barrier()
    dist.destroy_process_group()


def run_step_then_leave(name: str, fn, args, **kwargs) -> int:
    """step_runtime.run_step for a step torchrun may launch: the step, then shutdown() whatever happened."""
    from kimi_eagle_host.step_runtime import run_step

    code = 1
    try:
        code = run_step(name, fn, args, **kwargs)
        return code
    finally:
        shutdown(completed=code == 0)


# ----------------------------------------------------------------------------------------------------
# stop requests

class StopRequest:
    """Turns SIGTERM into a flag that a loop polls between steps, instead of dying mid-step.

    `kimi-eagle stop` sends SIGTERM to the job (torchrun passes it on to its workers, Slurm's scancel sends
    it too); the step finishes the current unit of work, saves, and exits before the SIGKILL that follows
    the grace period. Under torchrun, poll with `any_rank(stop.requested)` so all ranks stop together.
    """

    def __init__(self, signals=(signal.SIGTERM,)):
        self.signals = signals
        self.received = None
        self._old = {}

    @property
    def requested(self) -> bool:
        if self.received is None:
            # Under sparing_children() the signal waits in the pending set instead of reaching _handle.
            pending = signal.sigpending() & set(self.signals)
            if pending:
                signal.sigtimedwait(pending, 0)   # taken here: it must not act again when the block is lifted
                self._handle(min(pending), None)
        return self.received is not None

    def _handle(self, signum, frame):
        if self.received is None:
            self.received = signal.Signals(signum).name
            log(f"{self.received} received: finishing the current step, then saving a checkpoint")

    def __enter__(self):
        for s in self.signals:
            self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc):
        for s, old in self._old.items():
            signal.signal(s, old)
        return False


@contextlib.contextmanager
def sparing_children(signals=(signal.SIGTERM,)):
    """Keep `signals` blocked in this thread while the block runs, so that the processes started meanwhile
    (torch.compile's C++ compiler, Inductor's Triton compile workers) are born with them blocked too.

    Why: `kimi-eagle stop` (like timeout and Slurm) signals the job's whole process group. A compiler killed in
    the middle of a step turned a clean stop into a CppCompileError on a CPU; on an H200 the trainer was still
    running minutes after the signal (most likely Inductor waiting for its dead Triton workers) until the SIGKILL:
    no checkpoint either way. A StopRequest inside still sees the signal (it looks in the pending set). A signal
    left pending on the way out acts as it would have."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


# ----------------------------------------------------------------------------------------------------
# data-parallel training: wrapping a model, and checkpoints that load on any world size

def choose_sharding(setting: str, w: World, state_bytes: int, device) -> str:
    """'ddp' (a full replica per rank), 'fsdp' (parameters, gradients and optimizer state sharded over the
    ranks) or 'none' (one process). auto = fsdp when the trainable state would take more than 60% of one
    GPU (the rest is for activations, which grow with the batch and the vocabulary), else ddp."""
    if not w.distributed:
        return "none"
    if setting in ("ddp", "fsdp"):
        return setting
    if device.type != "cuda":
        return "ddp"
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    return "fsdp" if state_bytes > 0.6 * total else "ddp"


def wrap(model, mode: str, device):
    """The module to train. FSDP2 shards each submodule with parameters (for the draft: fc, the decoder
    layer, the lm_head) and the root, so only one submodule's full weights exist at a time."""
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        return DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
    if mode == "fsdp":
        from torch.distributed.fsdp import fully_shard

        from torch import nn

        # The big submodules get their own shard unit (gathered just for their forward/backward); the
        # small leftovers (norms) stay with the root. A ModuleList has no forward: its items are the units.
        # Modules the root's forward uses by their weights (the draft's lm_head, applied chunk by chunk inside
        # the loss) stay with the root too: a unit is gathered only when its own forward runs.
        keep = set(getattr(model, "fsdp_root_modules", ()))
        units = [m for name, child in model.named_children() if name not in keep
                 for m in (child if isinstance(child, nn.ModuleList) else [child])]
        for unit in units:
            if sum(p.numel() for p in unit.parameters()) >= 1 << 16 or isinstance(unit, nn.Linear):
                fully_shard(unit)
        fully_shard(model)
    return model


def unwrap(model):
    return getattr(model, "module", model)


def _torch_optimizer(opt):
    """The torch optimizer behind a wrapper holding several by name (FSDP runs have only AdamW)."""
    named = getattr(opt, "named", None)
    return named["adamw"] if named else opt


def _opts(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(full_state_dict=True, **kw)


def full_state(model, opt, mode: str, trainable_names: list[str]):
    """(model state, optimizer state) as a one-process run would save them (plain tensors; optimizer state
    keyed by parameter index), so a checkpoint loads on any world size and with or without FSDP.
    FSDP gathers the shards: every rank must call this; rank 0 gets the state, the others empty dicts."""
    if mode != "fsdp":
        return unwrap(model).state_dict(), opt.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    opt = _torch_optimizer(opt)
    msd = get_model_state_dict(model, options=_opts(cpu_offload=True))
    osd = get_optimizer_state_dict(model, opt, options=_opts(cpu_offload=True))
    if not osd:
        return msd, osd
    index = {n: i for i, n in enumerate(trainable_names)}
    return msd, {"state": {index[n]: s for n, s in osd["state"].items()},
                 "param_groups": [{**g, "params": [index[n] for n in g["params"]]} for g in osd["param_groups"]]}


def load_full_state(model, opt, mode: str, trainable_names: list[str], msd, osd) -> None:
    """Inverse of full_state: every rank passes the whole checkpoint (one host reads one file)."""
    if mode != "fsdp":
        unwrap(model).load_state_dict(msd)
        opt.load_state_dict(osd)
        return
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    opt = _torch_optimizer(opt)
    set_model_state_dict(model, msd, options=_opts())
    named = {"state": {trainable_names[i]: s for i, s in osd["state"].items()},
             "param_groups": [{**g, "params": [trainable_names[i] for i in g["params"]]} for g in osd["param_groups"]]}
    set_optimizer_state_dict(model, opt, named, options=_opts())
