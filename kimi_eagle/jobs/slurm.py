"""Jobs through Slurm, driven from its login node (an inventory host with `scheduler: slurm`).

The batch script is rendered from templates/slurm_job.sbatch.j2 and uploaded like every script into
<workdir>/runs/<job-id>/ (a shared filesystem, as on every Slurm cluster), then submitted with
`sbatch --parsable`; the Slurm job id lands in `slurm_job_id` next to it. Extraction becomes a job array (one
rank per task, `log.<task>`, `exit_code.<task>`); a multi-node `train`/`exec` becomes `srun` of torchrun on
every node. States come from squeue plus the exit codes the script records itself (accounting may be off).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass

from .. import templating
from ..config import step_plan
from ..errors import CommandError, ConfigError, ConnectionFailed, KimiEagleError
from ..hosts import sync
from ..hosts.session import RUNS, HostSession
from ..shell import join, quote
from . import direct, interrupts, layout
from .job_info import Job, check_job_id, new_job_id
from .local_index import forget, host_identity, remember, start_unanswered

# squeue states in which a task still holds or waits for resources.
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED", "RESIZING", "SIGNALING",
          "STAGE_OUT", "REQUEUE_HOLD", "REQUEUE_FED", "RESV_DEL_HOLD"}


class SlurmPreflightError(KimiEagleError):
    pass


class QueueUnavailable(KimiEagleError):
    """squeue failed: the states of the jobs are unknown (never read as `lost` or `failed`)."""


# A failed squeue is asked again this many times, this far apart (a controller restart takes seconds).
QUEUE_RETRIES = (2.0, 4.0)
# How long sbatch may take to answer before the submission is reported as unknown (a busy slurmctld).
SUBMIT_TIMEOUT_S = 120.0


@dataclass
class ArrayTask:
    index: int
    steps: list


def _prefix(host) -> str:
    """The host's env for a Slurm client command (SLURM_CONF, PATH, ... as the inventory sets them)."""
    return "".join(f"export {templating.sh_name(k)}={quote(v)}; " for k, v in host.env.items())


def _slurm(session: HostSession, argv: list[str], *, check: bool = False, timeout: float = 60):
    return session.transport.run(_prefix(session.host) + join(argv), timeout=timeout, check=check)


# -- rendering ---------------------------------------------------------------------------------------
def job_files(session: HostSession, step: str, extra: list[str], job_id: str = "JOB-ID") -> dict[str, str]:
    """What `run` uploads for a Slurm job: {path relative to the workdir: text}.

    Rendered without a connection (api.run renders before connecting, and that is what is submitted): paths are
    the workdir's as the inventory gives it (the scripts expand a leading ~/), and the #SBATCH --output lines,
    which nothing expands, are relative to the job's working directory, the run folder sbatch is called in
    (start gives sbatch the same path made absolute)."""
    host = session.host
    slurm = host.slurm
    run_rel = f"{RUNS}/{job_id}"
    run_dir = host.workdir.rstrip("/") + "/" + run_rel
    steps = step_plan.plan_for_host(step, host, extra, job_id)
    tasks: list[ArrayTask] = []
    # One shape per job: several nodes make a torchrun job; otherwise shards make an array.
    torchrun = step in layout.DISTRIBUTED and slurm.nodes > 1
    if not torchrun and step in layout.SHARDABLE and slurm.shards > 1:
        tasks = [ArrayTask(i, layout.apply(steps, step, layout.Shape(ranks=[i], world_size=slurm.shards, devices_per_rank=0)))
                 for i in range(slurm.shards)]
    array_spec = f"0-{len(tasks) - 1}" + (f"%{slurm.array_parallelism}" if slurm.array_parallelism else "")
    common = dict(job_id=job_id, host=host.name, step=step, env=host.env, workdir=host.workdir, python=host.python,
                  payloads=session.payloads)
    files = {}
    main = steps[-1]
    if torchrun:
        # kimi_eagle_host.pipeline.launch on every node: it picks the workers per node from the GPUs Slurm gave the node.
        launch_flags, command = layout.split_launch(main.argv)
        files[f"{run_rel}/node.sh"] = templating.render("slurm_node.sh.j2", **common, launcher=layout.LAUNCHER,
                                                    launch_flags=launch_flags, command=command)
    files[f"{run_rel}/job.sbatch"] = templating.render(
        "slurm_job.sbatch.j2", **common, slurm=slurm, slurm_name=f"ke-{step}-{job_id[-4:]}",
        nodes=slurm.nodes if torchrun else 1, run_dir=run_dir, steps=steps, tasks=tasks, array_spec=array_spec,
        log_pattern="log.%a" if tasks else "log",
        torchrun=torchrun, before=steps[:-1],
        rdzv_port=host.rdzv_port, node_script=f"{run_dir}/node.sh",  # None: the script picks a free one
    )
    meta = {"job_id": job_id, "step": step, "host": host.name, "args": extra, "scheduler": "slurm",
            "tasks": len(tasks), "nodes": slurm.nodes if torchrun else 1, "submitted_at": time.time()}
    files[f"{run_rel}/meta.json"] = json.dumps(meta)
    files.update(step_plan.settings_file(step, host, extra, job_id))
    return files


# -- preflight ----------------------------------------------------------------------------------------
def preflight(session: HostSession, step: str) -> list[str]:
    """What `sinfo` says about the partition and gres we ask for: one line per problem (empty: fine)."""
    slurm = session.host.slurm
    res = _slurm(session, ["sinfo", "-h", "-p", slurm.partition, "-o", "%P|%a|%D|%G"])
    if res.exited == 127 or "command not found" in res.stderr:
        return [f"{session.name}: sinfo not found on the login node (is Slurm's client on PATH? set env: PATH)"]
    if res.exited != 0:
        return [f"{session.name}: sinfo failed: {res.stderr.strip()[-200:]}"]
    rows = [line.split("|") for line in res.stdout.splitlines() if line.count("|") == 3]
    if not rows:
        known = [p.rstrip("*") for p in _slurm(session, ["sinfo", "-h", "-o", "%P"]).stdout.split()]  # * marks the default
        return [f"{session.name}: partition {slurm.partition!r} not found (sinfo lists: {', '.join(known) or 'none'})"]
    problems = []
    if not any(r[1] == "up" for r in rows):
        problems.append(f"{session.name}: partition {slurm.partition!r} is {rows[0][1]}, not up")
    nodes = sum(int(r[2]) for r in rows if r[2].isdigit())
    need_nodes = slurm.nodes if step in layout.DISTRIBUTED else 1
    if nodes < need_nodes:
        problems.append(f"{session.name}: partition {slurm.partition!r} has {nodes} nodes, the job needs {need_nodes}")
    for want in (slurm.gres or "").split(","):
        if want and not any(_gres_offers(r[3], want) for r in rows):
            offered = ", ".join(sorted({r[3] for r in rows})) or "none"
            problems.append(f"{session.name}: partition {slurm.partition!r} offers no gres {want} (sinfo: {offered})")
    return problems


def _gres_offers(offered: str, want: str) -> bool:
    """Does sinfo's %G (e.g. 'gpu:h200:8(S:0-1),nic:1') satisfy one requested gres ('gpu:8', 'gpu:h200:8')?"""
    w = want.split(":")
    w_name, w_count = w[0], int(w[-1]) if len(w) > 1 and w[-1].isdigit() else 1
    w_type = w[1] if len(w) == 3 or (len(w) == 2 and not w[1].isdigit()) else None
    for item in offered.split(","):
        o = re.sub(r"\(.*?\)", "", item).split(":")
        if o[0] != w_name:
            continue
        count = int(o[-1]) if len(o) > 1 and o[-1].isdigit() else 1
        o_type = o[1] if len(o) == 3 else None
        if count >= w_count and (w_type is None or w_type == o_type):
            return True
    return False


# -- submit -------------------------------------------------------------------------------------------
def start(session: HostSession, step: str, extra: list[str] | None = None, *, job_id: str | None = None,
          files: dict[str, str] | None = None) -> Job:
    """Upload the job and submit it. `files`: the job as job_files rendered it for `job_id` (api.run renders once,
    before connecting)."""
    extra = list(extra or [])
    job_id = check_job_id(job_id or new_job_id(step))
    if files is None:
        files = job_files(session, step, extra, job_id)  # renders before touching the host: bad input changes nothing
    files = {**files, **step_plan.output_record(step, session, job_id)}
    session.deploy_payloads()
    items = [sync.Item(remote=rel, data=text.encode(), mode=0o755 if rel.endswith(".sh") or rel.endswith(".sbatch") else 0o644)
             for rel, text in files.items()]
    run_dir = session.path(f"{RUNS}/{job_id}")
    # Slurm expands the %-patterns also in the working directory it puts before a relative --output path: a workdir
    # with a % in it would lose the logs. So the script's --output, relative, is given again here as an absolute
    # path with its % escaped (sbatch's command line overrides #SBATCH lines), now that the host's home is known.
    log = "log.%a" if json.loads(files[f"{RUNS}/{job_id}/meta.json"])["tasks"] else "log"
    output = run_dir.replace("%", "%%") + "/" + log
    # The id is recorded on the host by the same command that submits, so a controller dying here loses nothing.
    cmd = (_prefix(session.host) + f"cd {quote(run_dir)} && sbatch --parsable --output={quote(output)} job.sbatch "
           "> slurm_job_id.tmp && mv -f slurm_job_id.tmp slurm_job_id && cat slurm_job_id")
    # As direct.start: from the job's folder to its id in jobs.json, Ctrl-C waits. Before sbatch it cancels the
    # submission and removes the folder; after, the job is queued, recorded and named (exit 130). Never a Slurm
    # job queued that nobody was told about.
    with interrupts.deferred() as interrupted:
        with interrupts.uploading(interrupted, lambda: direct.remove_job_dir(session, job_id)):
            sync.sync(session.transport, session.path(""), items)
        # As direct.start: in the index before sbatch, marked until its answer says the job is queued.
        remember(job_id, session.name, host_identity(session.host), starting=True)
        try:
            res = session.transport.run(cmd, timeout=SUBMIT_TIMEOUT_S)
        except ConnectionFailed as e:
            raise direct.StartUnconfirmed.lost(session.name, job_id, e) from None
        if interrupted and interrupts.ended_before_it_ran(res.exited):
            forget(job_id)
            direct.remove_job_dir(session, job_id)
            raise KeyboardInterrupt
        if res.timed_out:  # a slow slurmctld: the job may well be queued, and sbatch never refused it
            raise direct.StartUnconfirmed.lost(session.name, job_id, f"sbatch gave no answer within {SUBMIT_TIMEOUT_S:g}s")
        if res.exited != 0:
            forget(job_id)
            raise CommandError(f"{session.name}: sbatch refused the job: {res.stderr.strip()[-300:] or res.stdout.strip()[-300:]}",
                               result=res)
        remember(job_id, session.name, host_identity(session.host))  # queued: no longer marked
        named = interrupts.StartInterrupted.for_job(session.name, job_id, step)
        if interrupted.owner:  # else the start the deferral is part of (a group's) names what started
            interrupts.recorded(named)
    if interrupted and interrupted.owner:
        raise named
    with interrupts.naming_job(session.name, job_id, step):  # queued and recorded: a Ctrl-C from here names it
        return status(session, job_id)[0]


# -- status -------------------------------------------------------------------------------------------
# squeue first, then the files: a task that leaves the queue between the two has written its exit code
# before it left, so it is never read as gone without one.
_LIST = r"""
printf '@squeue\n'
if {prefix}squeue -h -t all -u "$(id -un)" -o '%F|%K|%T|%r' > "${{TMPDIR:-/tmp}}/ke-squeue.$$" 2>&1; then
  cat "${{TMPDIR:-/tmp}}/ke-squeue.$$"; printf '@squeue-ok\n'
else
  cat "${{TMPDIR:-/tmp}}/ke-squeue.$$"; printf '@squeue-failed\n'
fi
rm -f "${{TMPDIR:-/tmp}}/ke-squeue.$$"
cd {runs} 2>/dev/null || exit 0
for d in {dirs}; do
  d=${{d%/}}
  [ -f "$d/slurm_job_id" ] || continue
  printf '@job %s\n' "$d"
  printf '@meta %s\n' "$(tr -d '\n' < "$d/meta.json")"
  printf '@slurm %s\n' "$(cut -d';' -f1 < "$d/slurm_job_id")"
  for f in "$d"/exit_code "$d"/exit_code.*; do [ -f "$f" ] && printf '@exit %s %s %s\n' "${{f##*/}}" "$(stat -c %Y "$f")" "$(cat "$f")"; done
  for f in "$d"/started_at "$d"/started_at.*; do [ -f "$f" ] && printf '@start %s %s\n' "${{f##*/}}" "$(cat "$f")"; done
  for f in "$d"/log "$d"/log.*; do [ -f "$f" ] && printf '@log %s %s\n' "${{f##*/}}" "$(stat -c %s "$f")"; done
  [ -f "$d/stopped" ] && printf '@stopped %s\n' "$(stat -c %Y "$d/stopped")"
done
"""


def _task_suffix(name: str) -> str:
    return name.split(".", 1)[1] if "." in name else ""


def _expand_tasks(spec: str) -> list[str]:
    """squeue's %K: 'N/A', '3', or a pending range like '[0-3%2]' / '1,4-5'."""
    spec = spec.strip("[]").split("%")[0]
    if spec in ("N/A", ""):
        return [""]
    out = []
    for part in spec.split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            out += [str(i) for i in range(int(lo), int(hi or lo) + 1)]
    return out


def status(session: HostSession, job_id: str | None = None) -> list[Job]:
    """The jobs' states; a failed squeue is asked again (QUEUE_RETRIES), then QueueUnavailable: never a state."""
    if job_id is not None:
        check_job_id(job_id)  # '' listed every job (and `stop ''` cancelled the first)
    waits = list(QUEUE_RETRIES)
    while True:
        try:
            return _status_once(session, job_id)
        except QueueUnavailable:
            if not waits:
                raise
            time.sleep(waits.pop(0))


def _status_once(session: HostSession, job_id: str | None) -> list[Job]:
    runs = session.path(RUNS)
    dirs = quote(job_id) if job_id is not None else "*/"
    res = session.transport.run(_LIST.format(runs=quote(runs), dirs=dirs, prefix=_prefix(session.host)), timeout=120)
    if res.exited == -1:  # no exit status: the connection dropped mid-listing, the output is partial
        raise ConnectionFailed(f"{session.name}: connection lost while reading job states")
    jobs_raw: list[dict] = []
    squeue: dict[tuple[str, str], str] = {}
    queue_said: list[str] = []
    queue_end = None
    in_queue = False
    for line in res.stdout.splitlines():
        if line == "@squeue":
            in_queue = True
            continue
        if in_queue:
            if line in ("@squeue-ok", "@squeue-failed"):
                in_queue, queue_end = False, line
                continue
            parts = line.split("|")
            if len(parts) == 4:
                for t in _expand_tasks(parts[1]):
                    squeue[(parts[0], t)] = parts[2]
            elif line.strip():
                queue_said.append(line.strip())
            continue
        tag, _, rest = line.partition(" ")
        if tag == "@job":
            jobs_raw.append({"dir": rest, "exit": {}, "start": {}, "log": {}, "stopped": None})
        elif not jobs_raw:
            continue
        elif tag == "@meta":
            try:
                jobs_raw[-1]["meta"] = json.loads(rest)
            except ValueError:
                jobs_raw[-1]["meta"] = {}
        elif tag == "@slurm":
            jobs_raw[-1]["slurm"] = rest.strip()
        elif tag == "@exit":
            name, mtime, code = (rest.split() + ["", "", ""])[:3]
            jobs_raw[-1]["exit"][_task_suffix(name)] = (int(code) if code.lstrip("-").isdigit() else None, float(mtime or 0))
        elif tag == "@start":
            name, _, when = rest.partition(" ")
            jobs_raw[-1]["start"][_task_suffix(name)] = float(when or 0)
        elif tag == "@log":
            name, _, size = rest.partition(" ")
            jobs_raw[-1]["log"][_task_suffix(name)] = int(size or 0)
        elif tag == "@stopped":
            jobs_raw[-1]["stopped"] = float(rest or 0)
    if queue_end != "@squeue-ok":
        said = queue_said[-1] if queue_said else (res.stderr.strip().splitlines() or ["no answer"])[-1]
        raise QueueUnavailable(f"{session.name}: squeue failed, job states unknown: {said[-200:]}")
    if job_id is not None and not jobs_raw:
        unanswered = start_unanswered(job_id)
        raise ConfigError(f"{session.name}: no Slurm job {job_id} in {runs}" + (
            "; its submission from this machine got no answer and no Slurm job id is recorded for it (an sbatch "
            "still running records it when it returns)" if unanswered else ""))
    return [_job(session, runs, raw, squeue) for raw in jobs_raw]


# Slurm's states of a job whose last run ended otherwise than with its script's exit 0.
ENDED_BADLY = {"CANCELLED", "FAILED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE", "PREEMPTED"}


def _own_code(code: int | None, queued: str | None) -> int | None:
    """The exit code the task's script recorded, where it is its last run's. Slurm runs a requeued job's script again
    (a preemption, `scontrol requeue`) and the file keeps the earlier run's code until the new run records its own: a 0
    beside a run Slurm says ended badly (cancelled while pending again, never launched) is the earlier run's, and
    that run's success is not this one's."""
    return None if code == 0 and queued in ENDED_BADLY else code


def _task_state(code, queued: str | None, stopped: bool) -> str:
    if queued in ACTIVE:
        return "pending" if queued == "PENDING" else "running"
    if code is not None:
        return "stopped" if stopped and code != 0 else "succeeded" if code == 0 else "failed"
    if stopped or queued == "CANCELLED":
        return "stopped"
    if queued in ENDED_BADLY:
        return "failed"
    return "lost"  # gone from squeue without an exit code


def _job(session, runs: str, raw: dict, squeue: dict) -> Job:
    meta = raw.get("meta") or {}
    slurm_id = raw.get("slurm", "")
    n = int(meta.get("tasks") or 0)
    labels = [str(i) for i in range(n)] if n else [""]
    stopped = raw["stopped"] is not None
    tasks = {}
    for t in labels:
        queued = squeue.get((slurm_id, t)) or (squeue.get((slurm_id, "")) if t else None)
        code = _own_code(raw["exit"].get(t, (None, 0))[0], queued)
        tasks[t] = {"state": _task_state(code, queued, stopped), "exit_code": code, "slurm_state": queued,
                    "log": f"{runs}/{raw['dir']}/log" + (f".{t}" if t else ""), "log_size": raw["log"].get(t, 0)}
    states = {v["state"] for v in tasks.values()}
    if "running" in states or ("pending" in states and len(states) > 1):
        state = "running"
    elif "pending" in states:
        state = "pending"
    elif "stopped" in states:
        state = "stopped"
    elif "failed" in states:
        state = "failed"
    elif "lost" in states:
        state = "lost"
    else:
        state = "succeeded"
    codes = [v["exit_code"] for v in tasks.values() if v["exit_code"] is not None]
    exit_code = None if state not in ("succeeded", "failed", "stopped") or not codes else next((c for c in codes if c), 0)
    started = min(raw["start"].values()) if raw["start"] else meta.get("submitted_at")
    ended = max((m for _, m in raw["exit"].values()), default=None) if state not in ("running", "pending") else None
    ended = ended or raw["stopped"] if state not in ("running", "pending") else None
    runtime = ((ended or time.time()) - started) if started else None
    first = tasks[labels[0]]
    job = Job(id=meta.get("job_id", raw["dir"]), host=session.name, step=meta.get("step"), state=state, exit_code=exit_code,
              started_at=started, ended_at=ended, runtime_s=round(runtime, 1) if runtime is not None else None,
              log=first["log"], log_size=first["log_size"], run_dir=f"{runs}/{raw['dir']}")
    job.extra = {"scheduler": "slurm", "slurm_job_id": slurm_id, "tasks": tasks}
    return job


# -- stop ---------------------------------------------------------------------------------------------
def stop(session: HostSession, job_id: str, grace: float = 10.0) -> dict:
    """scancel with a grace signal first: TERM to every task and step (our trap records 143), then a hard cancel."""
    check_job_id(job_id)
    job = status(session, job_id)[0]
    if job.state not in ("running", "pending"):
        return {"job": job_id, "already": job.state}
    slurm_id = job.extra["slurm_job_id"]
    t0 = time.monotonic()
    # Mark first: whatever happens next, the job's end reads as stopped, not failed.
    session.transport.run(f"touch {quote(job.run_dir + '/stopped')}", check=True)
    sent = {"TERM": False, "KILL": False}
    if job.state == "running":
        _slurm(session, ["scancel", "--signal=TERM", "--full", slurm_id])
        sent["TERM"] = True
        job = _wait_inactive(session, job_id, grace)
    if job.state in ("running", "pending"):
        _slurm(session, ["scancel", slurm_id])  # Slurm: TERM, KillWait, then KILL
        sent["KILL"] = True
        job = _wait_inactive(session, job_id, 120)
    if job.state in ("running", "pending"):
        raise CommandError(f"{session.name}: Slurm job {slurm_id} ({job_id}) is still {job.state} after scancel")
    return {"job": job_id, "slurm_job_id": slurm_id, "sent": sent, "state": job.state,
            "elapsed_s": round(time.monotonic() - t0, 2)}


def _wait_inactive(session, job_id: str, timeout: float) -> Job:
    deadline = time.monotonic() + timeout
    while True:
        job = status(session, job_id)[0]
        if job.state not in ("running", "pending") or time.monotonic() >= deadline:
            return job
        time.sleep(0.5)


# -- logs ---------------------------------------------------------------------------------------------
def follow(host, job_id: str, emit_for, *, follow: bool = True, tail: int | None = None, session: HostSession | None = None,
           poll_s: float = 0.5, give_up_after: float = 600.0, on_reconnect=None):
    """Stream every task's Slurm output file through `emit_for(task)(kind, text)` until the job ends.

    Slurm writes the files on the compute nodes (shared filesystem); we poll their sizes with the job's state
    in one round trip and read what is new by byte offset, so a reconnect resumes exactly where it stopped.
    """
    from .log_stream import FollowResult, LineSplitter, Reconnects

    given = session
    session = session or HostSession(host)
    offsets: dict[str, int] = {}
    splitters: dict[str, LineSplitter] = {}
    reconnects = Reconnects(host, job_id, give_up_after, on_reconnect, was_connected=given is not None)
    queue_down_since = None
    while True:
        try:
            try:
                job = status(session, job_id)[0]
            except QueueUnavailable:
                # The job goes on while the controller is away: wait, never call it failed.
                queue_down_since = queue_down_since or time.monotonic()
                if time.monotonic() - queue_down_since > give_up_after:
                    raise
                time.sleep(poll_s)
                continue
            queue_down_since = None
            reconnects.connected()  # reached (again): a drop from here on is retried, from a fresh clock and backoff
            for t, info in sorted(job.extra["tasks"].items(), key=lambda kv: int(kv[0] or 0)):
                if t not in splitters:
                    splitter, start = LineSplitter(emit_for(t)), 0
                    if tail is not None and info["log_size"]:
                        res = session.transport.run(f"head -c {int(info['log_size'])} -- {quote(info['log'])} | tail -n {int(tail)}",
                                                    check=True)
                        splitter.feed(res.stdout_bytes)
                        start = info["log_size"]
                    # Known only once its tail was read: a drop during that read reads the tail again on reconnect
                    # (known before, the task was read from byte 0: the whole log instead of its last N lines).
                    splitters[t], offsets[t] = splitter, start
                if info["log_size"] > offsets[t]:
                    data = session.transport.read_bytes(info["log"], offsets[t])
                    offsets[t] += len(data)
                    splitters[t].feed(data)
            done = job.state not in ("running", "pending")
            if not follow or (done and all(offsets[t] >= i["log_size"] for t, i in job.extra["tasks"].items())):
                break
            time.sleep(poll_s)
        except KeyboardInterrupt:
            session.close()
            raise
        except Exception as e:  # noqa: BLE001 - only connection trouble is retried
            session = reconnects.dropped(e, session)
    for s in splitters.values():
        s.flush()
    session.close()
    return FollowResult(job, sum(offsets.values()), reconnects.outages, reconnects.count)
