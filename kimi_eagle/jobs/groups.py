"""One job over the hosts of a group: extraction shards (one job per host) or one multi-node torchrun.

A group job is recorded here, on the controller (`~/.cache/kimi-eagle/groups/<group-job-id>.json`): its
step, arguments and hosts, and per host the shape (ranks or torchrun node) and the id of the host's job
(a normal job on that host: `logs/status/stop HOSTJOB --host H` work on it too). `status`, `logs` and
`stop` of the group job fan out over those. A host that is unreachable or fails is reported and the others
go on; starting the same command again resumes only the shards that have not succeeded.
"""

from __future__ import annotations

import json
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import EXIT_FAILED, EXIT_TRANSPORT, CommandError, ConfigError, KimiEagleError, is_transport_failure
from ..hosts.parallel import HostOutcome, each_host
from . import direct, interrupts, layout, scheduler
from .job_info import LIVE, STATE_EXIT, Job, exit_code_of, new_job_id

PREFIX = "g-"
# Group-job states, worst first: one running host keeps the group running; else a failure fails it.
ORDER = ("running", "pending", "failed", "lost", "unreachable", "stopped", "ending", "succeeded")


@dataclass
class Member:
    host: str
    shape: dict  # layout.Shape as a dict
    job_id: str | None = None
    error: str | None = None  # why the last start on this host failed
    attempts: int = 0
    unreachable: bool = False  # that failure was the connection's (the network, not the host or the job)


@dataclass
class GroupJob:
    id: str
    group: str
    step: str
    extra: list[str]
    mode: str  # shards | torchrun
    shard_by: str
    hosts: list[str]
    members: list[Member] = field(default_factory=list)
    created_at: float = field(default_factory=time.time)
    # What produced the members' outputs: every host's rendered job script (env, pipeline settings, steps, shape)
    # and the payload code. A resume continues only a group job with the same one.
    fingerprint: dict = field(default_factory=dict)

    def key(self) -> tuple:
        return (self.group, self.step, tuple(self.extra), self.mode, self.shard_by, tuple(self.hosts))

    def changed_since(self, other: "GroupJob") -> list[str]:
        """What differs between this (new) job's inputs and `other`'s: [] when a resume may continue it."""
        mine, theirs = self.fingerprint, other.fingerprint or {}
        if not theirs:
            return ["its record predates settings tracking"]
        why = [f"{h}'s job script (inventory env, pipeline settings or steps)" for h in self.hosts
               if mine.get("hosts", {}).get(h) != theirs.get("hosts", {}).get(h)]
        if mine.get("payloads") != theirs.get("payloads"):
            why.append("the payload code (another kimi-eagle version)")
        return why

    def save(self) -> None:
        p = _dir() / f"{self.id}.json"
        p.parent.mkdir(parents=True, exist_ok=True)
        tmp = p.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(asdict(self), indent=1))
        os.replace(tmp, p)

    @classmethod
    def load(cls, group_job_id: str) -> "GroupJob":
        from .job_info import check_job_id

        check_job_id(group_job_id)  # names a file here: never a path
        try:
            d = json.loads((_dir() / f"{group_job_id}.json").read_text())
        except (OSError, ValueError):
            raise ConfigError(f"group job {group_job_id}: not started from this machine (no record in {_dir()})") from None
        d["members"] = [Member(**m) for m in d["members"]]
        return cls(**d)


def _dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache"))) / "kimi-eagle" / "groups"


def is_group_job(job_id: str) -> bool:
    return job_id.startswith(PREFIX)


@contextmanager
def _locked(key: tuple):
    """One start or resume of the same group job at a time (on this machine): the record is read, acted on and
    written by one command, so two identical resumes never both start the same shard or lose a job id."""
    import fcntl
    import hashlib

    _dir().mkdir(parents=True, exist_ok=True)
    name = hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]
    with open(_dir() / f".lock-{name}", "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fingerprint(rendered: dict[str, dict[str, str]]) -> dict:
    import hashlib

    from ..hosts.session import payload_set

    def digest(files: dict[str, str]) -> str:
        return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()

    return {"hosts": {h: digest(files) for h, files in rendered.items()},
            "payloads": payload_set().digest}


def _latest_with_key(key: tuple) -> GroupJob | None:
    records = sorted(_dir().glob(f"{PREFIX}*.json"), key=lambda p: p.stat().st_mtime, reverse=True) if _dir().is_dir() else []
    for p in records:
        try:
            g = GroupJob.load(p.stem)
        except KimiEagleError:
            continue
        if g.key() == key:
            return g
    return None


MODE_CHOICE = "choose --mode shards or --mode torchrun"


def mode_for(step: str) -> str:
    if step in layout.SHARDABLE and step != "exec":
        return "shards"
    if step in layout.DISTRIBUTED and step != "exec":
        return "torchrun"
    raise ConfigError(f"`run {step} --group`: only extract (sharded) and train (torchrun) run across a group; "
                      f"for exec {MODE_CHOICE}")


def plan(hosts, step: str, extra: list[str], *, mode: str, shard_by: str, group: str, group_id: str) -> GroupJob:
    """The record of a new group job (nothing contacted yet); refuses Slurm hosts, which shape their own jobs."""
    slurm_hosts = [h.name for h in hosts if h.scheduler != "direct"]
    if slurm_hosts:
        raise ConfigError(f"group {group!r}: host {slurm_hosts[0]!r} is a Slurm login node; run it with --host "
                          "(its slurm.shards / slurm.nodes spread the job)")
    if mode == "shards":
        parts = layout.shard_shapes(hosts, shard_by)
    elif mode == "torchrun":
        parts = layout.torchrun_shapes(hosts, group_id)
    else:
        raise ConfigError(f"unknown group mode {mode!r} ({MODE_CHOICE})")
    g = GroupJob(group_id, group, step, list(extra), mode, shard_by, [h.name for h in hosts])
    g.members = [Member(h.name, asdict(s)) for h, s in zip(hosts, parts)]
    return g


def shape_of(member: Member) -> layout.Shape:
    d = dict(member.shape)
    t = d.pop("torchrun", None)
    return layout.Shape(**d, torchrun=layout.Torchrun(**t) if t else None)


@dataclass
class StartOutcome:
    host: str
    action: str  # started | done | running | failed
    job_id: str | None = None
    message: str = ""
    error: BaseException | None = None  # why a start failed (its kind decides the exit code: 5 or 1)

    def as_dict(self) -> dict:
        return {"host": self.host, "action": self.action, "job_id": self.job_id, "message": self.message,
                "unreachable": self.error is not None and is_transport_failure(self.error)}


def start_exit(outcomes: list[StartOutcome]) -> int:
    """0 when every host started (or was done or running already); else 5 when every failed start was the
    connection's, 1 when any was the host's, its checks' or the job's."""
    from ..errors import failure_exit

    failed = [o for o in outcomes if o.action == "failed"]
    return failure_exit([o.error or CommandError(o.message) for o in failed]) if failed else 0


class NotStarted(KimiEagleError):
    """A host's start cancelled by a Ctrl-C before its job started (the group's start reports the rest)."""


def new_group_id(step: str) -> str:
    return new_job_id(step, PREFIX)


def start(inventory, group: str, step: str, extra: list[str], *, mode: str | None = None, shard_by: str = "hosts",
          gpu: bool | None = None, host_check=None) -> tuple[GroupJob, list[StartOutcome]]:
    """Start (or resume) a group job. `host_check(session)` runs on each host before its job starts (preflight)."""
    hosts = inventory.select(group=group)
    mode = mode or mode_for(step)
    fresh = plan(hosts, step, extra, mode=mode, shard_by=shard_by, group=group, group_id=new_group_id(step))
    from ..hosts.session import HostSession
    from ..hosts.transport.offline import Offline

    rendered = {}
    for h, m in zip(hosts, fresh.members):  # render every host's script first: bad input changes nothing anywhere
        rendered[h.name] = scheduler.for_host(h).render(HostSession(h, transport=Offline(h)), step, extra, shape_of(m))
    fresh.fingerprint = _fingerprint(rendered)
    with _locked(fresh.key()):
        previous = _latest_with_key(fresh.key())
        if previous is not None and mode == "torchrun":
            running = [o for o in _member_status(inventory, previous) if o.ok and o.value and o.value.state in LIVE]
            if running:
                raise ConfigError(f"group job {previous.id} is still running on {running[0].host}; stop it first: "
                                  f"kimi-eagle stop {previous.id}")
        changed = fresh.changed_since(previous) if previous is not None and mode == "shards" else []
        if changed:
            live = [o for o in _member_status(inventory, previous) if o.ok and o.value and o.value.state in LIVE]
            if live:
                raise ConfigError(f"group job {previous.id} is still running on {live[0].host} with other settings "
                                  f"({'; '.join(changed)} changed); stop it first: kimi-eagle stop {previous.id}")
        g = previous if previous is not None and mode == "shards" and not changed else fresh
        # The hosts start in threads, which no signal reaches: Ctrl-C is held back from here until the record is
        # saved, and each host's start (direct.start, _start_one) sees it and cancels itself if its job has not
        # started yet. So a Ctrl-C leaves the group job recorded and named (exit 130), or nothing started at all.
        with interrupts.deferred() as interrupted:
            known = {m.job_id for m in g.members}
            todo, outcomes = _what_to_start(inventory, g)
            if mode == "torchrun":
                outcomes = _start_torchrun(inventory, g, gpu, host_check)
            else:
                outcomes += _start_shards(inventory, g, todo, gpu, host_check)
            # the hosts where this run started a job (a torchrun node stopped again after a Ctrl-C included)
            started = [m.host for m in g.members if m.job_id not in known]
            if interrupted and not started:
                raise KeyboardInterrupt  # nothing of this run started: no record of it either
            if changed:
                # Never "succeeded before" for outputs made with other inputs: every shard runs again, and says why.
                for o in outcomes:
                    o.message += f" (not resuming {previous.id}: {'; '.join(changed)} changed since)"
            g.save()  # each member's job is in jobs.json already, with where its host is (the scheduler's start)
            named = interrupts.StartInterrupted.for_group(g.id, started)
            if started:
                interrupts.recorded(named)
    if interrupted:
        raise named
    return g, sorted(outcomes, key=lambda o: g.hosts.index(o.host))


def _what_to_start(inventory, g: GroupJob) -> tuple[list[Member], list[StartOutcome]]:
    """Members without a succeeded or live job (a resume starts only those)."""
    known = [m for m in g.members if m.job_id]
    states = {}
    if known:
        for o in _member_status(inventory, g, known):
            states[o.host] = o.value.state if o.ok and o.value else None
    todo, outcomes = [], []
    for m in g.members:
        state = states.get(m.host)
        if state == "succeeded":
            outcomes.append(StartOutcome(m.host, "done", m.job_id, "succeeded before; not started again"))
        elif state in LIVE:
            outcomes.append(StartOutcome(m.host, "running", m.job_id, "still running; not started again"))
        else:
            todo.append(m)
    return todo, outcomes


def _start_one(inventory, g: GroupJob, member: Member, gpu, host_check):
    host = inventory.hosts[member.host]

    def fn(session):
        # In a worker thread, under groups.start's deferral: a Ctrl-C noted before this host's job started
        # cancels it (direct.start removes what it uploaded); one that came after leaves it started and recorded.
        with interrupts.deferred() as interrupted:
            try:
                if interrupted:
                    raise KeyboardInterrupt
                if host_check:
                    host_check(session)
                if interrupted:
                    raise KeyboardInterrupt
                sched = scheduler.for_host(host)
                return sched.start(session, g.step, g.extra, gpu=gpu, shape=shape_of(member), job_id=new_job_id(g.step))
            except KeyboardInterrupt:
                raise NotStarted(f"{member.host}: not started: interrupted (Ctrl-C)") from None

    return fn


def _start_shards(inventory, g: GroupJob, todo: list[Member], gpu, host_check) -> list[StartOutcome]:
    outcomes = []
    by_host = {m.host: m for m in todo}
    hosts = [inventory.hosts[m.host] for m in todo]
    results = each_host(hosts, lambda s: _start_one(inventory, g, by_host[s.name], gpu, host_check)(s)) if hosts else []
    for o in results:
        m = by_host[o.host]
        m.attempts += 1
        if o.ok:
            m.job_id, m.error, m.unreachable = o.value.id, None, False
            outcomes.append(StartOutcome(o.host, "started", o.value.id, layout.Shape.describe(shape_of(m))))
        else:
            m.error, m.unreachable = str(o.error), is_transport_failure(o.error)
            if isinstance(o.error, direct.StartUnconfirmed):  # it may run: status and a resume look at that job
                m.job_id = o.error.job_id
            outcomes.append(StartOutcome(o.host, "failed", m.job_id, str(o.error), o.error))
    return outcomes


def _start_torchrun(inventory, g: GroupJob, gpu, host_check) -> list[StartOutcome]:
    """All nodes or none: every host must pass its checks, hold no GPU lock and reach the rendezvous before any
    starts; a node that refuses after others started has them stopped again."""
    from ..hosts.session import HostSession
    from . import rendezvous

    hosts = [inventory.hosts[m.host] for m in g.members]
    sessions = []
    try:
        for h in hosts:
            try:
                sessions.append(HostSession(h))
            except KimiEagleError as e:
                # The same kind of error (a connection failure stays one: exit 5), with what it means here.
                raise _same_kind(e, f"{h.name}: unreachable, nothing started: {e}") from None
        if host_check:
            for s in sessions:
                host_check(s)
        rendezvous.check(sessions)
        if direct.takes_gpu(g.step, gpu):
            for s in sessions:  # a held GPU lock anywhere: nothing starts anywhere
                direct.refuse_if_locked(s)
        started: list[tuple[Member, HostSession, str]] = []
        with interrupts.deferred() as interrupted:  # groups.start's: a Ctrl-C is noted, not raised
            for m, s in zip(g.members, sessions):
                m.attempts += 1
                try:
                    if interrupted:
                        raise KeyboardInterrupt
                    job = scheduler.for_host(s.host).start(s, g.step, g.extra, gpu=gpu, shape=shape_of(m),
                                                           job_id=new_job_id(g.step))
                except KeyboardInterrupt:
                    # Ctrl-C before this node started: all nodes or none, so the ones started are stopped again.
                    return _undo_torchrun(g, started, m, NotStarted(f"{m.host}: not started: interrupted (Ctrl-C)"))
                except KimiEagleError as e:
                    # One node refused: the ones already started would wait at the rendezvous for it forever.
                    return _undo_torchrun(g, started, m, e)
                started.append((m, s, job.id))
        outcomes = []
        for m, _, job_id in started:
            m.job_id, m.error, m.unreachable = job_id, None, False
            outcomes.append(StartOutcome(m.host, "started", job_id, layout.Shape.describe(shape_of(m))))
        return outcomes
    finally:
        for s in sessions:
            s.close()


def _undo_torchrun(g: GroupJob, started, refused: Member, error: KimiEagleError) -> list[StartOutcome]:
    """Stop the nodes that started before `refused` failed: a torchrun group runs on all its nodes or on none."""
    refused.error, refused.unreachable = str(error), is_transport_failure(error)
    outcomes = [StartOutcome(refused.host, "failed", None, str(error), error)]
    for m, s, job_id in started:
        try:
            scheduler.for_host(s.host).stop(s, job_id, grace=5.0)
            what = f"stopped again: {refused.host} did not start ({error})"
        except KimiEagleError as e:
            what = f"could not be stopped after {refused.host} did not start: {e}"
        # stopped for the refused node's sake: its kind of failure is theirs too (a connection's is exit 5)
        m.job_id, m.error, m.unreachable = job_id, what, is_transport_failure(error)
        outcomes.append(StartOutcome(m.host, "failed", job_id, f"job {job_id} {what}", error))
    tried = {refused.host} | {m.host for m, _, _ in started}
    for m in g.members:
        if m.host not in tried:
            m.error, m.unreachable = f"not started: {refused.host} did not start", is_transport_failure(error)
            outcomes.append(StartOutcome(m.host, "failed", None, m.error, error))
    return outcomes


def _same_kind(e: KimiEagleError, message: str) -> KimiEagleError:
    """An error of e's class (so of its exit code) with another message."""
    try:
        return type(e)(message, result=e.result)
    except TypeError:
        err = KimiEagleError(message, result=e.result)
        err.exit_code = e.exit_code
        return err


# -- status / stop / logs -----------------------------------------------------------------------------
def _member_status(inventory, g: GroupJob, members: list[Member] | None = None):
    members = [m for m in (members or g.members) if m.job_id]
    by_host = {m.host: m for m in members}
    hosts = [inventory.hosts[m.host] for m in members if m.host in inventory.hosts]
    return each_host(hosts, lambda s: scheduler.for_host(s.host).status(s, by_host[s.name].job_id)[0]) if hosts else []


@dataclass
class MemberState:
    host: str
    shape: str
    job: Job | None
    state: str  # the job's state, or unreachable / not started
    error: str | None = None
    unreachable: bool = False  # the state is unknown, or the job never started, for the connection's sake alone

    def as_dict(self) -> dict:
        return {"host": self.host, "shape": self.shape, "state": self.state, "error": self.error,
                "unreachable": self.unreachable,
                "job": self.job.as_dict() if self.job else None}


def status(inventory, g: GroupJob) -> tuple[str, list[MemberState]]:
    """The group's state (worst member first, see ORDER) and each member's."""
    outcomes = {o.host: o for o in _member_status(inventory, g)}
    rows = []
    for m in g.members:
        desc = layout.Shape.describe(shape_of(m))
        o = outcomes.get(m.host)
        if not m.job_id:
            rows.append(MemberState(m.host, desc, None, "unreachable" if m.unreachable else "failed",
                                    m.error or "not started", m.unreachable))
        elif o is None or not o.ok:
            rows.append(MemberState(m.host, desc, None, "unreachable", str(o.error) if o else "host not in the inventory",
                                    o is not None and is_transport_failure(o.error)))
        else:
            rows.append(MemberState(m.host, desc, o.value, o.value.state, m.error if m.unreachable else None,
                                    m.unreachable and o.value.state == "stopped"))
    return overall([r.state for r in rows]), rows


def overall(states: list[str]) -> str:
    for s in ORDER:
        if s in states:
            return "failed" if s in ("lost", "unreachable") else s
    return "failed"


def exit_code(state: str, rows: list[MemberState] | None = None) -> int:
    """The group's exit code: its state's; a failed group whose only trouble is hosts that could not be
    reached (nothing failed on a host, nothing was stopped) is the connection's, 5."""
    if state == "ending" and rows:  # the others succeeded; the shells of the `ending` ones have exited: their codes
        return max(exit_code_of(r.state, r.job.exit_code if r.job else None) for r in rows if r.state == "ending")
    code = STATE_EXIT.get(state, STATE_EXIT["failed"])
    if code == EXIT_FAILED and rows:
        bad = [r for r in rows if r.state != "succeeded"]
        if bad and all(r.unreachable for r in bad):
            return EXIT_TRANSPORT
    return code


def _in_inventory(inventory, g: GroupJob, not_done: str) -> tuple[list[Member], list[HostOutcome]]:
    """The members with a job whose host this inventory names, and an error for each other one, naming its job and
    host: a member left out silently was a `stop` that exited 0 while that job ran on, holding its GPUs."""
    here, missing = [], []
    for m in g.members:
        if not m.job_id:
            continue
        if m.host in inventory.hosts:
            here.append(m)
        else:
            # exit 1, not 2: the others' part was done; this one was not (a person must pick the inventory)
            missing.append(HostOutcome(m.host, error=KimiEagleError(
                f"{m.host}: not in this inventory ({inventory.path}); its job {m.job_id} was not {not_done}: use the "
                f"inventory that names host {m.host}")))
    return here, missing


def stop(inventory, g: GroupJob, grace: float = 10.0):
    """Stop every member's job (in parallel); one host's trouble does not keep the others running."""
    members, missing = _in_inventory(inventory, g, "stopped")
    by_host = {m.host: m for m in members}
    hosts = [inventory.hosts[m.host] for m in members]
    stopped = each_host(hosts, lambda s: scheduler.for_host(s.host).stop(s, by_host[s.name].job_id, grace)) if hosts else []
    return sorted(stopped + missing, key=lambda o: g.hosts.index(o.host))


def follow(inventory, g: GroupJob, printer_for, *, follow: bool = True, tail: int | None = None, on_reconnect=None,
           hosts: set[str] | None = None):
    """Every member's log at once (or only `hosts`'), each line through printer_for(label) (label = host, or host:task).

    Returns {host: FollowResult or the error}; a host that cannot be followed is reported, the others go on.
    """
    lock = threading.Lock()
    members, missing = _in_inventory(inventory, g, "read")
    results: dict[str, object] = {o.host: o.error for o in missing if hosts is None or o.host in hosts}

    def locked(label):
        p = printer_for(label)

        def emit(kind, text):
            with lock:
                p(kind, text)

        return emit

    def one(m: Member):
        host = inventory.hosts[m.host]
        try:
            results[m.host] = scheduler.for_host(host).follow(
                host, m.job_id, lambda t: locked(f"{m.host}:{t}" if t else m.host), follow=follow, tail=tail,
                on_reconnect=(lambda n, w: on_reconnect(m.host, n, w)) if on_reconnect else None)
        except KimiEagleError as e:
            results[m.host] = e
        except Exception as e:  # noqa: BLE001 - one host's trouble never ends the others' streams
            results[m.host] = KimiEagleError(f"{m.host}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=one, args=(m,), daemon=True) for m in members if hosts is None or m.host in hosts]
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.2)  # short joins keep Ctrl-C deliverable to the main thread
    return results
