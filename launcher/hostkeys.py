"""Host-key verification. Keys come from ~/.ssh/known_hosts plus the inventory's known_hosts file.

An unknown key is refused with its type, its SHA256 fingerprint and the command that trusts it;
a changed key is always refused. Nothing is ever added without the user saying so.
"""

from __future__ import annotations

import base64
import hashlib
import os
from pathlib import Path

from .errors import HostKeyError


def fingerprint(key) -> str:
    digest = hashlib.sha256(key.asbytes()).digest()
    return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def known_host_name(hostname: str, port: int | None) -> str:
    return hostname if not port or port == 22 else f"[{hostname}]:{port}"


def system_known_hosts() -> Path:
    return Path(os.path.expanduser("~/.ssh/known_hosts"))


def load_into(client, extra: str | None) -> None:
    """Load every trusted key into a paramiko SSHClient and refuse unknown keys."""
    import paramiko

    client.load_system_host_keys()  # ~/.ssh/known_hosts; a missing file is fine
    if extra and os.path.exists(os.path.expanduser(extra)):
        # Into the system set, so SSHClient never treats this file as one it may save to.
        client.get_host_keys().load(os.path.expanduser(extra))

    class RefuseUnknown(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            raise UnknownHostKey(hostname, key)

    client.set_missing_host_key_policy(RefuseUnknown())


class UnknownHostKey(HostKeyError):
    def __init__(self, hostname: str, key, host_name: str | None = None):
        self.hostname, self.key = hostname, key
        super().__init__(self._message(host_name or hostname))

    def _message(self, name):
        return (
            f"{name}: unknown host key ({self.key.get_name()} {fingerprint(self.key)}) for {self.hostname}; "
            f"if you trust it, run: kimi-eagle hosts trust {name}"
        )

    def for_host(self, name: str) -> "UnknownHostKey":
        return UnknownHostKey(self.hostname, self.key, name)


def changed_key_error(name: str, hostname: str, got, expected) -> HostKeyError:
    return HostKeyError(
        f"{name}: HOST KEY CHANGED for {hostname}: offered {got.get_name()} {fingerprint(got)}, "
        f"known {expected.get_name()} {fingerprint(expected)}; refusing to connect (possible man-in-the-middle). "
        f"If the host was reinstalled, remove the old key with: ssh-keygen -R {hostname!r}"
    )


def fetch_key(hostname: str, port: int, timeout: float, sock=None):
    """The host key a server offers, without authenticating."""
    import socket

    import paramiko

    sock = sock or socket.create_connection((hostname, port), timeout=timeout)
    t = paramiko.Transport(sock)
    try:
        t.banner_timeout = timeout
        t.start_client(timeout=timeout)
        return t.get_remote_server_key()
    finally:
        t.close()


def record(path: str | None, hostname: str, port: int | None, key) -> Path:
    """Append one key to a known_hosts file (the inventory's, else ~/.ssh/known_hosts)."""
    target = Path(os.path.expanduser(path)) if path else system_known_hosts()
    target.parent.mkdir(parents=True, exist_ok=True)
    line = f"{known_host_name(hostname, port)} {key.get_name()} {key.get_base64()}\n"
    existing = target.read_text() if target.exists() else ""
    if existing and not existing.endswith("\n"):
        line = "\n" + line
    with open(target, "a") as f:
        f.write(line)
    os.chmod(target, 0o600)
    return target
