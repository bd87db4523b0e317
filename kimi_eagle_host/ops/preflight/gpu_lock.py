"""Who holds this machine's GPUs: another job's claim or the workdir's gpu.lock."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from kimi_eagle_host import procfs
from kimi_eagle_host.ops.preflight.report import GPU_STEPS, check


def _pgid_alive(pgid) -> bool:
    if not isinstance(pgid, int) or pgid <= 1:
        return False
    try:
        os.killpg(pgid, 0)
        return True
    except PermissionError:
        return True  # it exists, owned by someone else
    except OSError:
        return False


def _lock_job_running(runs, info) -> bool:
    """Whether the job a gpu.lock names still runs: its own state (ops/jobs.py: the pid and group checked against
    the job's start, so a number given to a later process is not taken for it), else whether its pid or group live."""
    from kimi_eagle_host.ops.jobs import JOB_ID, LIVE_STATES, job_state

    job_id = info.get("job_id")
    run_dir = Path(runs) / job_id if isinstance(job_id, str) and JOB_ID.fullmatch(job_id) else None
    if run_dir is not None and (run_dir / "meta.json").is_file():
        return job_state(str(run_dir))["state"] in LIVE_STATES
    pid = procfs.stat(info.get("pid"))
    return (pid is not None and pid.alive) or _pgid_alive(info.get("pgid"))


def machine_gpu_holder(args) -> dict | None:
    """The GPU check of the machine's claims (ops/machine_claims.py): another job, of any workdir, holding them."""
    from kimi_eagle_host.ops.jobs import lock_holder

    held = lock_holder(args.runs_dir or "/")
    if not held or (args.job_id and held.get("job_id") == args.job_id):
        return None
    started = held.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else started
    how = "its shell has exited, processes it left still run" if held.get("state") == "ending" else "still running"
    return check("gpu_lock", "fail" if args.step in GPU_STEPS else "warn",
                 f"this machine's GPUs are held by job {held.get('job_id')} (step {held.get('step')}, started {when}, "
                 f"workdir {held.get('workdir')}), {how}",
                 f"wait for job {held.get('job_id')} to finish, or stop it from the inventory entry that started it")


def check_lock(args) -> dict:
    machine = machine_gpu_holder(args)
    if machine:
        return machine
    runs = args.runs_dir
    if not runs:
        return check("gpu_lock", "warn", "no --runs-dir: cannot see the controller's GPU lock",
                     "pass --runs-dir <workdir>/runs")
    lock = Path(runs) / "gpu.lock"
    if not lock.exists():
        return check("gpu_lock", "pass", f"{lock}: not held")
    try:
        info = json.loads(lock.read_text())
        assert isinstance(info, dict)
    except (ValueError, AssertionError, OSError) as exc:
        return check("gpu_lock", "warn", f"{lock}: unreadable ({exc})",
                     f"inspect and remove {lock} if no job runs")
    started = info.get("started_at")
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(started)) if isinstance(started, (int, float)) else started
    who = f"job {info.get('job_id')} (step {info.get('step')}, started {when}, pid {info.get('pid')})"
    if args.job_id and info.get("job_id") == args.job_id:
        return check("gpu_lock", "pass", f"{lock}: held by this job ({args.job_id})")
    if _lock_job_running(runs, info):
        status = "fail" if args.step in GPU_STEPS else "warn"
        return check("gpu_lock", status, f"{lock}: held by {who}, still running",
                     f"wait for job {info.get('job_id')} to finish, or stop it with the controller "
                     "(`kimi-eagle gpu-reset` frees the GPUs)")
    return check("gpu_lock", "warn", f"{lock}: stale, {who} is gone",
                 f"the controller replaces a stale lock; remove {lock} by hand if it does not")
