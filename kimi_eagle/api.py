"""The operations the `kimi-eagle` command offers, as a Python API returning result objects.

    from kimi_eagle.api import Controller

    ke = Controller("inventory.yaml")             # or Controller() for ./inventory.yaml / the embedded default
    for o in ke.check("gpu-01"):                  # HostOutcome per host: .ok, .value (what the host has), .error
        print(o.host, o.ok, o.value and o.value["python"])
    started = ke.run("extract", host="gpu-01")    # detached; started.job.id, started.job.log
    print(ke.status(started.job.id).jobs[0].state)
    ke.stop(started.job.id)

The CLI (kimi_eagle/cli/) only parses arguments, calls these and prints the results. Operations over several
hosts return one `HostOutcome` per host (one host's failure never hides another's result); operations on one
host raise `KimiEagleError` (with the message and exit code the CLI shows) when they cannot be done.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

from .errors import ConfigError, KimiEagleError
from .hosts.parallel import HostOutcome, each_host
from .jobs import interrupts

# notify(text, style): progress worth telling a person (a preflight warning, a stale GPU holder stopped);
# style is None, "yellow" or "red". The API itself never prints.
Notify = Callable[[str, Optional[str]], None]


def _quiet(text: str, style: str | None = None) -> None:
    pass


# `logs --tail N`: more lines than any log holds means all of them; the host's `tail` refuses numbers past 2**64.
MAX_TAIL_LINES = 10**15


def _lines(tail: int | None) -> int | None:
    return None if tail is None else min(int(tail), MAX_TAIL_LINES)


@dataclass
class HostRow:
    name: str
    transport: str
    address: str
    port: int | None
    user: str | None
    workdir: str
    python: str
    groups: list[str]


@dataclass
class OfferedKey:
    """The key a host offers now (`hosts trust` shows it before recording)."""
    host: str
    hostname: str
    port: int
    key: object
    fingerprint: str

    @property
    def key_type(self) -> str:
        return self.key.get_name()


@dataclass
class Rendered:
    files: dict[str, str]            # path relative to the workdir -> text
    written: list[Path] = field(default_factory=list)


@dataclass
class Started:
    """A job started on one host. `session` stays open only when asked for (to follow the log on it)."""
    host: str
    job: object                      # job_info.Job
    session: object = None


@dataclass
class GroupStarted:
    group_job: object                # groups.GroupJob
    outcomes: list                   # groups.StartOutcome per host

    @property
    def failed(self) -> bool:
        return any(o.action == "failed" for o in self.outcomes)

    @property
    def exit_code(self) -> int:
        """0 when every host started; 5 when every failed start was the connection's, else 1."""
        from .jobs import groups

        return groups.start_exit(self.outcomes)


@dataclass
class Pulled:
    host: str
    run: object                      # runs.RunDir
    dest: Path
    report: object                   # sync.FetchReport


@dataclass
class Followed:
    job: object                      # job_info.Job, as it stands when the log ended (or now, without follow)
    reconnects: int = 0              # connection outages survived (log_stream.FollowResult)
    reconnect_attempts: int = 0      # the new connections they took


@dataclass
class GroupStatus:
    group_job: object
    state: str
    members: list                    # groups.MemberState per host

    @property
    def exit_code(self) -> int:
        from .jobs import groups

        return groups.exit_code(self.state, self.members)


@dataclass
class JobList:
    jobs: list                       # job_info.Job
    errors: dict[str, KimiEagleError] = field(default_factory=dict)   # host -> why its jobs could not be listed


@dataclass
class Stopped:
    host: str
    job_id: str
    data: dict                       # what the host reported: signalled, sent, elapsed_s, or already

    def summary(self) -> str:
        d = self.data
        if d.get("already"):
            return f"job {self.job_id} is not running ({d['already']}); nothing to stop"
        sent = d["sent"]
        if "slurm_job_id" in d:  # Slurm: scancel --signal=TERM first, a hard scancel only when needed
            return (f"job {self.job_id} (Slurm {d['slurm_job_id']}) stopped: scancel --signal=TERM, then "
                    f"{'scancel' if sent['KILL'] else 'no hard cancel needed'} ({d['elapsed_s']}s)")
        signals = (f"SIGTERM then {'SIGKILL to ' + str(sent['KILL']) if sent['KILL'] else 'no SIGKILL needed'}; "
                   f"nothing left ({d['elapsed_s']}s)")
        if d.get("was") == "ending":  # the shell had exited by itself: its code stays the job's
            return (f"job {self.job_id} had exited with code {d.get('exit_code')} ({d.get('state')}); stopped the "
                    f"{len(d['signalled'])} processes it left: {signals}")
        return f"job {self.job_id} stopped: {len(d['signalled'])} processes, {signals}"


# A shell that has just exited may leave processes on their way out (an engine's workers closing down): a follow
# gives them this long before it reports the job `ending`, with what it left still running.
ENDING_WAIT_S = 5.0


def _settled(h, job):
    """The job once what its shell left has exited, or as it stands after ENDING_WAIT_S (or a lost connection: the
    log was read to its end, the state is what the host last said)."""
    from .hosts.session import HostSession
    from .jobs import scheduler

    deadline = time.monotonic() + ENDING_WAIT_S
    try:
        with HostSession(h) as session:
            while job.state == "ending" and time.monotonic() < deadline:
                time.sleep(0.5)
                job = scheduler.for_host(h).status(session, job.id)[0]
    except KimiEagleError:
        pass
    return job


class Controller:
    """One inventory and the operations on its hosts. `inventory`: a path, an `inventory.Inventory`, or None
    (./inventory.yaml, else the embedded local default), loaded and validated on first use."""

    def __init__(self, inventory=None):
        self._inventory = inventory if not isinstance(inventory, (str, Path, type(None))) else None
        self._path = None if self._inventory is not None else inventory

    @property
    def inventory(self):
        if self._inventory is None:
            from .config import inventory

            self._inventory = inventory.load(self._path)
        return self._inventory

    # ------------------------------------------------------------------------------------------- hosts
    def hosts(self) -> list[HostRow]:
        inv = self.inventory
        return [HostRow(h.name, h.transport, h.address if h.transport == "ssh" else "(this machine)", h.port, h.user,
                        h.workdir, h.python, [g for g, ms in inv.data.groups.items() if h.name in ms])
                for h in inv.hosts.values()]

    def check(self, target: str | None = None) -> list[HostOutcome]:
        """What each host has (Python, torch/CUDA, transformers, vllm, speculators, GPUs), probed in parallel."""
        from .hosts import probe

        return probe.check(self.inventory.select(target))

    def offered_key(self, host: str) -> OfferedKey:
        from .hosts import hostkeys, trust

        h = self.inventory.one(host)
        hostname, port, key = trust.offered_key(h)
        return OfferedKey(h.name, hostname, port, key, hostkeys.fingerprint(key))

    def trust(self, offered: OfferedKey, *, fingerprint: str | None = None, replace: str | None = None):
        """Record an offered key (hostkeys.Recorded: path, added, removed). With `fingerprint`, only that key;
        `replace` removes the recorded key it names (a changed key is refused otherwise)."""
        from .hosts import trust

        h = self.inventory.one(offered.host)
        if replace and not fingerprint:
            raise ConfigError(f"{h.name}: --replace {replace} needs --fingerprint naming the new key")
        if fingerprint and fingerprint != offered.fingerprint:
            raise KimiEagleError(f"{h.name}: offered fingerprint {offered.fingerprint} does not match --fingerprint "
                                 f"{fingerprint}; nothing recorded")
        return trust.trust(h, offered.hostname, offered.port, offered.key, replace=replace)

    # ------------------------------------------------------------------------------------------- files
    def render(self, what: str, step: str | None = None, host: str | None = None, extra: list[str] | None = None,
               out: str | Path | None = None) -> Rendered:
        """The files `what` would upload and run on `host`, without touching the network; written under `out`."""
        from . import templating as r
        from .operations import render

        files = render.files_for(what, step, self.inventory.one(host), list(extra or []))
        return Rendered(files, r.write(out, files) if out is not None else [])

    def upload(self, paths: list[str | Path], to: str, host: str | None = None,
               group: str | None = None) -> list[HostOutcome]:
        """Local files and folders to `to` on each host (HostOutcome values: sync.SyncReport)."""
        from .operations import upload

        return upload.upload(self.inventory.select(host, group), [Path(p) for p in paths], to)

    # -------------------------------------------------------------------------------- host operations
    def deploy_patch(self, host: str | None = None, group: str | None = None, patch_set: str = "auto",
                     mode: str = "apply") -> list[HostOutcome]:
        """mode: apply | check | diff | revert (HostOutcome values: deploy_patch.PatchResult)."""
        from .operations import deploy_patch

        if mode not in ("apply", "check", "diff", "revert"):
            raise ConfigError(f"deploy-patch: unknown mode {mode!r} (choose from apply, check, diff, revert)")
        return deploy_patch.deploy(self.inventory.select(host, group), patch_set, mode)

    def preflight(self, step: str = "all", host: str | None = None, group: str | None = None,
                  extra: list[str] | None = None) -> list[HostOutcome]:
        """Every known failure of `step`, checked in seconds (HostOutcome values: preflight.PreflightResult)."""
        from .config.step_plan import STEPS
        from .operations import preflight

        if step not in (*STEPS, "all"):
            raise ConfigError(f"unknown step {step!r} (choose from {', '.join(STEPS)}, all)")
        return each_host(self.inventory.select(host, group), lambda s: preflight.run(s, step, list(extra or [])))

    def gpu_reset(self, host: str | None = None, group: str | None = None, *, stop_all: bool = False,
                  dry_run: bool = False, grace: float = 10.0, timeout: float = 60.0, require_gpu: bool = False,
                  device_paths: list[str] | None = None,
                  only_pids: dict[str, list[int | tuple[int, int | None]]] | None = None) -> list[HostOutcome]:
        """Stop the GPU holders of each host (ours; every one with stop_all) and verify the memory is back
        (HostOutcome values: gpu_reset.ResetResult). `only_pids` {host: pids, or (pid, start_ticks) pairs as a dry
        run's holders give them}: signal no process but these (what a person saw in a dry run and confirmed); with a
        start time, not a later process that got the same pid."""
        from .jobs import job_info
        from .operations import gpu_reset

        # Checked here, not only by the CLI's options: inf or nan from Python (or typer) would wait forever.
        grace = job_info.check_grace(grace)
        timeout = job_info.check_seconds("--timeout", timeout, "seconds to wait for processes to go and memory "
                                         "to free", job_info.MAX_WAIT_S)
        gpu_reset.check_device_paths(device_paths or [])
        extra = [a for p in device_paths or [] for a in ("--device-path", p)]
        kw = dict(grace=grace, timeout=timeout, require_gpu=require_gpu, stop_all=stop_all, dry_run=dry_run)

        def one(session):
            mine = extra
            if only_pids is not None:
                mine = extra + ["--only-pids", ",".join(map(gpu_reset.only_pid_arg, only_pids.get(session.name, [])))
                                or "0"]
            return gpu_reset.reset(session, extra=mine, **kw)

        return each_host(self.inventory.select(host, group), one, read_only=dry_run)

    # -------------------------------------------------------------------------------------------- jobs
    def job_host(self, job_id: str, host: str | None = None):
        """The inventory host of a job: the one named, the one it was started on from here, or the only one."""
        from .jobs import job_info, local_index

        job_info.check_job_id(job_id)
        inv = self.inventory
        if host:
            return inv.one(host)
        record = local_index.recorded(job_id)
        if record:
            named = inv.hosts.get(record["host"])
            if named is not None and (not record["where"] or local_index.host_identity(named) == record["where"]):
                return named
            # started here through another inventory (file) whose entry for the same machine has another name
            same = [h for h in inv.hosts.values() if record["where"] and local_index.host_identity(h) == record["where"]]
            if len(same) == 1:
                return same[0]
        if len(inv.hosts) == 1:
            return next(iter(inv.hosts.values()))
        raise ConfigError(f"job {job_id}: not started from this machine; name its host with --host")

    def run(self, step: str, host: str | None = None, extra: list[str] | None = None, *, reset_gpus: bool = False,
            preflight: bool = True, gpu: bool | None = None, notify: Notify = _quiet,
            keep_session: bool = False) -> Started:
        """Start `step` (a pipeline step, `all`, or `exec` with the command in `extra`) as a detached job.
        The input is validated before any connection; then our stale GPU holders (reset_gpus), the scheduler and
        the step's preflight are checked on the host, and nothing starts if one fails."""
        from .config import step_plan
        from .hosts.session import HostSession
        from .hosts.transport.offline import Offline
        from .jobs import job_info, scheduler

        extra = list(extra or [])
        h = self.inventory.one(host)
        sched = scheduler.for_host(h)
        job_id = job_info.new_job_id(step)
        # Rendered once, before connecting: bad input is refused here, and this is what starts.
        files = sched.render(HostSession(h, transport=Offline(h)), step, extra, job_id=job_id)
        session = HostSession(h)
        # `run all` whose hidden states would not fit the host as files trains online, unless the user chose
        # hidden_states or a trainer that reads files (then preflight's storage check refuses, as for any failure).
        may_go_online = step == "all" and h.pipeline.hidden_states == "offline" and \
            not self.inventory.sets(h.name, "hidden_states") and step_plan.trainer(h.pipeline) == "ours"
        try:
            checked = self._before_start(session, step, reset_gpus=reset_gpus, preflight=preflight, gpu=gpu,
                                         notify=notify, may_go_online=may_go_online, step_flags=extra)
            if checked is not None and checked.online_instead:
                h = h.model_copy(update={"pipeline": h.pipeline.model_copy(update={"hidden_states": "online"})})
                notify(f"[{h.name}] hidden_states: online, since {checked.online_instead['detail']} (the engine "
                       f"feeds the trainer; no hidden-state files; set hidden_states=offline to refuse instead)",
                       "yellow")
                files = sched.render(HostSession(h, transport=Offline(h)), step, extra, job_id=job_id)
                session.host = h
                self._before_start(session, step, reset_gpus=False, preflight=preflight, gpu=gpu, notify=notify)
            job = sched.start(session, step, extra, gpu=gpu, job_id=job_id, files=files)
        except BaseException:
            session.close()
            raise
        with interrupts.naming_job(h.name, job.id, step):  # started and recorded: a Ctrl-C from here names it
            if not keep_session:
                session.close()
                session = None
            return Started(h.name, job, session)

    def _before_start(self, session, step: str, *, reset_gpus: bool, preflight: bool, gpu: bool | None,
                      notify: Notify, may_go_online: bool = False, step_flags: list[str] | None = None):
        """Before a job starts on a host: our stale GPU holders (reset_gpus), the scheduler, the step's preflight
        (its result, where it ran; may_go_online: see preflight.gate; step_flags: the flags after -- for the step)."""
        from .jobs import scheduler
        from .jobs.slurm import SlurmPreflightError

        name = session.name
        sched = scheduler.for_host(session.host)
        if reset_gpus and sched.name == "direct":
            from .jobs import direct
            from .operations import gpu_reset

            gpu_reset.reset_before_run(session, printer=lambda text: notify(f"[{name}] {text}", None),
                                       wants_gpu=direct.takes_gpu(step, gpu))
        if not preflight:
            return
        problems = sched.preflight(session, step)
        if problems:
            raise SlurmPreflightError("; ".join(problems))
        if step != "exec" and sched.name == "direct":  # on Slurm the step runs on compute nodes, not on the login node
            from .operations import preflight as pf

            return pf.gate(session, step, printer=lambda text, style=None: notify(f"[{name}] {text}", style),
                           may_go_online=may_go_online, step_flags=step_flags)
        return None

    def run_group(self, step: str, group: str, extra: list[str] | None = None, *, shard_by: str = "hosts",
                  mode: str | None = None, reset_gpus: bool = False, preflight: bool = True, gpu: bool | None = None,
                  notify: Notify = _quiet) -> GroupStarted:
        """`step` over the hosts of `group`: extraction shards (one job per host) or one multi-node torchrun job.
        Run again, it resumes: hosts whose part is done or running are left alone."""
        from .jobs import groups

        g, outcomes = groups.start(
            self.inventory, group, step, list(extra or []), mode=mode, shard_by=shard_by, gpu=gpu,
            host_check=lambda s: self._before_start(s, step, reset_gpus=reset_gpus, preflight=preflight, gpu=gpu,
                                                    notify=notify))
        return GroupStarted(g, outcomes)

    def is_group_job(self, job_id: str) -> bool:
        from .jobs import groups

        return groups.is_group_job(job_id)

    def follow(self, job_id: str, printer_for, *, host: str | None = None, follow: bool = True,
               tail: int | None = None, on_reconnect=None, session=None) -> Followed:
        """A job's log, line by line, to printer_for(label)(stream, line); `follow` streams until the job ends and
        survives connection drops. KeyboardInterrupt leaves the job running."""
        from .jobs import scheduler

        h = self.job_host(job_id, host)
        tail = _lines(tail)
        result = scheduler.for_host(h).follow(h, job_id, lambda t: printer_for(f"{h.name}:{t}" if t else h.name),
                                            follow=follow, tail=tail, session=session, on_reconnect=on_reconnect)
        job = result.job
        if follow and job.state == "ending":
            job = _settled(h, job)
        return Followed(job, result.reconnects, result.reconnect_attempts)

    def follow_group(self, group_job, printer_for, *, follow: bool = True, tail: int | None = None,
                     on_reconnect=None, hosts=None) -> tuple[GroupStatus, dict]:
        """Every member's log, prefixed by host; returns the group's status after, and {host: error} of the logs
        that could not be read."""
        from .jobs import groups

        g = self.group_job(group_job)
        results = groups.follow(self.inventory, g, printer_for, follow=follow, tail=_lines(tail), on_reconnect=on_reconnect,
                                   hosts=hosts)
        errors = {h: r for h, r in results.items() if isinstance(r, Exception)}
        return self.group_status(g), errors

    def group_job(self, group_job):
        """The group job record (groups.GroupJob) of an id; a record is returned as it is."""
        from .jobs import groups

        return groups.GroupJob.load(group_job) if isinstance(group_job, str) else group_job

    def group_status(self, group_job) -> GroupStatus:
        from .jobs import groups

        g = self.group_job(group_job)
        state, rows = groups.status(self.inventory, g)
        return GroupStatus(g, state, rows)

    def status(self, job_id: str | None = None, host: str | None = None) -> JobList:
        """Jobs with their state, runtime and exit code: one job (an unknown one is bad input), or every job of
        the host, group or inventory."""
        from .hosts.session import HostSession
        from .jobs import scheduler

        if job_id is not None:
            h = self.job_host(job_id, host)
            with HostSession(h) as session:
                return JobList(scheduler.for_host(h).status(session, job_id))
        outcomes = each_host(self.inventory.select(host), lambda s: scheduler.for_host(s.host).status(s, job_id))
        return JobList([j for o in outcomes if o.ok for j in o.value],
                       {o.host: o.error for o in outcomes if not o.ok})

    def stop(self, job_id: str, host: str | None = None, grace: float = 10.0) -> Stopped:
        """SIGTERM to the job's whole process group (Slurm: scancel --signal=TERM), SIGKILL after `grace`."""
        from .hosts.session import HostSession
        from .jobs import job_info, scheduler

        job_info.check_grace(grace)
        h = self.job_host(job_id, host)
        with HostSession(h) as session:
            return Stopped(h.name, job_id, scheduler.for_host(h).stop(session, job_id, grace))

    def stop_group(self, group_job, grace: float = 10.0) -> list[HostOutcome]:
        """Every member's job, in parallel (HostOutcome values: Stopped)."""
        from .jobs import groups, job_info

        job_info.check_grace(grace)
        g = self.group_job(group_job)
        members = {m.host: m.job_id for m in g.members}
        outcomes = groups.stop(self.inventory, g, grace)
        return [HostOutcome(o.host, Stopped(o.host, members[o.host], o.value) if o.ok else None, o.error)
                for o in outcomes]

    def _run_host(self, job_id: str | None, host: str | None):
        return self.job_host(job_id, host) if job_id else self.inventory.one(host)

    def pull(self, job_id: str | None = None, host: str | None = None, run_dir: str | None = None,
             to: str | Path | None = None) -> Pulled:
        """Copy a run's export, reports, recorded settings and versions, tensorboard events and job logs to `to`
        (default ./pulled/JOB or ./pulled/HOST/DIRNAME): sha256-verified, unchanged files skipped."""
        from .hosts import local_dest
        from .hosts.session import HostSession
        from .operations import pull, runs

        h = self._run_host(job_id, host)
        with HostSession(h) as session:
            run = runs.locate(session, job_id, run_dir)
            dest = Path(to) if to else (Path("pulled") / job_id if job_id else Path("pulled") / h.name / Path(run.path).name)
            local_dest.prepare_folder(dest, "--to" if to else "pull into")
            return Pulled(h.name, run, dest, pull.pull(session, run, dest))

    def clean(self, job_id: str | None = None, host: str | None = None, run_dir: str | None = None, *,
              dry_run: bool = False, confirm=None):
        """Remove a run's hidden states and checkpoints (clean.CleanResult); `confirm(result)` is asked with the sizes
        first. Refused while a job using the folder runs; the last check and the removal are atomic on the host."""
        from .hosts.session import HostSession
        from .operations import clean, runs

        h = self._run_host(job_id, host)
        with HostSession(h, read_only=dry_run) as session:
            return clean.clean(session, runs.locate(session, job_id, run_dir), dry_run=dry_run, confirm=confirm)

    def export(self, host: str, step: str, session=None, job_id: str | None = None):
        """Where a finished pipeline's draft is and what to run next (draft_export.Export), or None. With the job's id,
        the serving hint uses the settings that job recorded."""
        from .hosts.session import HostSession
        from .operations import draft_export

        s = session or HostSession(self.inventory.one(host))  # a closed session reconnects on use
        try:
            return draft_export.describe_export(s, step, job_id)
        finally:
            s.close()
