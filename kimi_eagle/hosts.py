"""`hosts check` and `hosts trust`: what a host has, and recording its key on request."""

from __future__ import annotations

from .errors import ConfigError, HostUnreachable
from .parallel import each_host


def check(hosts) -> list:
    """Probe each host in parallel with one uploaded script. Returns HostOutcome values of probe dicts."""

    def probe(session):
        res = session.run_payload("probe", "ops.probe", [])
        return res.data

    return each_host(hosts, probe)


def offered_key(host):
    """The key a host offers now, resolved through ~/.ssh/config like a real connection."""
    from fabric import Config, Connection

    from . import hostkeys

    if host.transport != "ssh":
        raise ConfigError(f"{host.name}: transport is {host.transport}; only ssh hosts have host keys")
    conn = Connection(host.address, user=host.user, port=host.port, config=Config())
    if conn.gateway:
        raise ConfigError(f"{host.name}: reaches its host through ProxyJump; trust it with ssh-keyscan through the jump host")
    try:
        key = hostkeys.fetch_key(conn.host, conn.port, host.connect_timeout)
    except OSError as e:
        raise HostUnreachable(f"{host.name}: cannot reach {conn.host}:{conn.port}: {e}") from None
    return conn.host, conn.port, key


def trust(host, key_hostname: str, port: int, key, *, replace: str | None = None):
    """Record the offered key; a changed key is refused unless `replace` names the old fingerprint.
    Returns hostkeys.Recorded (path, whether a line was added, old entries removed)."""
    from . import hostkeys

    return hostkeys.record(host.known_hosts, key_hostname, port, key, name=host.name, replace=replace)
