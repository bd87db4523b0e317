"""Host-key verification. Keys come from ~/.ssh/known_hosts plus the inventory's known_hosts file.

An unknown key is refused with its type, its SHA256 fingerprint and the command that trusts it;
a changed key is always refused, and replaced only on an explicit request naming the old fingerprint.
Nothing is ever added without the user saying so, and a key already recorded is never written twice.
"""

from __future__ import annotations

import base64
import hashlib
import os
from dataclasses import dataclass
from pathlib import Path

from ..errors import HostKeyError


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


def changed_key_error(name: str, hostname: str, got, expected, files: list[str] | None = None) -> HostKeyError:
    """`hostname` is the known_hosts name (`[host]:port` off port 22); `files` the known_hosts files we read."""
    return HostKeyError(
        f"{name}: HOST KEY CHANGED for {hostname}: offered {got.get_name()} {fingerprint(got)}, "
        f"known {expected.get_name()} {fingerprint(expected)}; refusing to connect (possible man-in-the-middle). "
        + _replace_hint(name, hostname, fingerprint(expected), fingerprint(got), files)
    )


def _replace_hint(name: str, hostname: str, old_fp: str, new_fp: str, files: list[str] | None) -> str:
    from ..shell import join

    holding = [f for f in (files or []) if any(e.fingerprint == old_fp for e in entries(f, hostname))]
    removal = "; ".join(join(["ssh-keygen", "-R", hostname, "-f", f]) for f in holding or files or [str(system_known_hosts())])
    return (f"If the host was reinstalled and you verified its new key out of band: "
            f"kimi-eagle hosts trust {name} --replace {old_fp} --fingerprint {new_fp} (or remove the old key: {removal})")


@dataclass
class Entry:
    """One known_hosts line that names a host."""

    path: str
    lineno: int
    key_type: str
    key_b64: str

    @property
    def fingerprint(self) -> str:
        digest = hashlib.sha256(base64.b64decode(self.key_b64)).digest()
        return "SHA256:" + base64.b64encode(digest).decode().rstrip("=")


def _names_match(field: str, hostname: str) -> bool:
    if field.startswith("|1|"):  # hashed (HashKnownHosts yes)
        from paramiko.hostkeys import HostKeys

        try:
            return HostKeys.hash_host(hostname, field) == field
        except Exception:  # a malformed salt names no host
            return False
    return hostname in field.split(",")


def entries(path: str | os.PathLike, hostname: str) -> list[Entry]:
    """The keys a known_hosts file records for `hostname` (a known_hosts name: `host` or `[host]:port`)."""
    p = Path(os.path.expanduser(str(path)))
    try:
        lines = p.read_text().splitlines()
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for n, line in enumerate(lines, 1):
        fields = line.split()
        if len(fields) < 3 or fields[0].startswith(("#", "@")):
            continue  # comments, and @cert-authority/@revoked markers, which are not plain trust
        if _names_match(fields[0], hostname):
            found.append(Entry(str(p), n, fields[1], fields[2]))
    return found


def trusted_files(extra: str | None) -> list[str]:
    """The known_hosts files consulted for a host: ~/.ssh/known_hosts, then the inventory's."""
    return [str(system_known_hosts())] + ([os.path.expanduser(extra)] if extra else [])


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


class ChangedKey(HostKeyError):
    """A host offers a key other than the one recorded: never recorded beside it."""


@dataclass
class Recorded:
    path: Path
    added: bool  # False: the key was already recorded, nothing written
    removed: list[Entry]  # old keys taken out (only with an explicit replacement)


def record(path: str | None, hostname: str, port: int | None, key, *, name: str | None = None,
           replace: str | None = None) -> Recorded:
    """Record `key` for the host in a known_hosts file (the inventory's, else ~/.ssh/known_hosts).

    Already recorded: nothing is written (no duplicate line). A different key recorded for the same name
    (in either file we read): refused with ChangedKey, unless `replace` is exactly that old key's
    fingerprint; then the old lines (that name, that fingerprint) are removed and the new key recorded.
    """
    target = Path(os.path.expanduser(path)) if path else system_known_hosts()
    known_name = known_host_name(hostname, port)
    fp = fingerprint(key)
    files = list(dict.fromkeys([str(system_known_hosts()), str(target)]))
    recorded = [e for f in files for e in entries(f, known_name)]
    others = [e for e in recorded if e.fingerprint != fp]
    if others:
        olds = sorted({e.fingerprint for e in others})
        if replace is None or replace not in olds or len(olds) > 1:
            where = ", ".join(f"{e.path}:{e.lineno} ({e.key_type} {e.fingerprint})" for e in others)
            if replace is not None and replace not in olds:
                raise ChangedKey(f"{name or hostname}: --replace {replace} is not the recorded key for {known_name} "
                                 f"(recorded: {where}); nothing changed")
            raise ChangedKey(
                f"{name or hostname}: HOST KEY CHANGED for {known_name}: it offers {key.get_name()} {fp}, but "
                f"{where} records another key; refusing to record it (possible man-in-the-middle). "
                + _replace_hint(name or hostname, known_name, olds[0], fp, [e.path for e in others])
            )
        _remove(others)
    if any(e.fingerprint == fp for e in recorded if e.path == str(target)) or (
            not others and any(e.fingerprint == fp for e in recorded)):
        return Recorded(target, False, others)
    target.parent.mkdir(parents=True, exist_ok=True)
    line = f"{known_name} {key.get_name()} {key.get_base64()}\n"
    existing = target.read_text() if target.exists() else ""
    if existing and not existing.endswith("\n"):
        line = "\n" + line
    with open(target, "a") as f:
        f.write(line)
    os.chmod(target, 0o600)
    return Recorded(target, True, others)


def _remove(old: list[Entry]) -> None:
    """Take exactly these lines out of their files, atomically (temp name + rename), keeping the rest."""
    by_file: dict[str, set[int]] = {}
    for e in old:
        by_file.setdefault(e.path, set()).add(e.lineno)
    for path, numbers in by_file.items():
        p = Path(path)
        kept = [ln for n, ln in enumerate(p.read_text().splitlines(keepends=True), 1) if n not in numbers]
        tmp = p.with_name(f".{p.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(kept))
        os.chmod(tmp, p.stat().st_mode & 0o777)
        os.replace(tmp, p)
