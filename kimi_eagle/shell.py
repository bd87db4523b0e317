"""Quoting for anything that reaches a shell. The only way values enter a command line."""

from __future__ import annotations

import shlex
from collections.abc import Iterable

from .errors import ConfigError


def quote(value) -> str:
    """Quote one value for POSIX sh. Refuses what a shell argument cannot carry (NUL)."""
    if value is None:
        raise ConfigError("a value for the shell is missing (None)")
    if isinstance(value, bool):
        value = "1" if value else "0"
    s = str(value)
    if "\x00" in s:
        raise ConfigError(f"value {s[:40]!r}… contains a NUL byte, which no shell argument can carry")
    return shlex.quote(s)


def join(argv: Iterable) -> str:
    return " ".join(quote(a) for a in argv)
