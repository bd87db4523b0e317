"""Detached jobs on a host: start, status, stop. The host-side half is kimi_eagle_host/ops/jobs.py."""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

from . import interrupts, pipeline, render, job_layout
from .errors import EXIT_FAILED, EXIT_OK, EXIT_RUNNING, EXIT_STOPPED, CommandError, ConfigError, ConnectionFailed, KimiEagleError
from .host import PAYLOADS, RUNS, HostSession
from .shell import join

# What `logs --follow` and `status` exit with, by job state (documented in the README).
# `pending`: queued by a scheduler (Slurm), not started yet.
STATE_EXIT = {"succeeded": EXIT_OK, "failed": EXIT_FAILED, "running": EXIT_RUNNING, "pending": EXIT_RUNNING,
              "stopped": EXIT_STOPPED, "lost": EXIT_STOPPED,
              "unreadable": EXIT_FAILED}  # its meta.json is not readable JSON: shown with its id, others unaffected
TERMINAL = {"succeeded", "failed", "stopped", "lost", "unreadable"}


class LockHeld(KimiEagleError):
    exit_code = EXIT_FAILED


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
    log: str = ""
    log_size: int = 0
    run_dir: str = ""
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_host(cls, host: str, d: dict) -> "Job":
        known = {k: d.get(k) for k in ("id", "step", "state", "exit_code", "pid", "pgid", "started_at", "ended_at",
                                        "runtime_s", "log", "log_size", "run_dir", "headline")}
        return cls(host=host, **{k: v for k, v in known.items() if v is not None})

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d.update(d.pop("extra"))  # backend details, e.g. a Slurm job's id and array tasks
        return d


def new_job_id(step: str) -> str:
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{step}-{secrets.token_hex(2)}"


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


MAX_GRACE_S = 3600.0  # ops/jobs.py's bound: a stop waits at most an hour between SIGTERM and SIGKILL


def check_grace(grace: float) -> float:
    """`stop --grace`: finite seconds from 0 to an hour, else a ConfigError (nan, inf, 1e308 would never end)."""
    if not isinstance(grace, (int, float)) or not 0 <= grace <= MAX_GRACE_S:  # false for nan as well
        raise ConfigError(f"--grace {grace}: seconds between SIGTERM and SIGKILL, from 0 to {MAX_GRACE_S:g}")
    return float(grace)


def render_job(session: HostSession, step: str, extra: list[str], job_id: str = "JOB-ID",
               shape: job_layout.Shape | None = None) -> tuple[str, str]:
    """The job script as it will be uploaded: (path relative to the workdir, text)."""
    host = session.host
    run_rel = f"{RUNS}/{job_id}"
    steps = job_layout.apply(pipeline.plan_for_host(step, host, extra, job_id), step, shape)
    text = render.render(
        "job.sh.j2",
        job_id=job_id,
        job_id_quoted=json.dumps(job_id),
        host=host.name,
        step=step,
        run_dir=_under(host.workdir, run_rel),
        gpu_lock=_under(host.workdir, f"{RUNS}/gpu.lock"),
        env=host.env,
        workdir=host.workdir,
        python=host.python,
        payloads=PAYLOADS,
        steps=steps,
    )
    return f"{run_rel}/job.sh", text


def job_files(session: HostSession, step: str, extra: list[str], job_id: str = "JOB-ID",
              shape: job_layout.Shape | None = None) -> dict[str, str]:
    """What a direct job uploads, rendered once: its script and its settings.json (relative to the workdir)."""
    rel, text = render_job(session, step, extra, job_id, shape)
    return {rel: text, **pipeline.settings_file(step, session.host, extra, job_id)}


def _under(workdir: str, rel: str) -> str:
    return workdir.rstrip("/") + "/" + rel


def _jobctl(session: HostSession, args: list[str]) -> tuple[int, dict]:
    res = session.call("ops.jobs", ["--runs-dir", RUNS, *args])
    if res.exited == -1:  # the channel closed without an exit status: the connection dropped, not jobctl
        raise ConnectionFailed(f"{session.name}: connection lost during jobctl {args[0]}", result=res)
    try:
        return res.exited, json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise CommandError(f"{session.name}: jobctl {args[0]} failed (exit {res.exited}): {res.stderr.strip()[-300:]}", result=res) from None


def takes_gpu(step: str, gpu: bool | None) -> bool:
    """Whether a job of this step takes the host's GPU lock (--gpu/--no-gpu, else the step's default)."""
    return (step in pipeline.GPU_STEPS) if gpu is None else gpu


def start(session: HostSession, step: str, extra: list[str] | None = None, gpu: bool | None = None,
          shape: job_layout.Shape | None = None, job_id: str | None = None, files: dict[str, str] | None = None) -> Job:
    """Upload the job script and start it detached. Refuses while another GPU job holds the lock.
    `files`: the job as job_files rendered it for `job_id` (api.run renders once, before connecting)."""
    extra = list(extra or [])
    job_id = check_job_id(job_id or new_job_id(step))
    if files is None:
        files = job_files(session, step, extra, job_id, shape)  # before touching the host: bad input changes nothing
    session.deploy_payloads()
    record = {f"{RUNS}/{job_id}/{name}": t for name, t in pipeline.output_record(step, session).items()}
    args = ["start", f"--job-id={job_id}", "--step", step, "--host", session.name,
            "--workdir", session.path(""), "--args-json", json.dumps(extra)]
    if takes_gpu(step, gpu):
        args.append("--gpu")
    # From the job's folder to its id in jobs.json, Ctrl-C waits: before jobctl's start it cancels the start and
    # removes the folder; after, the job is recorded and named (exit 130). Never a job running untracked.
    with interrupts.deferred() as interrupted:
        try:
            session.upload_scripts({**files, **record})
        except BaseException:
            _remove_job_dir(session, job_id)
            raise
        if interrupted:
            _remove_job_dir(session, job_id)
            raise KeyboardInterrupt
        code, data = _jobctl(session, args)
        if not data.get("started"):
            _remove_job_dir(session, job_id)
            held = data.get("held_by") or {}
            if held:
                raise _lock_held(session, held)
            raise CommandError(f"{session.name}: job did not start: {data}")
        remember(job_id, session.name, host_identity(session.host))
    job = Job.from_host(session.name, data)
    if interrupted:
        raise interrupts.StartInterrupted.for_job(session.name, job_id, step)
    return job


def _remove_job_dir(session: HostSession, job_id: str) -> None:
    """The folder of a job that did not start (best effort: a dropped connection leaves it, never a job)."""
    try:
        session.transport.run(join(["rm", "-rf", "--", session.path(f"{RUNS}/{job_id}")]))
    except Exception:  # noqa: BLE001 - the start's own error is the one to report
        pass


def _lock_held(session: HostSession, held: dict) -> LockHeld:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("started_at") or 0))
    workdir = held.get("workdir")
    if held.get("other_workdir"):
        # The GPUs are the machine's: a job of another workdir (another inventory entry) holds them.
        return LockHeld(f"{session.name}: GPU job {held.get('job_id')} ({held.get('step')}, started {since}) of "
                        f"workdir {workdir} on this machine is running; stop it first, from the inventory entry "
                        f"that started it")
    return LockHeld(
        f"{session.name}: GPU job {held.get('job_id')} ({held.get('step')}, started {since}) is running; "
        f"stop it first: kimi-eagle stop {held.get('job_id')} --host {session.name}"
    )


def refuse_if_locked(session: HostSession) -> None:
    """Raise the lock message when a running GPU job holds the host's lock (before anything is stopped)."""
    code, data = _jobctl(session, ["status"])
    if data.get("lock"):
        raise _lock_held(session, data["lock"])


def status(session: HostSession, job_id: str | None = None) -> list[Job]:
    if job_id is not None:
        check_job_id(job_id)
    code, data = _jobctl(session, ["status"] + ([f"--job={job_id}"] if job_id is not None else []))
    if code == 2:
        raise ConfigError(f"{session.name}: {data.get('error')}")
    return [Job.from_host(session.name, d) for d in data["jobs"]]


def stop(session: HostSession, job_id: str, grace: float = 10.0) -> dict:
    check_job_id(job_id)
    code, data = _jobctl(session, ["stop", f"--job={job_id}", "--grace", str(grace)])
    if code == 2:
        raise ConfigError(f"{session.name}: {data.get('error')}")
    if code != 0:
        raise CommandError(f"{session.name}: processes of job {job_id} remain after SIGKILL: {data.get('remaining')}", result=data)
    return data


# -- which host runs a job: a small local index so `logs JOB` needs no --host -------------------------
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


def remember(job_id: str, host: str, identity: dict | None = None) -> None:
    """Record the job's host (and where that host is). Under a lock: two terminals starting jobs at once both
    stay recorded (a read-modify-write without it lost one)."""
    import fcntl

    p = _index_path()
    p.parent.mkdir(parents=True, exist_ok=True)
    with open(p.with_name(p.name + ".lock"), "a+") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        index = _read_index(p)
        index.pop(job_id, None)
        index[job_id] = {"host": host, "where": identity} if identity else host
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(dict(list(index.items())[-500:])))
        os.replace(tmp, p)


def recorded(job_id: str) -> dict | None:
    """{"host": name, "where": host_identity or None} of a job started from this machine, else None."""
    value = _read_index(_index_path()).get(job_id)
    if isinstance(value, str):
        return {"host": value, "where": None}
    if isinstance(value, dict) and isinstance(value.get("host"), str):
        return {"host": value["host"], "where": value.get("where")}
    return None


def host_of(job_id: str) -> str | None:
    record = recorded(job_id)
    return record["host"] if record else None
