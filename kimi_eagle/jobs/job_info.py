"""A job as every scheduler reports it: its id, its state and what that state exits with, the stop's grace."""

from __future__ import annotations

import re
import secrets
import time
from dataclasses import dataclass, field

from ..errors import EXIT_FAILED, EXIT_OK, EXIT_RUNNING, EXIT_STOPPED, ConfigError

# What `logs --follow` and `status` exit with, by job state (documented in the README); `ending`: exit_code_of.
# `pending`: queued by a scheduler (Slurm), not started yet.
STATE_EXIT = {"succeeded": EXIT_OK, "failed": EXIT_FAILED, "running": EXIT_RUNNING, "pending": EXIT_RUNNING,
              "stopped": EXIT_STOPPED, "lost": EXIT_STOPPED,
              "unreadable": EXIT_FAILED}  # its meta.json is not readable JSON: shown with its id, others unaffected
# `ending`: the job's shell has exited (its code is known) while processes it started live on (an engine's worker,
# `cmd &`), holding what the job holds until they exit or `stop` ends them.
# The states a follow ends at: the job's shell runs no more (what an `ending` job left is named, not waited for).
TERMINAL = {"succeeded", "failed", "stopped", "lost", "unreadable", "ending"}
LIVE = ("running", "pending", "ending")  # what the job holds (the GPUs, its output folder) it still holds


def exit_code_of(state: str, exit_code: int | None = None) -> int:
    """What `logs` and `status JOB` exit with for a job: its state's code. An `ending` job's shell has exited, so its
    own code answers how the job went (0 or 1); that processes it left still run is the state's news, not a result."""
    if state == "ending":
        return EXIT_OK if exit_code == 0 else EXIT_FAILED
    return STATE_EXIT[state]


@dataclass
class Job:
    id: str
    host: str
    step: str | None = None
    state: str = "running"
    exit_code: int | None = None
    pid: int | None = None
    pgid: int | None = None
    started_at: float | None = None
    ended_at: float | None = None
    runtime_s: float | None = None
    headline: str | None = None  # a step's one-line result (eval: acceptance length, tokens/s)
    left: list[int] = field(default_factory=list)  # its processes alive without its shell (`ending`, or killed alone)
    log: str = ""
    log_size: int = 0
    run_dir: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_host(cls, host: str, d: dict) -> "Job":
        known = {k: d.get(k) for k in ("id", "step", "state", "exit_code", "pid", "pgid", "started_at", "ended_at",
                                        "runtime_s", "log", "log_size", "run_dir", "headline", "left")}
        return cls(host=host, **{k: v for k, v in known.items() if v is not None})

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(d.pop("extra"))  # the scheduler's details, e.g. a Slurm job's id and array tasks
        return d


def new_job_id(step: str, prefix: str = "") -> str:
    """When, what, and 32 random bits: two terminals starting one step in the same second draw the same id once in
    4 billion times (16 bits: once in 65,536), and the host refuses a start whose id it holds already."""
    return f"{prefix}{time.strftime('%Y%m%d-%H%M%S')}-{step}-{secrets.token_hex(4)}"


# A job id names a directory under the host's runs/: one path component, never an option or a parent.
_JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def check_job_id(job_id: str) -> str:
    """The job id unchanged, or a ConfigError (exit 2) before anything is contacted.

    An empty id used to list every job (and `stop` took the first), a relative or absolute one reached
    another workdir's job, and one starting with '-' reached the host's scripts as an option."""
    if not isinstance(job_id, str) or not _JOB_ID.fullmatch(job_id):
        raise ConfigError(f"job id {job_id!r}: not a job id (letters, digits, '.', '_', '-'; starting with a letter "
                          "or digit; no path separators); `kimi-eagle status` lists them")
    return job_id


# --grace (ops/jobs.py's bound too) and gpu-reset --timeout: an hour between SIGTERM and SIGKILL, or for processes to go
# and memory to free, is already generous; a longer wait is a typo, not a plan.
MAX_WAIT_S = 3600.0


def check_grace(grace: float) -> float:
    """`stop --grace`, `gpu-reset --grace`: finite seconds from 0 to an hour, else a ConfigError (nan, inf, 1e308
    would never end)."""
    return check_seconds("--grace", grace, "seconds between SIGTERM and SIGKILL", MAX_WAIT_S)


def check_seconds(flag: str, value: float, what: str, maximum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= maximum:  # nan too
        raise ConfigError(f"{flag} {value}: {what}, from 0 to {maximum:g}")
    return float(value)


