"""Which host runs a job started from this machine: a small local index (~/.cache/kimi-eagle/jobs.json), so
`logs JOB` needs no --host."""

from __future__ import annotations

import json
import os
from pathlib import Path


def _index_path() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "kimi-eagle" / "jobs.json"


def host_identity(host) -> dict:
    """What names one machine and workdir whatever an inventory calls it: another inventory file's entry for the
    same place finds the jobs started through this one."""
    return {"transport": host.transport, "address": host.address, "port": host.port, "user": host.user,
            "workdir": host.workdir}


def _read_index(p: Path) -> dict:
    try:
        index = json.loads(p.read_text()) if p.exists() else {}
    except (OSError, ValueError):
        index = {}
    return index if isinstance(index, dict) else {}


def _update(change) -> None:
    """change(index) under the lock, then the index written whole: two terminals starting jobs at once both stay
    recorded (a read-modify-write without the lock lost one)."""
    import fcntl

    p = _index_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_name(p.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index = _read_index(p)
        change(index)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(dict(list(index.items())[-500:])))
        os.replace(tmp, p)


def remember(job_id: str, host: str, identity: dict | None = None, *, starting: bool = False) -> None:
    """Record the job's host (and where that host is). `starting`: recorded before the host's answer to the start
    (a connection lost then leaves a job that may run); the answer records it again, unmarked."""
    def change(index):
        index.pop(job_id, None)
        record = {"host": host, "where": identity} if identity or starting else host
        if starting:
            record["starting"] = True
        index[job_id] = record

    _update(change)


def forget(job_id: str) -> None:
    """The job did not start (the host said so, or a Ctrl-C cancelled it before it ran)."""
    _update(lambda index: index.pop(job_id, None))


def recorded(job_id: str) -> dict | None:
    """{"host": name, "where": host_identity or None, "starting": bool} of a job started from this machine, else
    None; `starting`: its start lost the host's answer, so it may never have begun."""
    value = _read_index(_index_path()).get(job_id)
    if isinstance(value, str):
        return {"host": value, "where": None, "starting": False}
    if isinstance(value, dict) and isinstance(value.get("host"), str):
        return {"host": value["host"], "where": value.get("where"), "starting": value.get("starting") is True}
    return None


def start_unanswered(job_id: str) -> bool:
    """Whether this machine's start of the job lost the host's answer (so a host without the job: it never began)."""
    record = recorded(job_id)
    return bool(record and record["starting"])


def host_of(job_id: str) -> str | None:
    record = recorded(job_id)
    return record["host"] if record else None
