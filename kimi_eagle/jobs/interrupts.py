"""Ctrl-C held back while a job is being started: from the user's side a start is whole (its id recorded and
printed) or nothing (nothing runs, nothing is left on the host)."""

from __future__ import annotations

import contextlib
import signal
import threading

from ..errors import KimiEagleError


class StartInterrupted(KeyboardInterrupt):
    """Ctrl-C came while a job was starting and the job had started: `message` names it (exit 130)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    @classmethod
    def for_job(cls, host: str, job_id: str, step: str) -> "StartInterrupted":
        return cls(f"[{host}] interrupted after job {job_id} ({step}) had started; it runs on: kimi-eagle logs "
                   f"{job_id} --follow, or stop it: kimi-eagle stop {job_id} --host {host}")

    @classmethod
    def for_group(cls, group_job_id: str, hosts: list[str]) -> "StartInterrupted":
        return cls(f"interrupted after group job {group_job_id} had started on {', '.join(hosts)}; see it: "
                   f"kimi-eagle status {group_job_id}, or stop it: kimi-eagle stop {group_job_id}")


# What this process started and recorded but has not shown the user yet (a job, a group job). A Ctrl-C that lands
# outside every naming block, in the few instructions between a start's end and its caller's naming block, reaches
# the command line's top as a plain KeyboardInterrupt; what_to_say() names what started from this.
_unshown: StartInterrupted | None = None


def recorded(interrupt: StartInterrupted) -> None:
    """A start recorded its job: until shown(), a Ctrl-C that ends the command says `interrupt`."""
    global _unshown
    _unshown = interrupt


def shown() -> None:
    """The user has been shown what started."""
    global _unshown
    _unshown = None


def what_to_say(interrupt: BaseException | None) -> str | None:
    """The line a command ended by Ctrl-C prints: the started job's, when one started and was not shown yet."""
    message = getattr(interrupt, "message", None)
    return message or (_unshown.message if _unshown is not None else None)


@contextlib.contextmanager
def naming(interrupt: StartInterrupted):
    """After a start and before its id is shown: a Ctrl-C in the block is `interrupt`, which names what started."""
    try:
        yield
    except StartInterrupted:
        raise
    except KeyboardInterrupt:
        raise interrupt from None


def naming_job(host: str, job_id: str, step: str):
    """After a job started and before its id is shown: a Ctrl-C in the block names the job (StartInterrupted)."""
    return naming(StartInterrupted.for_job(host, job_id, step))


@contextlib.contextmanager
def uploading(interrupted: "Noted", undo):
    """A start's upload of its job files, inside its deferred() block. On a failure, or once a Ctrl-C was noted,
    undo() (nothing of the job may stay) and the start ends; a host error after a Ctrl-C is taken as the Ctrl-C's
    doing and ends it as interrupted, not failed. Each call of the upload is a child that a Ctrl-C can end before it
    runs (ended_before_it_ran), and each fails its own way: an exit -2, a lease with no answer."""
    try:
        yield
    except BaseException as e:
        undo()
        if interrupted and isinstance(e, KimiEagleError):
            raise KeyboardInterrupt from None
        raise
    if interrupted:
        undo()
        raise KeyboardInterrupt


def ended_before_it_ran(exited: int | None) -> bool:
    """Whether a host call of a start died of the Ctrl-C its deferred() block holds back, before it ran. A local
    call's child sits in the terminal's process group from fork to setsid, with CPython's vfork child already back on
    the default handlers: a Ctrl-C there ends it before it runs (once in its own session, it is out of reach)."""
    return exited == -signal.SIGINT


class Noted:
    """The SIGINTs a deferred() block noted: truthy once one came. `owner`: this block holds them back, so its
    caller reports them; a block inside another one (or in a thread the other one waits for) shares that one's
    notes (owner False) and only acts on them (cancels what has not started)."""

    def __init__(self, shared: "Noted | None" = None):
        self.owner = shared is None
        self._got: list = shared._got if shared is not None else []

    def note(self, *_) -> None:
        self._got.append(True)

    def __bool__(self) -> bool:
        return bool(self._got)


# The main thread's deferral in force. Only the main thread receives signals: a start run in a worker thread (a
# group's hosts start in threads) learns of a Ctrl-C through this, and cancels itself as the main thread would.
_active: Noted | None = None


@contextlib.contextmanager
def deferred():
    """SIGINT during the block is noted, not raised: the yielded Noted is true once it came.

    Nested in another deferral, or in a thread started while one is in force, the block shares that one's notes
    (owner False); in another thread outside any, it runs as it is (never noted)."""
    global _active
    if _active is not None:
        yield Noted(shared=_active)
        return
    if threading.current_thread() is not threading.main_thread():
        yield Noted(shared=Noted())  # notes no signal ever adds to
        return
    got = Noted()
    previous = signal.signal(signal.SIGINT, got.note)
    _active = got
    try:
        yield got
    finally:
        _active = None
        signal.signal(signal.SIGINT, previous)
