"""Transports behind one interface: `ssh` (fabric/paramiko) and `local` (this machine)."""

from __future__ import annotations

from .base import CommandResult, Transport


def open_transport(host) -> Transport:
    """A transport for one host, for the length of one CLI command. Connects lazily."""
    if host.transport == "local":
        from .local import LocalTransport

        return LocalTransport(host)
    from .ssh import SSHTransport

    return SSHTransport(host)


__all__ = ["CommandResult", "Transport", "open_transport"]
