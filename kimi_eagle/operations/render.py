"""What `kimi-eagle render WHAT` can write: the same files the real commands upload."""

from __future__ import annotations

from ..errors import ConfigError
from ..hosts.session import HostSession
from ..hosts.transport.offline import Offline


def _job(session, step, extra):
    from ..jobs.scheduler import for_host

    if not step:
        raise ConfigError("render job: name the step, e.g. `kimi-eagle render job extract`")
    return for_host(session.host).render(session, step, extra)


def _gpu_reset(session, step, extra):
    from .gpu_reset import reset_args

    return session.render_payload("gpu-reset", "ops.gpu_reset", reset_args(session, extra=extra))


def _preflight(session, step, extra):
    from .preflight import preflight_args

    return session.render_payload("preflight", "ops.preflight", preflight_args(session, step or "all", extra))


def _patch(session, step, extra):
    from .deploy_patch import render_files

    if extra:
        raise ConfigError(f"render patch: takes no flags after -- (got {' '.join(extra)}); use --patch-set with deploy-patch")
    return render_files(session, step)


def _probe(session, step, extra):
    return session.render_payload("probe", "ops.probe", extra)


def files_for(what: str, step, host, extra: list[str] | None = None) -> dict[str, str]:
    """`extra`: the flags after `--`, as the real command passes them (`render job exec -- CMD ARGS`)."""
    session = HostSession(host, transport=Offline(host))
    if what not in MAKERS:
        raise ConfigError(f"render: unknown WHAT {what!r} (choose from {', '.join(sorted(MAKERS))})")
    return MAKERS[what](session, step, list(extra or []))


# WHAT -> fn(session, step, extra flags) -> {path relative to the workdir: text}
MAKERS = {
    "probe": _probe,
    "job": _job,
    "gpu-reset": _gpu_reset,
    "preflight": _preflight,
    "patch": _patch,
}
