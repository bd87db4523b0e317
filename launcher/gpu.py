"""gpu-reset: find, stop and verify every GPU holder on a host, stopping only ours unless told.

The work happens on the host in one uploaded script (remote_payloads/ops/gpu_reset.py), which gathers
holders from both fuser and nvidia-smi, signals, and verifies memory came back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .errors import KimiEagleError
from .host import RUNS, HostSession


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


def reset_args(session: HostSession, *, stop_all=False, dry_run=False, grace=10.0, timeout=60.0,
               require_gpu=False, extra=None) -> list[str]:
    args = ["--runs-dir", RUNS, "--grace", str(grace), "--timeout", str(timeout)]
    if stop_all:
        args.append("--all")
    if dry_run:
        args.append("--dry-run")
    if require_gpu:
        args.append("--require-gpu")
    return args + list(extra or [])


def reset(session: HostSession, **kw) -> ResetResult:
    res = session.run_payload("gpu-reset", "ops/gpu_reset.py", reset_args(session, **kw))
    return ResetResult(session.name, res.exited, res.data)


def plan(session: HostSession, **kw) -> ResetResult:
    return reset(session, **{**kw, "dry_run": True})


def reset_before_run(session: HostSession, printer) -> ResetResult:
    """`run --reset-gpus`: free only our own stale holders; fail if memory stays held."""
    result = reset(session)
    for h in result.holders:
        if h.get("owner") == "ours":
            printer(f"gpu-reset: pid {h.get('pid')} ({h.get('cmd', '')[:60]}): {h.get('result')}")
    if not result.ok:
        raise KimiEagleError(f"{session.name}: GPU memory is still held after reset: {result.data.get('note') or result.data.get('error') or ''}",
                             result=result)
    return result
