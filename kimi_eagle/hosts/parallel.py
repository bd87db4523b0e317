"""Run one function per host in parallel; each host's outcome is kept, none is lost to another's error."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import ConnectionFailed, KimiEagleError, is_transport_failure


@dataclass
class HostOutcome:
    host: str
    value: Any = None
    error: KimiEagleError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def failure_exit(outcomes) -> int:
    """Exit code when not every host succeeded: 5 when each failure was the connection's, else 1."""
    from ..errors import failure_exit as by_errors

    return by_errors(o.error for o in outcomes)


def each_host(hosts, fn: Callable, max_workers: int = 16, *, read_only: bool = False) -> list[HostOutcome]:
    """fn(session) for every host, each over its own connection, closed afterwards (`read_only`: a dry run's
    sessions, which never write to the host)."""
    from .session import HostSession

    def one(host):
        session = HostSession(host, read_only=read_only)
        try:
            return HostOutcome(host.name, fn(session))
        except KimiEagleError as e:
            return HostOutcome(host.name, error=e)
        except Exception as e:  # a dropped connection, a bug or an unexpected library error: still per host
            kind = ConnectionFailed if is_transport_failure(e) else KimiEagleError
            return HostOutcome(host.name, error=kind(f"{host.name}: {type(e).__name__}: {e}"))
        finally:
            session.close()

    if len(hosts) == 1:
        return [one(hosts[0])]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(hosts))) as pool:
        return list(pool.map(one, hosts))
