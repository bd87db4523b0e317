"""gpu-reset: find, stop and verify every GPU holder on a host, stopping only ours unless told.

The work happens on the host in one host module (kimi_eagle_host/ops/gpu_reset.py), which gathers
holders from both fuser and nvidia-smi, signals, and verifies memory came back.
"""

from __future__ import annotations

import posixpath
from dataclasses import dataclass, field

from ..errors import ConfigError, KimiEagleError
from ..hosts.session import RUNS, HostSession


@dataclass
class ResetResult:
    host: str
    exited: int
    data: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.exited == 0

    @property
    def holders(self) -> list[dict]:
        return self.data.get("holders", [])

    @property
    def still_held(self) -> list[dict]:
        """Holders still alive after the reset (kept: foreign without --all, a running job's, or survivors)."""
        return [h for h in self.holders if h.get("result") in ("still-running", "d-state", "not-visible")]

    def verdict(self) -> str:
        """One line for the end of a reset: free, or what still holds a GPU."""
        if not self.ok:
            return f"NOT free after {self.data.get('elapsed_s')}s"
        held = self.still_held
        if not held:
            return f"verified free after {self.data.get('elapsed_s')}s"
        return "stopped what was ours; still held by " + "; ".join(
            f"pid {h.get('pid')} ({h.get('owner')}, {h.get('user') or '?'}, {(h.get('cmd') or '')[:40]!r}, GPU "
            f"{','.join(map(str, h.get('gpu') or [])) or '?'})" for h in held)


# Where GPU device nodes live. The host checks what each path is (a character device of a GPU driver); this is
# the early check of the name, before any host is contacted.
GPU_NODE_PREFIXES = ("/dev/nvidia", "/dev/dri/")


def check_device_paths(paths: list[str]) -> None:
    """--device-path values: GPU device nodes or globs of them, else one ConfigError (fuser on /dev/null would
    list every process of the host as a GPU holder)."""
    for path in paths:
        if not posixpath.normpath(path).startswith(GPU_NODE_PREFIXES):
            raise ConfigError(f"--device-path {path}: not a GPU device node (expected /dev/nvidia*, "
                              f"/dev/dri/card* or /dev/dri/renderD*)")


def reset_args(session: HostSession, *, stop_all=False, dry_run=False, grace=10.0, timeout=60.0,
               require_gpu=False, stale_only=False, extra=None) -> list[str]:
    # The runs folder by its full path: a dry run on a host without the workdir runs in / (hosts/stdin_payload.py).
    args = ["--runs-dir", session.path(RUNS), "--grace", str(grace), "--timeout", str(timeout)]
    if stale_only:
        args.append("--stale-only")
    if stop_all:
        args.append("--all")
    if dry_run:
        args.append("--dry-run")
    if require_gpu:
        args.append("--require-gpu")
    return args + list(extra or [])


def only_pid_arg(item) -> str:
    """One --only-pids item: PID, or PID:START from (pid, start_ticks) (start None: any process of that pid)."""
    pid, start = item if isinstance(item, (tuple, list)) else (item, None)
    return f"{int(pid)}" if start is None else f"{int(pid)}:{int(start)}"


def reset(session: HostSession, **kw) -> ResetResult:
    res = session.run_payload("gpu-reset", "ops.gpu_reset", reset_args(session, **kw))
    return ResetResult(session.name, res.exited, res.data)


def plan(session: HostSession, **kw) -> ResetResult:
    return reset(session, **{**kw, "dry_run": True})


def reset_before_run(session: HostSession, printer, wants_gpu: bool = True) -> ResetResult:
    """`run --reset-gpus`: free only our own stale holders (of ended or lost jobs, what an `ending` job's shell left,
    or outside any job); never a running job's. A running GPU job means the new run is refused with the lock
    message, and nothing is stopped."""
    from ..jobs import direct

    if wants_gpu:
        direct.refuse_if_locked(session, ending_ok=True)
    result = reset(session, stale_only=True)
    for h in result.holders:
        if h.get("owner") == "ours":
            printer(f"gpu-reset: pid {h.get('pid')} ({h.get('cmd', '')[:60]}): "
                    f"{'kept, job ' + str(h.get('job_id')) + ' is running' if h.get('job_running') else h.get('result')}")
    if not result.ok:
        raise KimiEagleError(f"{session.name}: GPU memory is still held after reset: {result.data.get('note') or result.data.get('error') or ''}",
                             result=result)
    return result
