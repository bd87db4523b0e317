"""What `kimi-eagle render WHAT` can write: the same files the real commands upload."""

from __future__ import annotations

from .errors import ConfigError
from .host import HostSession


class _Offline:
    """A transport stand-in for rendering: it never connects."""

    def __init__(self, host):
        self.name = host.name

    def abspath(self, p):
        return p

    def close(self):
        pass


def files_for(what: str, step, host) -> dict[str, str]:
    session = HostSession(host, transport=_Offline(host))
    makers = {"probe": lambda: dict([session.render_payload("probe", "probe.py", [])])}
    makers.update(_extra)
    if what not in makers:
        raise ConfigError(f"render: unknown WHAT {what!r} (choose from {', '.join(sorted(makers))})")
    return makers[what](session, step) if what in _extra else makers[what]()


_extra: dict = {}


def register(name: str, fn) -> None:
    """fn(session, step) -> {relative path: text}"""
    _extra[name] = fn
