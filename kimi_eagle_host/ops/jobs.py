#!/usr/bin/env python3
"""Job control on the host: start a detached job, report states, stop a job's whole process group.

stdlib only; run by the host's Python. One JSON document on stdout.

A job lives in <runs>/<job-id>/: job.sh (rendered), meta.json, pid, pgid, log, exit_code.
job.sh records its own exit code with a trap, so the code is there even when no controller is
connected. The state is derived from those files plus the live process (pid + command marker + boot
id), so it is right after the controller was away, the host rebooted, or a pid was reused.

The GPU lock and the claims on output folders belong to the machine, not to a workdir (ops/machine_claims.py):
every job registers its claim at start, under flock(<runs>/.lock) and the machine's lock, so two inventory
entries or workdirs on one machine see each other's jobs. A GPU job holds the machine's GPUs while its processes
live; <runs>/gpu.lock (JSON: job_id, step, started_at, pid, pgid) is only this workdir's note of it.

A job whose shell has exited (its exit code recorded) while processes it started live on (an engine's worker,
`cmd &`) is `ending`: not over, since those processes hold what the job holds. Its claims stay, `stop` signals them,
and once they are gone the job is `succeeded` or `failed` by its shell's code.
"""

import argparse
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time

from kimi_eagle_host import procfs
from kimi_eagle_host.ops import machine_claims
from kimi_eagle_host.procfs import boot_id
from kimi_eagle_host.step_runtime import atomic_write as write_atomic

EXIT_HELD = 3
# A job id is one directory name under the runs dir (the controller checks the same before it calls).
JOB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


def read(path, default=None):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return default



def cmdline(pid):
    raw = read(f"/proc/{pid}/cmdline", "")
    return raw.replace("\0", " ").strip()


def process_matches(pid, marker):
    """True when pid is alive AND its command line carries the marker (a job started before start times were
    recorded; shell_alive compares the start time where it is)."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    line = cmdline(pid)
    return bool(line) and marker in line


def start_ticks(pid):
    """When a process started, in clock ticks since boot; None when there is no such process. With the boot id it
    tells a job's process from a later one that was given the same pid."""
    st = procfs.stat(pid)
    return st.start_ticks if st else None


def shell_alive(pid, record):
    """Whether the job's shell (pid) still runs: the process with that pid started when the job's did (the start
    recorded at its start), or, in a record from before start times were kept, carries the job's script path."""
    if record.get("start_ticks") is not None:
        st = procfs.stat(pid)
        return st is not None and st.start_ticks == record["start_ticks"] and st.alive
    return process_matches(pid, record.get("marker", "\0"))


def own_group(pgid, record):
    """The job's process group id, or None where the number now names another process's group.

    A job's group id is its shell's pid. While any member of the group lives, the kernel gives that number to no
    new process; so where a process with that pid runs and it is not the job's shell, the job's group is gone and
    a later process (an sshd session, another job) leads a group of that number: a stop, a `status` or gpu-reset
    must not take it for the job's."""
    if not pgid:
        return None
    st = procfs.stat(pgid)
    if st is None:
        return pgid  # no process has the number: which members of the group are the job's, in_job_group says
    if record.get("start_ticks") is not None:
        return pgid if st.start_ticks == record["start_ticks"] else None
    return pgid if not st.alive or process_matches(pgid, record.get("marker", "\0")) else None


def env_job(pid):
    """(KIMI_EAGLE_JOB_ID, KIMI_EAGLE_RUN_DIR) of a process: '' when unreadable, None when absent."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            raw = f.read()
    except PermissionError:
        return "", None
    except OSError:
        return None, None
    found = {}
    for item in raw.split(b"\0"):
        name, sep, value = item.partition(b"=")
        if sep and name in (b"KIMI_EAGLE_JOB_ID", b"KIMI_EAGLE_RUN_DIR"):
            found[name] = value.decode(errors="replace")
    return found.get(b"KIMI_EAGLE_JOB_ID"), found.get(b"KIMI_EAGLE_RUN_DIR")


def same_dir(a, b):
    return bool(a) and bool(b) and os.path.realpath(a) == os.path.realpath(b)


def names_job(env, job_id, run_dir=None):
    """Whether a process environment's (KIMI_EAGLE_JOB_ID, KIMI_EAGLE_RUN_DIR) (env_job) names the job (job.sh
    exports its id and run dir to all it starts). One naming another run dir is another workdir's job with the same
    id; an unreadable one (another user's) is not the job's, whose processes are its user's."""
    env_id, env_run = env
    return bool(job_id) and env_id == job_id and (env_run is None or run_dir is None or same_dir(env_run, run_dir))


def carries_job(pid, job_id, run_dir=None):
    """Whether the process's environment names the job (names_job)."""
    return names_job(env_job(pid), job_id, run_dir)


def in_job_group(pid, group, job_id, run_dir=None):
    """Whether a process whose process group (or session) is `group`, the number the job's shell had, is the
    job's. While a process has that pid, own_group has checked it is the job's shell, and the kernel gives the
    number to no other group. Once the shell is gone, the group's other members keep it, but so may a stranger's:
    the job's group died, the kernel gave the number to a new process that led a group or session (a login
    shell, a setsid daemon) and exited, leaving its children in it (`nohup cmd &`, then logout). Then only the
    environment tells the job's processes."""
    return procfs.stat(group) is not None or carries_job(pid, job_id, run_dir)


class Processes:
    """The machine's processes as one read of /proc, made when first asked: which group each live one is in and
    which job its environment names. A `status` of many jobs, with the claims its lock check reads, scans /proc
    once, not once a job; what waits for processes to go (stop) reads a new one each time."""

    def __init__(self):
        self.scanned = False
        self.pids = set()   # every process, zombies too: a group whose leader is a zombie still has it
        self.groups = {}    # pgid -> live pids
        self.envs = {}      # live pid -> env_job(pid)
        self.by_job = {}    # KIMI_EAGLE_JOB_ID -> live pids whose environment carries it

    def scan(self):
        if self.scanned:
            return self
        self.scanned = True
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            pid = int(name)
            st = procfs.stat(pid)
            if st is None:
                continue
            self.pids.add(pid)
            if not st.alive:
                continue  # a zombie: it holds nothing; its parent reaps it
            self.groups.setdefault(st.pgid, []).append(pid)
            self.envs[pid] = env_job(pid)
            if self.envs[pid][0]:
                self.by_job.setdefault(self.envs[pid][0], []).append(pid)
        return self

    def members(self, pgid, job_id=None, run_dir=None):
        """Pids in the job's process group (in_job_group, as of this read), plus any escapee that still carries the
        job's id in its environment."""
        self.scan()
        found = set()
        if pgid:
            leader = pgid in self.pids  # see in_job_group: then the number is the job's group's alone
            found.update(p for p in self.groups.get(pgid, ()) if leader or names_job(self.envs[p], job_id, run_dir))
        found.update(p for p in self.by_job.get(job_id, ()) if names_job(self.envs[p], job_id, run_dir))
        return sorted(found)


def group_members(pgid, job_id=None, run_dir=None):
    """Pids in the job's process group (in_job_group), plus any escapee that still carries the job's id in its
    environment: read from /proc now."""
    return Processes().members(pgid, job_id, run_dir)


def read_meta(run_dir):
    """meta.json as a dict: {} when absent, None when it is there but unreadable (bad JSON, not UTF-8)."""
    try:
        with open(os.path.join(run_dir, "meta.json"), "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return {}
    except OSError:
        return None
    try:
        meta = json.loads(raw.decode())
    except ValueError:  # UnicodeDecodeError is one
        return None
    return meta if isinstance(meta, dict) else None


def slurm_run(run_dir, meta):
    """Whether the folder is a Slurm job's (its state is Slurm's, not this host's processes')."""
    return os.path.exists(os.path.join(run_dir, "slurm_job_id")) or meta.get("scheduler") == "slurm"


def unreadable_state(run_dir):
    """One job whose record cannot be read: shown with its id, never hiding the others."""
    name = os.path.basename(run_dir)
    return {"id": name, "step": None, "host": None, "state": "unreadable", "exit_code": None, "pid": None,
            "pgid": None, "started_at": None, "ended_at": None, "runtime_s": None, "run_dir": run_dir,
            "log": os.path.join(run_dir, "log"), "log_size": 0, "gpu": False, "headline": None,
            "error": f"{os.path.join(run_dir, 'meta.json')}: not readable JSON"}


# The states of a job that still has processes: its claims (the GPUs, its output folder) hold, `stop` signals them.
LIVE_STATES = ("running", "ending")


def job_state(run_dir, procs=None):
    """The job's state and record. `procs`: a Processes read to share with the other jobs of one call."""
    meta = read_meta(run_dir)
    if meta is None:
        return unreadable_state(run_dir)
    procs = procs or Processes()
    pid = int((read(os.path.join(run_dir, "pid")) or "0").strip() or 0)
    code = read(os.path.join(run_dir, "exit_code"))
    code = int(code.strip()) if code and code.strip().lstrip("-").isdigit() else None
    stopped = os.path.exists(os.path.join(run_dir, "stopped"))
    same_boot = not meta.get("boot_id") or meta.get("boot_id") == boot_id()
    group = own_group(meta.get("pgid") or pid, meta) if same_boot else None
    shell = same_boot and shell_alive(pid, meta)
    # What of the job lives besides its shell (killed alone, or exited leaving children): a member or escapee of its
    # group. Read only where it decides the state: the shell is gone, or has recorded its code (its trap is ending
    # it: what it leaves holds the claims already). A job of an earlier boot has nothing left.
    watch = same_boot and (not shell or code is not None)
    left = [p for p in procs.members(group, meta.get("job_id"), run_dir) if p != pid] if watch else []
    ended_at = None
    if stopped:
        # The marker is written before the signals; a stop cut short (Ctrl-C, a dropped connection, a job that
        # ignores SIGTERM) leaves it behind while the processes live on: they decide, the marker never does.
        state = "running" if shell or left else "stopped"
    elif code is not None:
        # The shell has exited; what it started and left (an engine's worker, `cmd &`) still holds what the job
        # holds, so the job is not over: `ending`, its code known, until they exit or `stop` ends them.
        state = "ending" if left else "succeeded" if code == 0 else "failed"
    elif not same_boot:
        state = "lost"  # the host rebooted under the job
    elif shell:
        state = "running"
    elif pid == 0 and time.time() - meta.get("started_at", 0) < 10:
        state = "running"  # starting up
    elif left:
        # The job's shell is gone (killed alone) but its children live on, holding what they hold (a GPU):
        # still running for the lock, for `stop` (which ends the group) and for the user.
        state = "running"
    else:
        state = "lost"  # died without recording and nothing of its group is left, or the pid was reused
    for name in ("exit_code", "stopped") if state != "running" else ():
        p = os.path.join(run_dir, name)
        if os.path.exists(p):
            ended_at = os.path.getmtime(p)
    started = meta.get("started_at")
    runtime = ((ended_at or time.time()) - started) if started else None
    return {
        "id": meta.get("job_id", os.path.basename(run_dir)),
        "step": meta.get("step"),
        "host": meta.get("host"),
        "state": state,
        "exit_code": code,
        "pid": pid or None,
        "pgid": group,  # None where the number names another group now
        "started_at": started,
        "ended_at": ended_at,
        "runtime_s": round(runtime, 1) if runtime is not None else None,
        "run_dir": run_dir,
        "log": os.path.join(run_dir, "log"),
        "log_size": os.path.getsize(os.path.join(run_dir, "log")) if os.path.exists(os.path.join(run_dir, "log")) else 0,
        "gpu": meta.get("gpu", False),
        "left": left,  # the job's processes alive without its shell (a follow's `tail --pid` watches one)
        # a step's one-line result (the eval step's acceptance figures), see step_runtime.job_headline
        "headline": (read(os.path.join(run_dir, "headline")) or "").strip() or None,
    }


def claim_state(claim, procs=None):
    """The state of a claim's job while it has processes (LIVE_STATES), else None (the claim's own record when its
    run dir was removed)."""
    if claim.get("boot_id") and claim.get("boot_id") != boot_id():
        return None
    procs = procs or Processes()
    run_dir = claim["run_dir"]
    if os.path.isfile(os.path.join(run_dir, "meta.json")):
        state = job_state(run_dir, procs)["state"]
        if state != "unreadable":
            return state if state in LIVE_STATES else None
    record = {"marker": os.path.join(run_dir, "job.sh"), **claim}
    pgid = own_group(claim.get("pgid"), record)
    return "running" if claim.get("pgid") and procs.members(pgid, claim.get("job_id"), run_dir) else None


def live_claims(prune=False, where=None, procs=None):
    """The machine's claims whose jobs have processes, from one read of /proc (`procs`, else a new one)."""
    procs = procs or Processes()
    return machine_claims.live(lambda c: claim_state(c, procs) is not None, prune=prune, where=where)


def lock_holder(runs, claims=None, procs=None):
    """The GPU job on this machine (any workdir) whose processes live, as {job_id, step, started_at, pid, pgid,
    workdir, other_workdir, state}, or None. `state` is `ending` where only what its shell left holds the GPUs."""
    procs = procs or Processes()
    for claim in live_claims(where=lambda c: c.get("gpu"), procs=procs) if claims is None else claims:
        if claim.get("gpu"):
            held = {k: claim.get(k) for k in ("job_id", "step", "started_at", "pid", "pgid", "workdir")}
            held["other_workdir"] = not same_dir(os.path.dirname(claim["run_dir"]), runs)
            held["state"] = claim_state(claim, procs) or "running"
            return held
    return None


def _claim(meta, run_dir, workdir, pid=None):
    return {"job_id": meta["job_id"], "step": meta["step"], "gpu": meta["gpu"], "started_at": meta["started_at"],
            "boot_id": meta["boot_id"], "run_dir": os.path.realpath(run_dir), "workdir": os.path.realpath(workdir),
            # recorded before the start (ops/provenance.py); a job that records none claims no output folder
            "output_dir": (read(os.path.join(run_dir, "output_dir")) or "").strip() or None,
            "pid": pid, "pgid": pid, "start_ticks": meta.get("start_ticks")}


def cmd_start(a):
    runs = os.path.abspath(a.runs_dir)
    run_dir = os.path.join(runs, a.job_id)
    script = os.path.join(run_dir, "job.sh")
    if not os.path.isfile(script):
        print(f"ops.jobs: {script}: job script missing", file=sys.stderr)
        return 2
    # This workdir's lock, then the machine's (ops/clean.py takes them in the same order): no job of any workdir
    # starts between another caller's look at the claims and what it does about them.
    with open(os.path.join(runs, ".lock"), "a+") as lockf, machine_claims.locked():
        fcntl.flock(lockf, fcntl.LOCK_EX)
        if read_meta(run_dir) != {}:
            # Another start took this id (two terminals in one second drew the same one): that job's record stays.
            print(json.dumps({"started": False, "in_use": True, "error": f"job id {a.job_id} is in use on this host"}))
            return 2
        procs = Processes()
        holder = lock_holder(runs, live_claims(prune=True, procs=procs), procs) if a.gpu else None
        if holder:
            print(json.dumps({"started": False, "held_by": holder}))
            return EXIT_HELD
        meta = {
            "job_id": a.job_id,
            "step": a.step,
            "args": json.loads(a.args_json),
            "host": a.host,
            "started_at": time.time(),
            "boot_id": boot_id(),
            "marker": script,  # appears in the job shell's command line: `bash <run_dir>/job.sh`
            "gpu": a.gpu,
        }
        write_atomic(os.path.join(run_dir, "meta.json"), json.dumps(meta, indent=1))
        machine_claims.register(_claim(meta, run_dir, a.workdir))  # before the process: never an unclaimed job
        log = open(os.path.join(run_dir, "log"), "ab")
        # A new session and process group: no SSH hang-up, Ctrl-C or controller death reaches it.
        proc = subprocess.Popen(
            ["bash", script], cwd=a.workdir, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )
        log.close()
        write_atomic(os.path.join(run_dir, "pid"), f"{proc.pid}\n")
        write_atomic(os.path.join(run_dir, "pgid"), f"{proc.pid}\n")
        meta["pgid"] = proc.pid
        meta["start_ticks"] = start_ticks(proc.pid)  # unreaped until this process exits: there even if it ended
        write_atomic(os.path.join(run_dir, "meta.json"), json.dumps(meta, indent=1))
        machine_claims.register(_claim(meta, run_dir, a.workdir, proc.pid))
        if a.gpu:
            lock = {k: meta[k] for k in ("job_id", "step", "started_at")}
            lock.update(pid=proc.pid, pgid=proc.pid)
            write_atomic(os.path.join(runs, "gpu.lock"), json.dumps(lock))
    print(json.dumps({"started": True, **job_state(run_dir)}))
    return 0


def cmd_status(a):
    runs = os.path.abspath(a.runs_dir)
    procs = Processes()  # one read of /proc for every job listed and every claim checked
    if a.job:
        run_dir = os.path.join(runs, a.job)
        if not os.path.isfile(os.path.join(run_dir, "meta.json")):
            print(json.dumps({"jobs": [], "error": f"no job {a.job} on this host"}))
            return 2
        jobs = [job_state(run_dir, procs)]
    else:
        names = sorted(n for n in os.listdir(runs) if os.path.isfile(os.path.join(runs, n, "meta.json"))) if os.path.isdir(runs) else []
        jobs = [job_state(os.path.join(runs, n), procs) for n in names]
    print(json.dumps({"jobs": jobs, "lock": lock_holder(runs, procs=procs)}))
    return 0


def cmd_stop(a):
    runs = os.path.abspath(a.runs_dir)
    run_dir = os.path.join(runs, a.job)
    if not os.path.isfile(os.path.join(run_dir, "meta.json")):
        print(json.dumps({"stopped": False, "error": f"no job {a.job} on this host"}))
        return 2
    before = job_state(run_dir)
    if before["state"] not in LIVE_STATES:
        print(json.dumps({"stopped": False, "already": before["state"], **before}))
        return 0
    pgid = before["pgid"]
    t0 = time.time()
    targets = group_members(pgid, a.job, run_dir)
    sent = {"TERM": 0, "KILL": 0}

    def signal_all(sig):
        # The whole group at once only while its leader is the job's shell (own_group checked it); without it the
        # number may be a stranger's group, and only the processes group_members found the job's are signalled.
        if pgid and procfs.stat(pgid) is not None:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        for pid in group_members(pgid, a.job, run_dir):  # escapees that left the group, or all without a leader
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    # Mark first: the job's trap then records its exit, and the state reads "stopped", not "failed". An `ending`
    # job's shell has exited by itself: its code stays the job's verdict, the stop only ends what it left.
    if before["state"] != "ending":
        write_atomic(os.path.join(run_dir, "stopped"), json.dumps({"at": time.time(), "by": "kimi-eagle stop"}))
    signal_all(signal.SIGTERM)
    sent["TERM"] = len(targets)
    deadline = time.time() + a.grace
    while time.time() < deadline and group_members(pgid, a.job, run_dir):
        time.sleep(0.05)
    left = group_members(pgid, a.job, run_dir)
    if left:
        sent["KILL"] = len(left)
        signal_all(signal.SIGKILL)
        deadline = time.time() + 10
        while time.time() < deadline and group_members(pgid, a.job, run_dir):
            time.sleep(0.05)
    remaining = group_members(pgid, a.job, run_dir)
    if not remaining and not os.path.exists(os.path.join(run_dir, "exit_code")):
        write_atomic(os.path.join(run_dir, "exit_code"), "137\n" if sent["KILL"] else "143\n")
    lock = read(os.path.join(runs, "gpu.lock"))
    if not remaining and lock and f'"{a.job}"' in lock:
        try:
            os.unlink(os.path.join(runs, "gpu.lock"))
        except FileNotFoundError:
            pass
    out = {"stopped": not remaining, "signalled": targets, "sent": sent, "remaining": remaining, "was": before["state"],
           "elapsed_s": round(time.time() - t0, 2), **job_state(run_dir)}
    print(json.dumps(out))
    return 0 if not remaining else 1


MAX_GRACE_S = 3600.0  # a stop waits at most an hour for a clean exit; a longer wait is a typo, not a plan


def grace_seconds(text):
    """--grace: a finite number of seconds in [0, MAX_GRACE_S] (nan, inf and 1e308 would wait forever)."""
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not 0 <= value <= MAX_GRACE_S:  # false for nan too
        raise argparse.ArgumentTypeError(f"--grace {text}: seconds from 0 to {MAX_GRACE_S:g}")
    return value


def main(argv=None):
    ap = argparse.ArgumentParser(description="kimi-eagle job control on the host")
    ap.add_argument("--runs-dir", required=True)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start")
    s.add_argument("--job-id", required=True)
    s.add_argument("--step", required=True)
    s.add_argument("--host", required=True)
    s.add_argument("--workdir", required=True)
    s.add_argument("--args-json", default="[]")
    s.add_argument("--gpu", action="store_true", help="take the per-host GPU lock")
    st = sub.add_parser("status")
    st.add_argument("--job")
    sp = sub.add_parser("stop")
    sp.add_argument("--job", required=True)
    sp.add_argument("--grace", type=grace_seconds, default=10.0)
    a = ap.parse_args(argv)
    job = a.job_id if a.cmd == "start" else a.job
    if job is not None and not JOB_ID.fullmatch(job):
        print(json.dumps({"started": False, "stopped": False, "jobs": [], "error": f"not a job id: {job!r}"}))
        return 2
    return {"start": cmd_start, "status": cmd_status, "stop": cmd_stop}[a.cmd](a)


if __name__ == "__main__":
    sys.exit(main())
