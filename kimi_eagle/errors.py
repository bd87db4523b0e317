"""Exceptions that carry what the CLI needs: a one-line message and an exit code.

Exit codes (documented in the README):
  0  success
  1  an operation failed (a host, a command, a job)
  2  bad usage, configuration or input; nothing was done
  3  a job is still running (logs/status without --follow)
  4  a job was stopped or lost
  5  the connection failed: the host could not be reached (refused, timed out, DNS, the SSH handshake) or the
     connection was lost mid-command: the network, not the job
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_RUNNING = 3
EXIT_STOPPED = 4
EXIT_TRANSPORT = 5


class KimiEagleError(Exception):
    """Base error; `exit_code` tells the CLI how to leave."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, result=None):
        super().__init__(message)
        self.result = result  # a result object, when the error ends an operation that produced one


class ConfigError(KimiEagleError):
    """Inventory, flags or input files are wrong. Raised before any host is contacted."""

    exit_code = EXIT_USAGE


class HostError(KimiEagleError):
    """A host could not be reached, or refused us (unknown/changed key, auth)."""


class ConnectionFailed(HostError):
    """The network's fault (exit 5): no connection could be made, or it was lost mid-command."""

    exit_code = EXIT_TRANSPORT


class ConnectionLost(ConnectionFailed):
    """A connection that was made (the host answered and let us in) died mid-command: the link, not the host."""


class HostUnreachable(ConnectionFailed):
    """No connection at all: nothing listens, the address does not resolve, the SSH handshake failed."""


class HostKeyError(HostError):
    """The host offered a key we do not trust. Never auto-added."""


class CommandError(KimiEagleError):
    """A command on a host exited non-zero."""


def is_transport_failure(e: BaseException) -> bool:
    """Whether `e` is the connection's fault (exit 5), not the host's command or the job's."""
    if isinstance(e, KimiEagleError):
        return isinstance(e, ConnectionFailed)
    import socket

    import paramiko

    return isinstance(e, (ConnectionError, EOFError, socket.timeout, paramiko.SSHException))


def failure_exit(errors) -> int:
    """The exit code of a command over several hosts where some failed: 5 when every failure was the
    connection's, 2 when every failure was the inventory's (a missing key file), else 1 (a host's command, a
    check or a job failed)."""
    errors = [e for e in errors if e is not None]
    if errors and all(isinstance(e, ConfigError) for e in errors):
        return EXIT_USAGE
    return EXIT_TRANSPORT if errors and all(is_transport_failure(e) for e in errors) else EXIT_FAILED
