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
    from .backend import for_host

    if not step:
        raise ConfigError("render job: name the step, e.g. `kimi-eagle render job extract`")
    return for_host(session.host).render(session, step, [])


def _gpu_reset(session, step):
    from .gpu import reset_args

    return session.render_payload("gpu-reset", "ops/gpu_reset.py", reset_args(session))


def _preflight(session, step):
    from .preflight import preflight_args

    return session.render_payload("preflight", "ops/preflight.py", preflight_args(session, step or "all"))


def _patch(session, step):
    from .patch import render_files

    return render_files(session, step)


def files_for(what: str, step, host) -> dict[str, str]:
    session = HostSession(host, transport=Offline(host))
    if what not in MAKERS:
        raise ConfigError(f"render: unknown WHAT {what!r} (choose from {', '.join(sorted(MAKERS))})")
    return MAKERS[what](session, step)


# WHAT -> fn(session, step) -> {path relative to the workdir: text}
MAKERS = {
    "probe": lambda session, step: session.render_payload("probe", "ops/probe.py", []),
    "job": _job,
    "gpu-reset": _gpu_reset,
    "preflight": _preflight,
    "patch": _patch,
}
