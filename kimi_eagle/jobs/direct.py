"""Direct jobs: a detached process group on the host, started, listed and stopped by kimi_eagle_host/ops/jobs.py
(the host-side half)."""

from __future__ import annotations

import json
import time

from .. import templating
from ..config import step_plan
from ..errors import EXIT_FAILED, CommandError, ConfigError, ConnectionFailed, KimiEagleError
from ..hosts.session import RUNS, HostSession
from ..shell import join
from . import interrupts, layout
from .job_info import Job, check_job_id, new_job_id
from .local_index import forget, host_identity, remember, start_unanswered


class LockHeld(KimiEagleError):
    exit_code = EXIT_FAILED


class StartUnconfirmed(ConnectionFailed):
    """The host's answer to a start never came (the connection dropped, sbatch did not answer in time): the job may
    run. It is in this machine's job index, and the message names it with what shows whether it began."""

    def __init__(self, message: str, job_id: str):
        super().__init__(message)
        self.job_id = job_id

    @classmethod
    def lost(cls, host: str, job_id: str, why: BaseException | str) -> "StartUnconfirmed":
        said = str(why).removeprefix(f"{host}: ")
        return cls(f"{host}: {said}; job {job_id} may have started on {host} (it is in this machine's job index): "
                   f"see kimi-eagle status {job_id}", job_id)


def render_job(session: HostSession, step: str, extra: list[str], job_id: str = "JOB-ID",
               shape: layout.Shape | None = None) -> tuple[str, str]:
    """The job script as it will be uploaded: (path relative to the workdir, text)."""
    host = session.host
    run_rel = f"{RUNS}/{job_id}"
    steps = layout.apply(step_plan.plan_for_host(step, host, extra, job_id), step, shape)
    text = templating.render(
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
        payloads=session.payloads,
        steps=steps,
    )
    return f"{run_rel}/job.sh", text


def job_files(session: HostSession, step: str, extra: list[str], job_id: str = "JOB-ID",
              shape: layout.Shape | None = None) -> dict[str, str]:
    """What a direct job uploads, rendered once: its script and its settings.json (relative to the workdir)."""
    rel, text = render_job(session, step, extra, job_id, shape)
    return {rel: text, **step_plan.settings_file(step, session.host, extra, job_id)}


def _under(workdir: str, rel: str) -> str:
    return workdir.rstrip("/") + "/" + rel


def _call_host_jobs(session: HostSession, args: list[str]) -> tuple[int, dict]:
    """kimi_eagle_host.ops.jobs ARGS on the host: (its exit code, its JSON answer)."""
    res = session.call("ops.jobs", ["--runs-dir", RUNS, *args])
    if res.exited == -1:  # the channel closed without an exit status: the connection dropped, not ops.jobs
        raise ConnectionFailed(f"{session.name}: connection lost during ops.jobs {args[0]}", result=res)
    try:
        return res.exited, json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        raise CommandError(f"{session.name}: ops.jobs {args[0]} failed (exit {res.exited}): {res.stderr.strip()[-300:]}", result=res) from None


def takes_gpu(step: str, gpu: bool | None) -> bool:
    """Whether a job of this step takes the host's GPU lock (--gpu/--no-gpu, else the step's default)."""
    return (step in step_plan.GPU_STEPS) if gpu is None else gpu


def start(session: HostSession, step: str, extra: list[str] | None = None, gpu: bool | None = None,
          shape: layout.Shape | None = None, job_id: str | None = None, files: dict[str, str] | None = None) -> Job:
    """Upload the job script and start it detached. Refuses while another GPU job holds the lock.
    `files`: the job as job_files rendered it for `job_id` (api.run renders once, before connecting)."""
    extra = list(extra or [])
    job_id = check_job_id(job_id or new_job_id(step))
    if files is None:
        files = job_files(session, step, extra, job_id, shape)  # before touching the host: bad input changes nothing
    session.deploy_payloads()
    record = step_plan.output_record(step, session, job_id)
    args = ["start", f"--job-id={job_id}", "--step", step, "--host", session.name,
            "--workdir", session.path(""), "--args-json", json.dumps(extra)]
    if takes_gpu(step, gpu):
        args.append("--gpu")
    # From the job's folder to its id in jobs.json, Ctrl-C waits: before ops.jobs' start it cancels the start and
    # removes the folder; after, the job is recorded and named (exit 130). Never a job running untracked.
    with interrupts.deferred() as interrupted:
        with interrupts.uploading(interrupted, lambda: remove_job_dir(session, job_id)):
            session.upload_scripts({**files, **record})
        # In the index before the host is asked (marked: it may not begin): a connection lost after the host started
        # the job, before its answer came back, left a job running that nobody was told about.
        remember(job_id, session.name, host_identity(session.host), starting=True)
        try:
            code, data = _call_host_jobs(session, args)
        except ConnectionFailed as e:
            raise StartUnconfirmed.lost(session.name, job_id, e) from None
        except CommandError as e:  # an ops.jobs that failed after starting the job stays recorded (marked)
            if interrupted and e.result is not None and interrupts.ended_before_it_ran(e.result.exited):
                forget(job_id)
                remove_job_dir(session, job_id)
                raise KeyboardInterrupt from None
            raise
        if not data.get("started"):
            if data.get("in_use"):  # another start's job owns the folder (and the id's record here): it stays
                raise CommandError(f"{session.name}: {data.get('error')}; start again (a new id is drawn)")
            forget(job_id)
            remove_job_dir(session, job_id)
            held = data.get("held_by") or {}
            if held:
                raise _lock_held(session, held)
            raise CommandError(f"{session.name}: job did not start: {data}")
        remember(job_id, session.name, host_identity(session.host))  # started: no longer marked
        named = interrupts.StartInterrupted.for_job(session.name, job_id, step)
        if interrupted.owner:  # else the start the deferral is part of (a group's) names what started
            interrupts.recorded(named)
    job = Job.from_host(session.name, data)
    if interrupted and interrupted.owner:
        raise named
    return job


def remove_job_dir(session: HostSession, job_id: str) -> None:
    """The folder of a job that did not start (best effort: a dropped connection leaves it, never a job)."""
    try:
        session.transport.run(join(["rm", "-rf", "--", session.path(f"{RUNS}/{job_id}")]))
    except Exception:  # noqa: BLE001 - the start's own error is the one to report
        pass


def _lock_held(session: HostSession, held: dict) -> LockHeld:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(held.get("started_at") or 0))
    workdir = held.get("workdir")
    # `ending`: its shell has exited; processes it left hold the GPUs, and `stop` ends them
    doing = "has exited, but processes it left hold the GPUs" if held.get("state") == "ending" else "is running"
    if held.get("other_workdir"):
        # The GPUs are the machine's: a job of another workdir (another inventory entry) holds them.
        return LockHeld(f"{session.name}: GPU job {held.get('job_id')} ({held.get('step')}, started {since}) of "
                        f"workdir {workdir} on this machine {doing}; stop it first, from the inventory entry "
                        f"that started it")
    return LockHeld(
        f"{session.name}: GPU job {held.get('job_id')} ({held.get('step')}, started {since}) {doing}; "
        f"stop it first: kimi-eagle stop {held.get('job_id')} --host {session.name}"
    )


def refuse_if_locked(session: HostSession, ending_ok: bool = False) -> None:
    """Raise the lock message when a running GPU job holds the host's lock (before anything is stopped). ending_ok:
    not for an `ending` job, whose processes left behind are stale holders a reset stops (`run --reset-gpus`)."""
    code, data = _call_host_jobs(session, ["status"])
    held = data.get("lock")
    if held and not (ending_ok and held.get("state") == "ending"):
        raise _lock_held(session, held)


def status(session: HostSession, job_id: str | None = None) -> list[Job]:
    if job_id is not None:
        check_job_id(job_id)
    code, data = _call_host_jobs(session, ["status"] + ([f"--job={job_id}"] if job_id is not None else []))
    if code == 2:
        raise ConfigError(f"{session.name}: {data.get('error')}{_never_began(job_id)}")
    return [Job.from_host(session.name, d) for d in data["jobs"]]


def _never_began(job_id: str) -> str:
    """What a host's "no job" means for a job whose start from here lost its answer."""
    if start_unanswered(job_id):
        return "; its start from this machine lost the connection before the job began: it did not start"
    return ""


def stop(session: HostSession, job_id: str, grace: float = 10.0) -> dict:
    check_job_id(job_id)
    code, data = _call_host_jobs(session, ["stop", f"--job={job_id}", "--grace", str(grace)])
    if code == 2:
        raise ConfigError(f"{session.name}: {data.get('error')}{_never_began(job_id)}")
    if code != 0:
        raise CommandError(f"{session.name}: processes of job {job_id} remain after SIGKILL: {data.get('remaining')}", result=data)
    return data


