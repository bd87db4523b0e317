"""What /proc says about a process, read once (stdlib only): jobs, gpu-reset, preflight and the online spool ask it.

A pid alone does not name a process for long: the kernel gives the number to a later one. The boot id and the
start time (clock ticks since boot) together do, so every caller that keeps a pid across calls keeps them too."""

from __future__ import annotations

from typing import NamedTuple


class ProcStat(NamedTuple):
    state: str          # R, S, D, Z, ... (Z: a zombie holds nothing, it waits for its parent to reap it)
    ppid: int
    pgid: int
    sid: int
    start_ticks: int    # field 22 of /proc/<pid>/stat

    @property
    def alive(self) -> bool:
        return self.state not in ("Z", "X")


def stat(pid) -> ProcStat | None:
    """The process's /proc/<pid>/stat, or None when there is no such process (or no /proc)."""
    if not isinstance(pid, int) or pid <= 0:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            raw = f.read()
        # comm may hold spaces and parentheses: the fields start after the last ')'.
        fields = raw[raw.rindex(")") + 2:].split()
        return ProcStat(fields[0], int(fields[1]), int(fields[2]), int(fields[3]), int(fields[19]))
    except (OSError, ValueError, IndexError):
        return None


def boot_id() -> str | None:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return None
