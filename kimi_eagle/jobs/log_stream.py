"""Following a job's log: one `tail -F` channel, a client-side byte offset, reconnect with backoff.

The byte offset counts what was received, so a resumed stream starts exactly where the last one
stopped: no line lost, none repeated. Decoding is incremental, so a character split across reads
stays intact.
"""

from __future__ import annotations

import codecs
import re
import time
from dataclasses import dataclass
from typing import Callable

from ..errors import ConnectionFailed, ConnectionLost, HostError, KimiEagleError
from ..hosts.session import HostSession
from ..shell import join
from . import direct, job_info


_BREAK = re.compile(r"\r\n|\n|\r")


class LineSplitter:
    """Bytes in; complete lines ('line') and carriage-return updates ('progress') out."""

    def __init__(self, emit: Callable[[str, str], None]):
        self.emit = emit
        self.decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.pending: list[str] = []  # text after the last break; joined only when a break arrives

    def feed(self, data: bytes) -> None:
        text = self.decoder.decode(data)
        if "\n" not in text and "\r" not in text:
            # Part of a long line: keep the piece, do not rebuild and rescan the whole line for every read
            # (a 10 MB line arriving 64 KiB at a time was quadratic).
            if text:
                self.pending.append(text)
            return
        buf = "".join(self.pending) + text
        start = 0
        # One pass with an index: slicing the remainder after every line would be quadratic in the chunk size.
        for m in _BREAK.finditer(buf):
            end, brk = m.start(), m.group()
            if brk == "\r" and m.end() == len(buf):
                break  # a lone \r at the end may be half of \r\n: wait for more
            piece = buf[start:end]
            if brk == "\r":
                if piece:
                    self.emit("progress", piece)
            else:
                self.emit("line", piece)
            start = m.end()
        self.pending = [buf[start:]] if start < len(buf) else []

    def flush(self) -> None:
        rest = "".join(self.pending) + self.decoder.decode(b"", final=True)
        self.pending = []
        if rest:
            self.emit("line", rest.rstrip("\r"))


@dataclass
class FollowResult:
    job: job_info.Job
    offset: int
    reconnects: int              # outages: what the user was told of (one "reconnecting" line each)
    reconnect_attempts: int = 0  # new connections tried in all (an outage retried 5 times: 5)


def _retryable(e: BaseException) -> bool:
    import paramiko

    return isinstance(e, (ConnectionError, HostError, EOFError, OSError, paramiko.SSHException))


# The first wait after a drop, and the longest: a flapping link (up for a moment, then down again) is retried ever more
# slowly instead of every half second for hours.
FIRST_WAIT, MAX_WAIT = 0.5, 20.0
# A connection that lasted this long was a working link: its drop is a new outage (the user is told, waits start
# short again). One that dropped sooner continues the outage it ended.
STABLE_AFTER = 30.0


class Reconnects:
    """When a follower's connection drops: retry connection trouble with backoff, give up after a while.

    An outage runs from a drop until a connection that lasted STABLE_AFTER: the user hears of it once (on_reconnect,
    with the outage's number and first wait), and its waits double up to MAX_WAIT whether the attempts fail or
    connect only briefly."""

    def __init__(self, host, job_id: str, give_up_after: float, on_reconnect: Callable[[int, float], None] | None,
                 was_connected: bool = False, stable_after: float = STABLE_AFTER):
        self.host, self.job_id, self.give_up_after, self.on_reconnect = host, job_id, give_up_after, on_reconnect
        self.stable_after = stable_after
        self.count, self.outages, self.backoff, self.down_since, self.up_since = 0, 0, FIRST_WAIT, None, None
        self.in_outage = False
        # Only a connection that once worked is retried: a host that refuses, sends no SSH banner or rejects us
        # from the start is one line at once, not ten minutes of "reconnecting". One that let us in and died
        # mid-command (ConnectionLost) worked, even before the follower's first answer came back.
        self.was_connected = was_connected

    def connected(self) -> None:
        """Reached (again): the give-up clock stops; the connection's age is timed from its first call."""
        self.down_since, self.was_connected = None, True
        self.up_since = self.up_since or time.monotonic()

    def dropped(self, e: Exception, session: HostSession) -> HostSession:
        """Re-raise what is not connection trouble; else wait and return a new session."""
        if not _retryable(e) or isinstance(e, KimiEagleError) and not isinstance(e, HostError):
            raise e
        self.was_connected = self.was_connected or isinstance(e, ConnectionLost)
        if not self.was_connected:
            session.close()
            if isinstance(e, KimiEagleError):
                raise e
            raise ConnectionFailed(f"{self.host.name}: cannot follow {self.job_id}: {e}") from None
        session.close()
        now = time.monotonic()
        lasted = self.up_since is not None and now - self.up_since >= self.stable_after
        self.up_since = None
        self.down_since = self.down_since or now
        if now - self.down_since > self.give_up_after:
            raise ConnectionFailed(f"{self.host.name}: connection lost for {self.give_up_after:.0f}s while following {self.job_id}; "
                            f"resume with: kimi-eagle logs {self.job_id} --follow --host {self.host.name}") from None
        self.count += 1
        if lasted or not self.in_outage:
            self.in_outage, self.backoff = True, FIRST_WAIT
            self.outages += 1
            if self.on_reconnect:
                self.on_reconnect(self.outages, self.backoff)
        time.sleep(self.backoff)
        self.backoff = min(self.backoff * 2, MAX_WAIT)
        return HostSession(self.host)


def follow(host, job_id: str, emit: Callable[[str, str], None], *, follow: bool = True, tail: int | None = None,
           offset: int = 0, session: HostSession | None = None, give_up_after: float = 600.0,
           on_reconnect: Callable[[int, float], None] | None = None, stable_after: float = STABLE_AFTER) -> FollowResult:
    """Stream a job's log through `emit(kind, text)` until the job ends (or once, without follow)."""
    given = session
    session = session or HostSession(host)
    splitter = LineSplitter(emit)
    reconnects = Reconnects(host, job_id, give_up_after, on_reconnect, was_connected=given is not None,
                            stable_after=stable_after)
    first = True
    while True:
        try:
            job = direct.status(session, job_id)[0]
            # Reached (again): a later drop is retried from a fresh give-up clock (reset only when a stream ended, a
            # job followed for hours gave up at its second drop, timed from its first); its backoff starts afresh
            # once this connection has lasted (Reconnects).
            reconnects.connected()
            if first and tail is not None:
                # The last N lines of what exists now; then follow from the end of those bytes.
                res = session.transport.run(f"head -c {int(job.log_size)} -- {join([job.log])} | tail -n {int(tail)}", check=True)
                splitter.feed(res.stdout_bytes)
                offset = job.log_size
            first = False
            running = follow and job.state == "running"
            if running:
                # tail ends with the process it watches: the shell, or once that is gone, one of the processes left
                watched = job.left[0] if job.left else job.pid
                cmd = f"exec tail -c +{offset + 1} -F --pid={int(watched)} -- {join([job.log])} 2>/dev/null"
            else:
                cmd = f"exec tail -c +{offset + 1} -- {join([job.log])}"
            stream = session.transport.stream(cmd)
            try:
                for chunk in stream.chunks:
                    offset += len(chunk)
                    splitter.feed(chunk)
            finally:
                stream.close()
            if not follow:
                break
            job = direct.status(session, job_id)[0]
            if job.state in job_info.TERMINAL and job.log_size <= offset:
                break
        except KeyboardInterrupt:
            session.close()
            raise
        except Exception as e:  # noqa: BLE001 - only connection trouble is retried
            session = reconnects.dropped(e, session)
    splitter.flush()
    session.close()
    return FollowResult(job, offset, reconnects.outages, reconnects.count)
