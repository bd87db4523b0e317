"""`hosts trust`: the key a host offers now, recorded in known_hosts on request (hostkeys.py checks it later)."""

from __future__ import annotations

from ..errors import ConfigError, HostUnreachable
from . import hostkeys


def offered_key(host):
    """The key a host offers now, resolved through ~/.ssh/config like a real connection."""
    from fabric import Config, Connection

    if host.transport != "ssh":
        raise ConfigError(f"{host.name}: transport is {host.transport}; only ssh hosts have host keys")
    conn = Connection(host.address, user=host.user, port=host.port, config=Config())
    if conn.gateway:
        # Fetching the key here would mean trusting the jump host first: `hosts check` names each unknown key on
        # the way, with the exact line to record.
        raise ConfigError(f"{host.name}: reaches its host through ProxyJump, which `hosts trust` does not go through; "
                          f"run `kimi-eagle hosts check {host.name}`: it names each key not yet trusted on the way and "
                          f"the line to record it")
    try:
        key = hostkeys.fetch_key(conn.host, conn.port, host.connect_timeout)
    except OSError as e:
        raise HostUnreachable(f"{host.name}: cannot reach {conn.host}:{conn.port}: {e}") from None
    return conn.host, conn.port, key


def trust(host, key_hostname: str, port: int, key, *, replace: str | None = None):
    """Record the offered key; a changed key is refused unless `replace` names the old fingerprint.
    Returns hostkeys.Recorded (path, whether a line was added, old entries removed)."""
    return hostkeys.record(host.known_hosts, key_hostname, port, key, name=host.name, replace=replace)
