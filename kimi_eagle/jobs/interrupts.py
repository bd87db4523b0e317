"""Ctrl-C held back while a job is being started: from the user's side a start is whole (its id recorded and
printed) or nothing (nothing runs, nothing is left on the host)."""

from __future__ import annotations

import contextlib
import signal
import threading


class StartInterrupted(KeyboardInterrupt):
    """Ctrl-C came while a job was starting and the job had started: `message` names it (exit 130)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    @classmethod
    def for_job(cls, host: str, job_id: str, step: str) -> "StartInterrupted":
        return cls(f"[{host}] interrupted after job {job_id} ({step}) had started; it runs on: kimi-eagle logs "
                   f"{job_id} --follow, or stop it: kimi-eagle stop {job_id} --host {host}")


@contextlib.contextmanager
def naming_job(host: str, job_id: str, step: str):
    """After a job started and before its id is shown: a Ctrl-C in the block names the job (StartInterrupted)."""
    try:
        yield
    except StartInterrupted:
        raise
    except KeyboardInterrupt:
        raise StartInterrupted.for_job(host, job_id, step) from None


@contextlib.contextmanager
def deferred():
    """SIGINT during the block is noted, not raised: the yielded list is non-empty once it came.

    Only the main thread receives signals; elsewhere the block runs as it is."""
    got: list = []
    if threading.current_thread() is not threading.main_thread():
        yield got
        return
    previous = signal.signal(signal.SIGINT, lambda *_: got.append(True))
    try:
        yield got
    finally:
        signal.signal(signal.SIGINT, previous)
