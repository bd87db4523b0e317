"""Exceptions that carry what the CLI needs: a one-line message and an exit code.

Exit codes (documented in the README):
  0  success
  1  an operation failed (a host, a command, a job)
  2  bad usage, configuration or input; nothing was done
  3  a job is still running (logs/status without --follow)
  4  a job was stopped or lost
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_RUNNING = 3
EXIT_STOPPED = 4


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


class HostUnreachable(HostError):
    """No connection at all: nothing listens, the address does not resolve, the SSH handshake failed."""


class HostKeyError(HostError):
    """The host offered a key we do not trust. Never auto-added."""


class CommandError(KimiEagleError):
    """A command on a host exited non-zero."""
