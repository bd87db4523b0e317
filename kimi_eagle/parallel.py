"""Run one function per host in parallel; each host's outcome is kept, none is lost to another's error."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable

from .errors import KimiEagleError


@dataclass
class HostOutcome:
    host: str
    value: Any = None
    error: KimiEagleError | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


def each_host(hosts, fn: Callable, max_workers: int = 16) -> list[HostOutcome]:
    """fn(session) for every host, each over its own connection, closed afterwards."""
    from .host import HostSession

    def one(host):
        session = HostSession(host)
        try:
            return HostOutcome(host.name, fn(session))
        except KimiEagleError as e:
            return HostOutcome(host.name, error=e)
        except Exception as e:  # a bug or an unexpected library error: still per host
            return HostOutcome(host.name, error=KimiEagleError(f"{host.name}: {type(e).__name__}: {e}"))
        finally:
            session.close()

    if len(hosts) == 1:
        return [one(hosts[0])]
    with ThreadPoolExecutor(max_workers=min(max_workers, len(hosts))) as pool:
        return list(pool.map(one, hosts))
