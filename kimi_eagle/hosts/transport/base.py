"""The operations every transport offers, with the same semantics on ssh and local.

Commands are shell strings run by the host's shell in the user's home directory;
callers build them with `kimi_eagle.shell.join` so no value reaches the shell unquoted.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field

from ...errors import CommandError, ConfigError


# A command cut off by its `timeout` (run's): it exits 124, as under coreutils' timeout, with this last line on stderr,
# on every transport. What it did on the host before is unknown (a submission may have gone through).
TIMED_OUT = 124
TIMED_OUT_NOTE = b"\nkimi-eagle: command timed out\n"


@dataclass
class CommandResult:
    host: str
    command: str
    exited: int
    stdout: str
    stderr: str
    duration: float = 0.0
    stdout_bytes: bytes = b""   # as received: a log's tail may end inside a character the next read completes

    @property
    def ok(self) -> bool:
        return self.exited == 0

    @property
    def timed_out(self) -> bool:
        return self.exited == TIMED_OUT and self.stderr.endswith(TIMED_OUT_NOTE.decode())

    def check(self, what: str | None = None) -> "CommandResult":
        if not self.ok:
            tail = (self.stderr.strip() or self.stdout.strip()).splitlines()[-1:] or [""]
            raise CommandError(
                f"{self.host}: {what or self.command} exited {self.exited}: {tail[0]}", result=self
            )
        return self


@dataclass
class Stream:
    """A running remote command whose stdout is read in chunks (for log following)."""

    chunks: object  # iterator of bytes
    close: object  # callable
    exit_status: object  # callable -> int | None
    extra: dict = field(default_factory=dict)


class HashingReader:
    """A file wrapper that hashes what is read through it (one pass over a large file, not two)."""

    def __init__(self, f, progress=None):
        import hashlib

        self.f, self.h, self.progress, self.done = f, hashlib.sha256(), progress, 0

    def read(self, n=-1):
        data = self.f.read(n)
        self.h.update(data)
        self.done += len(data)
        if self.progress and data:
            self.progress(self.done, None)
        return data

    def hexdigest(self) -> str:
        return self.h.hexdigest()


class Transport(abc.ABC):
    def __init__(self, host):
        self.host = host
        self._home: str | None = None

    @property
    def name(self) -> str:
        return self.host.name

    # -- commands ---------------------------------------------------------
    @abc.abstractmethod
    def _exec(self, command: str, stdin: bytes | None, timeout: float | None) -> tuple[int, bytes, bytes]: ...

    def run(self, command: str, *, stdin: bytes | None = None, timeout: float | None = None, check: bool = False, what: str | None = None) -> CommandResult:
        t0 = time.monotonic()
        code, out, err = self._exec(command, stdin, timeout)
        result = CommandResult(
            self.name, command, code, out.decode("utf-8", "replace"), err.decode("utf-8", "replace"), time.monotonic() - t0,
            out,
        )
        if check and self._python_missing(result):
            raise ConfigError(f"{self.name}: python {self.host.python} not found on the host — set `python:` in the "
                              f"inventory to the host's interpreter")
        return result.check(what) if check else result

    def _python_missing(self, result: CommandResult) -> bool:
        """The shell could not start the host's interpreter (exit 127, the shell naming it): the inventory's
        `python:` is wrong for this host, whatever command needed it."""
        python = getattr(self.host, "python", None) or ""
        name = python.rstrip("/").rsplit("/", 1)[-1]
        said = result.stderr.strip().splitlines()[-1:] or [""]
        return result.exited == 127 and bool(name) and name in said[0] and (
            "not found" in said[0] or "No such file" in said[0] or "Permission denied" in said[0])

    @abc.abstractmethod
    def stream(self, command: str) -> Stream:
        """Start `command` and return its stdout as a chunk iterator; ends when the command ends."""

    # -- files ------------------------------------------------------------
    @abc.abstractmethod
    def write_bytes(self, path: str, data: bytes, mode: int | None = None) -> None:
        """Write `data` to `path` (not atomic: callers write a temporary name, then rename)."""

    @abc.abstractmethod
    def upload_fileobj(self, fileobj, path: str, mode: int | None = None) -> None:
        """Copy a readable file object to `path` (not atomic; see write_bytes)."""

    def upload_hashed(self, local_path: str, path: str, mode: int, progress=None) -> tuple[str, str | None]:
        """Upload a local file, hashing it in the same pass.

        Returns (sha256 of what was read here, sha256 the host computed while writing, or None when the
        caller must verify on the host afterwards).
        """
        with open(local_path, "rb") as f:
            reader = HashingReader(f, progress)
            self.upload_fileobj(reader, path, mode)
        return reader.hexdigest(), None

    @abc.abstractmethod
    def rename(self, src: str, dst: str) -> None:
        """Atomic rename on the host, replacing dst."""

    @abc.abstractmethod
    def read_bytes(self, path: str, offset: int = 0) -> bytes: ...

    @abc.abstractmethod
    def exists(self, path: str) -> bool: ...

    @abc.abstractmethod
    def makedirs(self, path: str) -> None: ...

    @abc.abstractmethod
    def _home_dir(self) -> str: ...

    def abspath(self, path: str) -> str:
        """Expand ~ and make relative paths relative to the home directory, on the host."""
        if self._home is None:
            self._home = self._home_dir()
        if path == "~" or path.startswith("~/"):
            return self._home + path[1:]
        if not path.startswith("/"):
            return f"{self._home}/{path}"
        return path

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
