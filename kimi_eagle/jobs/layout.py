"""The shape of one host's part of a job: plain, extraction shards, or one node of a multi-node torchrun job.

A group job (groups.py) gives each host a Shape; the host's job script (direct or Slurm) is the
pipeline plan with the shape applied. The processes themselves are decided on the host by
kimi_eagle_host.pipeline.launch (one process, or torchrun workers per GPU; c10d across nodes): we only say
which ranks a host owns, how many nodes there are and where the rendezvous is (docs/CONTRACTS.md).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..config.step_plan import Step
from ..errors import ConfigError
from ..hosts.session import module_argv

# Steps whose command takes --rank/--world-size and writes a disjoint part of the output
# (exec: the command gets --rank R --world-size W appended).
SHARDABLE = {"extract", "exec"}
# Steps that run as one torchrun job over several nodes (exec: the command is a Python script).
DISTRIBUTED = {"train", "exec"}
LAUNCHER = module_argv("pipeline.launch")  # after the host's Python
# An exec shard's command is not a step the launcher starts: this picks its GPUs the same way (pick_gpus), then runs it.
GPU_SLICE = module_argv("gpus")


@dataclass
class Torchrun:
    """One node of a c10d rendezvous at `endpoint` (the group's first host, which serves the store)."""

    nnodes: int
    node_rank: int
    endpoint: str  # ADDRESS:PORT
    rdzv_id: str
    is_host: bool = False  # explicit: on loopback every node would match the endpoint's address

    def launch_flags(self) -> list[str]:
        # No --node-rank: c10d assigns node ranks itself (and warns when given one).
        return ["--nnodes", str(self.nnodes), "--rdzv-endpoint", self.endpoint, "--rdzv-id", self.rdzv_id,
                "--rdzv-conf", f"is_host={'true' if self.is_host else 'false'}", "--max-restarts", "0"]


@dataclass
class Shape:
    ranks: list[int] = field(default_factory=list)  # extraction shards this host runs, one launch each
    world_size: int | None = None
    torchrun: Torchrun | None = None
    # GPUs each of several shards takes, its own slice of those the host's job sees (--gpus N --gpu-offset O,
    # chosen on the host by name); 0: leave them alone
    devices_per_rank: int = 0
    gpus: int | None = None  # the host's `gpus:` (launch.py --gpus) for a torchrun node (an exec has no plan's)

    def describe(self) -> str:
        if self.torchrun:
            t = self.torchrun
            return f"node {t.node_rank}/{t.nnodes}, rendezvous {t.endpoint}"
        if self.ranks:
            span = f"{self.ranks[0]}" if len(self.ranks) == 1 else f"{self.ranks[0]}-{self.ranks[-1]}"
            return f"ranks {span} of {self.world_size}"
        return ""


def split_launch(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the launcher's own flags, the command it starts); a command not started through it: ([], argv)."""
    n = len(LAUNCHER)
    if argv[:n] == LAUNCHER and "--" in argv:
        i = argv.index("--")
        return argv[n:i], argv[i + 1:]
    return [], list(argv)


def launched(argv: list[str]) -> bool:
    return argv[:len(LAUNCHER)] == LAUNCHER and "--" in argv


def merge_flags(own: list[str], flags: list[str]) -> list[str]:
    """The launcher's `own` flags with `flags` over them: each flag once (the plan's --gpus, the host's count, gives
    way to a shard's slice), the way argparse would read the two with the later winning. Both are `--name value`
    pairs (launch_flags and the shapes write no other kind)."""
    given = set(flags[::2])
    kept = [x for i in range(0, len(own), 2) if own[i] not in given for x in own[i:i + 2]]
    return [*kept, *flags]


def through_launcher(main: Step, flags: list[str]) -> Step:
    """`main` started by the launcher with more flags (an exec command becomes the script it runs)."""
    own, command = split_launch(main.argv)
    return replace(main, python=True, argv=[*LAUNCHER, *merge_flags(own, flags), "--", *command])


def shard_branch(main: Step, rank: int, world_size: int, gpu_slice: tuple[int, int] | None) -> Step:
    """One shard's command: the step with --rank/--world-size, and with `gpu_slice` (count, offset) its GPUs among
    those the host's job sees, picked there by name (launch.py, or kimi_eagle_host.gpus for an exec command): the
    host's CUDA_VISIBLE_DEVICES (e.g. 4,5,6,7 from its env) is where the slice is counted, not the machine's GPU 0."""
    shard = replace(main, argv=[*main.argv, "--rank", str(rank), "--world-size", str(world_size)])
    if gpu_slice is None:
        return shard
    flags = ["--gpus", str(gpu_slice[0]), "--gpu-offset", str(gpu_slice[1])]
    if launched(shard.argv):
        return through_launcher(shard, flags)
    # an exec shard: a whole command of the user's (no launcher, no step), run by the host's Python's helper
    return replace(shard, python=True, argv=[*GPU_SLICE, *flags, "--", *shard.argv])


def apply(steps: list[Step], step: str, shape: Shape | None) -> list[Step]:
    """The plan's steps with the shape applied to the step that does the work (the last one)."""
    if shape is None or (not shape.ranks and shape.torchrun is None):
        return steps
    *before, main = steps
    if shape.ranks:
        if step not in SHARDABLE:
            raise ConfigError(f"`{step}` cannot be sharded across hosts (only {', '.join(sorted(SHARDABLE))})")
        per = shape.devices_per_rank if len(shape.ranks) > 1 else 0   # one shard: the host's gpus (the plan's --gpus)
        branches = [shard_branch(main, rank, shape.world_size, (per, i * per) if per else None)
                    for i, rank in enumerate(shape.ranks)]
        if len(branches) == 1:
            return [*before, branches[0]]
        return [*before, replace(main, name=f"{main.name} x{len(branches)}", branches=branches)]
    if step not in DISTRIBUTED:
        raise ConfigError(f"`{step}` does not run under torchrun across hosts (only {', '.join(sorted(DISTRIBUTED))})")
    gpus = ["--gpus", str(shape.gpus)] if shape.gpus else []
    return [*before, through_launcher(main, [*gpus, *shape.torchrun.launch_flags()])]


def _replica_gpus(host) -> int:
    per = host.pipeline.gpus_per_replica
    return per if isinstance(per, int) else 1


def shard_shapes(hosts, by: str = "hosts") -> list[Shape]:
    """Contiguous rank ranges: one rank per host (`hosts`), or one per model replica the host's `gpus:` hold
    (`gpus`: gpus // pipeline.gpus_per_replica, each rank's launch seeing its own GPUs)."""
    if by == "hosts":
        weights, per = [1] * len(hosts), [0] * len(hosts)
    elif by == "gpus":
        missing = [h.name for h in hosts if not h.gpus]
        if missing:
            raise ConfigError(f"--shard-by gpus: host {missing[0]!r} has no `gpus:` count in the inventory")
        per = [_replica_gpus(h) for h in hosts]
        weights = [max(1, h.gpus // p) for h, p in zip(hosts, per)]
    else:
        raise ConfigError(f"--shard-by {by!r}: choose hosts or gpus")
    world, start, out = sum(weights), 0, []
    for w, p in zip(weights, per):
        out.append(Shape(ranks=list(range(start, start + w)), world_size=world, devices_per_rank=p))
        start += w
    return out


def torchrun_shapes(hosts, rdzv_id: str) -> list[Shape]:
    """One torchrun node per host; the rendezvous is on the first host (its rdzv_address and rdzv_port)."""
    endpoint = f"{rdzv_address(hosts[0])}:{rdzv_port(hosts[0])}"
    return [Shape(torchrun=Torchrun(nnodes=len(hosts), node_rank=i, endpoint=endpoint, rdzv_id=rdzv_id, is_host=(i == 0)),
                  gpus=h.gpus)
            for i, h in enumerate(hosts)]


# A group's rendezvous port where the inventory sets none (torchrun's own default).
DEFAULT_RDZV_PORT = 29500


def rdzv_port(host) -> int:
    """The port a group's first host serves the rendezvous on: `rdzv_port`, else DEFAULT_RDZV_PORT."""
    return host.rdzv_port or DEFAULT_RDZV_PORT


def rdzv_address(host) -> str:
    """Where the other hosts reach this one: `rdzv_address`, else the SSH address."""
    return host.rdzv_address or host.address
