"""The shape of one host's part of a job: plain, extraction shards, or one node of a torchrun job.

A group job (launcher/groupjobs.py) gives each host a Shape; the job script of that host (direct or Slurm) is
the pipeline plan with the shape applied. torchrun and the payload do the distributed work; we only say
which ranks, how many nodes, and where the rendezvous is.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from .errors import ConfigError
from .pipeline import Step

# Steps whose command takes --rank/--world-size and writes a disjoint part of the output.
SHARDABLE = {"extract", "exec"}  # exec: the command gets --rank R --world-size W appended
# Steps that run under torchrun on several nodes.
DISTRIBUTED = {"train", "exec"}


@dataclass
class Torchrun:
    """One node's torchrun: c10d rendezvous at `endpoint` (the group's first host), `nproc` processes here."""

    nnodes: int
    node_rank: int
    nproc: int
    endpoint: str  # ADDRESS:PORT
    rdzv_id: str
    is_host: bool = False  # this node serves the rendezvous store (explicit: on loopback every node matches)

    def argv(self) -> list[str]:
        # No --node-rank: c10d ignores it (and warns); node ranks come from the rendezvous, the store is on is_host.
        return ["-m", "torch.distributed.run", "--nnodes", str(self.nnodes),
                "--nproc-per-node", str(self.nproc), "--rdzv-backend", "c10d", "--rdzv-endpoint", self.endpoint,
                "--rdzv-id", self.rdzv_id, "--rdzv-conf", f"is_host={'true' if self.is_host else 'false'}",
                "--max-restarts", "0"]


@dataclass
class Shape:
    ranks: list[int] = field(default_factory=list)  # extraction shards this host runs, one process (one GPU) each
    world_size: int | None = None
    torchrun: Torchrun | None = None
    devices_per_rank: int = 1  # GPUs one shard process sees (CUDA_VISIBLE_DEVICES); 0 on CPU hosts

    def describe(self) -> str:
        if self.torchrun:
            t = self.torchrun
            return f"node {t.node_rank}/{t.nnodes}, {t.nproc} proc, rendezvous {t.endpoint}"
        if self.ranks:
            return f"ranks {_ranges(self.ranks)} of {self.world_size}"
        return ""


def _ranges(ranks: list[int]) -> str:
    return f"{ranks[0]}" if len(ranks) == 1 else f"{ranks[0]}-{ranks[-1]}"


def apply(steps: list[Step], step: str, shape: Shape | None) -> list[Step]:
    """The plan's steps with the shape applied to the step that does the work (the last one)."""
    if shape is None or (not shape.ranks and shape.torchrun is None):
        return steps
    *before, main = steps
    if shape.ranks:
        if step not in SHARDABLE:
            raise ConfigError(f"`{step}` cannot be sharded across hosts (only {', '.join(sorted(SHARDABLE))})")
        branches = []
        for i, rank in enumerate(shape.ranks):
            env = {}
            if shape.devices_per_rank and len(shape.ranks) > 1:
                first = i * shape.devices_per_rank
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(first + d) for d in range(shape.devices_per_rank))
            branches.append(replace(main, env=env, argv=[*main.argv, "--rank", str(rank), "--world-size", str(shape.world_size)]))
        if len(branches) == 1:
            return [*before, branches[0]]
        return [*before, replace(main, name=f"{main.name} x{len(branches)}", branches=branches)]
    if step not in DISTRIBUTED:
        raise ConfigError(f"`{step}` does not run under torchrun across hosts (only {', '.join(sorted(DISTRIBUTED))})")
    # `exec` under torchrun: the command after -- is a Python script and its arguments.
    return [*before, replace(main, python=True, argv=[*shape.torchrun.argv(), *main.argv])]


def shard_weights(hosts, by: str) -> list[int]:
    """Ranks per host: one each (`by=hosts`), or the host's `gpus` (`by=gpus`, every host must say how many)."""
    if by == "hosts":
        return [1] * len(hosts)
    if by == "gpus":
        missing = [h.name for h in hosts if not h.gpus]
        if missing:
            raise ConfigError(f"--shard-by gpus: host {missing[0]!r} has no `gpus:` count in the inventory")
        return [h.gpus for h in hosts]
    raise ConfigError(f"--shard-by {by!r}: choose hosts or gpus")


def shard_shapes(hosts, by: str = "hosts") -> list[Shape]:
    """Contiguous rank ranges: host i gets weight_i consecutive ranks out of sum(weights)."""
    weights = shard_weights(hosts, by)
    world, start, shapes = sum(weights), 0, []
    for w in weights:
        shapes.append(Shape(ranks=list(range(start, start + w)), world_size=world, devices_per_rank=1 if by == "gpus" else 0))
        start += w
    return shapes


def torchrun_shapes(hosts, rdzv_id: str) -> list[Shape]:
    """One torchrun node per host; the rendezvous is on the first host (its rdzv_address and rdzv_port)."""
    head = hosts[0]
    endpoint = f"{rdzv_address(head)}:{head.rdzv_port}"
    return [Shape(torchrun=Torchrun(nnodes=len(hosts), node_rank=i, nproc=max(h.gpus or 1, 1), endpoint=endpoint,
                                    rdzv_id=rdzv_id, is_host=(i == 0)))
            for i, h in enumerate(hosts)]


def rdzv_address(host) -> str:
    """Where the other hosts reach this one: `rdzv_address`, else the SSH address."""
    return host.rdzv_address or host.address
