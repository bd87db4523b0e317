"""Host-key verification. Keys come from ~/.ssh/known_hosts plus the inventory's known_hosts file.

An unknown key is refused with its type, its SHA256 fingerprint and the command that trusts it;
a changed key is always refused, and replaced only on an explicit request naming the old fingerprint.
Nothing is ever added without the user saying so, and a key already recorded is never written twice.
"""

from __future__ import annotations

import base64
import hashlib
import logging
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
    """Load every trusted key into a paramiko SSHClient and refuse unknown and revoked keys.

    The files are read here, line by line, not by paramiko's HostKeys.load: that raises on an `@cert-authority` or
    `@revoked` line and on any damaged line, and one such line about another machine made every host unreachable.
    OpenSSH reads the same files, so they are read as it reads them: certificate authorities are not ours to use
    (paramiko has no host certificates) and are skipped, a damaged line is skipped (with one warning per file), and
    a key marked `@revoked` is never accepted, for any host."""
    import paramiko

    trusted, revoked = read_known_hosts(trusted_files(extra))
    keys = client.get_host_keys()  # never saved to: SSHClient saves only a file given to load_host_keys
    for names, key in trusted:
        if fingerprint(key) in revoked:
            continue
        # As HostKeys.load adds a line: appended after what is already there, so the first file's key is the one
        # paramiko compares first (HostKeys.add would replace an earlier key of the same type instead).
        keys._entries.append(paramiko.hostkeys.HostKeyEntry(names, key))

    class RefuseUnknown(paramiko.MissingHostKeyPolicy):
        def missing_host_key(self, client, hostname, key):
            if fingerprint(key) in revoked:
                raise RevokedHostKey(hostname, key, revoked[fingerprint(key)])
            raise UnknownHostKey(hostname, key)

    client.set_missing_host_key_policy(RefuseUnknown())


_warned: set[str] = set()  # the files already warned about in this process (every connection reads them again)


def read_known_hosts(paths: list[str]) -> tuple[list[tuple[list[str], object]], dict[str, str]]:
    """The keys known_hosts files trust, in file order, as ([names], paramiko key), and the fingerprints of the keys
    marked `@revoked` ({fingerprint: "file:line"}). A missing file holds nothing."""
    from paramiko.hostkeys import HostKeyEntry

    trusted, revoked = [], {}
    for path in paths:
        try:
            lines = Path(path).read_text(errors="replace").splitlines()
        except (FileNotFoundError, NotADirectoryError):
            continue
        except OSError as e:  # unreadable (permissions): OpenSSH says so and reads the other files
            _warn_once(path, f"warning: {path}: cannot read it ({e.strerror}); its keys are not trusted")
            continue
        bad = []
        for n, raw in enumerate(lines, 1):
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            marker = None
            if line.startswith("@"):
                marker, _, line = line.partition(" ")
                line = line.strip()
                if marker == "@cert-authority":
                    continue
                if marker != "@revoked":
                    bad.append(n)
                    continue
            try:
                entry = HostKeyEntry.from_line(" ".join(line.split()), n)
            except Exception:  # a key that does not decode (paramiko's InvalidHostKey, not an SSHException)
                bad.append(n)
                continue
            if entry is None:  # too few fields; or a key type paramiko does not know, which no host can offer it
                if len(line.split()) < 3:
                    bad.append(n)
                continue
            if not all(map(_hashed_name_ok, entry.hostnames)):  # paramiko would fail on it at every lookup
                bad.append(n)
                continue
            if marker == "@revoked":
                revoked[fingerprint(entry.key)] = f"{path}:{n}"
            else:
                trusted.append((entry.hostnames, entry.key))
        if bad:
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            _warn_once(path, f"warning: {path}:{bad[0]}: a line that is not a host key{more}; skipped, as OpenSSH "
                             f"skips it")
    return trusted, revoked


def _warn_once(path: str, text: str) -> None:
    """One line on stderr (logging's last resort, unless the caller configured logging), once per file."""
    if path not in _warned:
        _warned.add(path)
        logging.getLogger(__name__).warning(text)


class UnknownHostKey(HostKeyError):
    """`through`: the known_hosts name of the inventory's host where it is reached through ProxyJump (or a
    ProxyCommand); the key may then be its own or a jump host's (`hostname` says which)."""

    def __init__(self, hostname: str, key, host_name: str | None = None, *, through: str | None = None,
                 known_hosts: str | None = None):
        self.hostname, self.key = hostname, key
        super().__init__(self._message(host_name or hostname, through, known_hosts))

    def _message(self, name, through, known_hosts):
        said = f"{name}: unknown host key ({self.key.get_name()} {fingerprint(self.key)}) for {self.hostname}"
        if through is None:
            return f"{said}; if you trust it, run: kimi-eagle hosts trust {name}"
        from ..shell import join, quote

        # `hosts trust` connects straight to the host, which a host behind a jump host does not allow: the line to
        # record instead, for the host the key belongs to (the jump host's key is never the target's).
        whose = f"{name} itself, reached through ProxyJump" if self.hostname == through else f"a jump host on the way to {name}"
        line = f"{self.hostname} {self.key.get_name()} {self.key.get_base64()}"
        target = os.path.expanduser(known_hosts) if known_hosts else str(system_known_hosts())
        return (f"{said} ({whose}); if you trust it (compare the fingerprint with `ssh-keygen -lf` of that host's "
                f"key, or its admin's), record it: {join(['echo', line])} >> {quote(target)}")

    def for_host(self, name: str, *, through: str | None = None, known_hosts: str | None = None) -> "UnknownHostKey":
        return UnknownHostKey(self.hostname, self.key, name, through=through, known_hosts=known_hosts)


class RevokedHostKey(HostKeyError):
    """The host offered a key a known_hosts file marks `@revoked`: never accepted, whatever else trusts it."""

    def __init__(self, hostname: str, key, where: str, host_name: str | None = None):
        self.hostname, self.key, self.where = hostname, key, where
        super().__init__(f"{host_name or hostname}: the host key {key.get_name()} {fingerprint(key)} that {hostname} "
                         f"offers is marked @revoked ({where}); refusing to connect")

    def for_host(self, name: str, **_) -> "RevokedHostKey":
        return RevokedHostKey(self.hostname, self.key, self.where, name)


def changed_key_error(name: str, hostname: str, got, expected, files: list[str] | None = None) -> HostKeyError:
    """`hostname` is the known_hosts name (`[host]:port` off port 22); `files` the known_hosts files we read."""
    return HostKeyError(
        f"{name}: HOST KEY CHANGED for {hostname}: offered {got.get_name()} {fingerprint(got)}, "
        f"known {expected.get_name()} {fingerprint(expected)}; refusing to connect (possible man-in-the-middle). "
        + _replace_hint(name, hostname, fingerprint(expected), fingerprint(got), files)
    )


def _replace_hint(name: str, hostname: str, old_fp: str, new_fp: str, files: list[str] | None) -> str:
    from ..shell import join

    files = list(dict.fromkeys(files or []))
    holding = [f for f in files if any(e.fingerprint == old_fp for e in entries(f, hostname))]
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


def same_key_type(a: str, b: str) -> bool:
    """Whether two key type names are one kind of key: an RSA key is `ssh-rsa` in known_hosts whatever signature
    (rsa-sha2-256/512) it is used with."""
    def kind(t: str) -> str:
        return "ssh-rsa" if t.startswith("rsa-sha2-") else t
    return kind(a) == kind(b)


def _hashed_name_ok(name: str) -> bool:
    """A plain name, or a hashed one (`|1|salt|hash`) whose salt paramiko can use (20 bytes, base64)."""
    if not name.startswith("|1|"):
        return True
    parts = name.split("|")
    try:
        return len(parts) == 4 and len(base64.b64decode(parts[2], validate=True)) == 20 and bool(
            base64.b64decode(parts[3], validate=True))
    except ValueError:  # binascii.Error
        return False


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

    Already recorded in that file: nothing is written (no duplicate line); a key only ~/.ssh/known_hosts holds is
    still written to the inventory's file, which teammates share. A different key of the same type recorded for the
    same name (in either file we read): refused with ChangedKey, unless `replace` is exactly that old key's
    fingerprint; then the old lines (that name, that fingerprint) are removed and the new key recorded. Keys of
    other types are the host's other keys (OpenSSH records them all), never a change.
    """
    target = Path(os.path.expanduser(path)) if path else system_known_hosts()
    known_name = known_host_name(hostname, port)
    fp = fingerprint(key)
    files = list(dict.fromkeys([str(system_known_hosts()), str(target)]))
    recorded = [e for f in files for e in entries(f, known_name)]
    revoked = read_known_hosts(files)[1].get(fp)
    if revoked:
        raise RevokedHostKey(known_name, key, revoked, name)
    others = [e for e in recorded if same_key_type(e.key_type, key.get_name()) and e.fingerprint != fp]
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
    if any(e.fingerprint == fp and e.path == str(target) for e in recorded):
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
