"""What `kimi-eagle render WHAT` can write: the same files the real commands upload."""

from __future__ import annotations

from .errors import ConfigError
from .host import HostSession


class Offline:
    """A transport stand-in for rendering and validating: it never connects."""

    def __init__(self, host):
        self.name = host.name

    def abspath(self, p):
        return p

    def close(self):
        pass


def _job(session, step):
    from .jobs import render_job

    if not step:
        raise ConfigError("render job: name the step, e.g. `kimi-eagle render job extract`")
    return dict([render_job(session, step, [])])


def _gpu_reset(session, step):
    from .gpu import reset_args

    return dict([session.render_payload("gpu-reset", "gpu_reset.py", reset_args(session))])


def _preflight(session, step):
    from .preflight import preflight_args

    return dict([session.render_payload("preflight", "preflight.py", preflight_args(session, step or "all"))])


def files_for(what: str, step, host) -> dict[str, str]:
    session = HostSession(host, transport=Offline(host))
    makers = dict(_extra)
    if what not in makers:
        raise ConfigError(f"render: unknown WHAT {what!r} (choose from {', '.join(sorted(makers))})")
    return makers[what](session, step)


_extra: dict = {
    "probe": lambda session, step: dict([session.render_payload("probe", "probe.py", [])]),
    "job": _job,
    "gpu-reset": _gpu_reset,
    "preflight": _preflight,
}


def register(name: str, fn) -> None:
    """fn(session, step) -> {relative path: text}"""
    _extra[name] = fn
