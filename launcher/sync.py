"""Uploads over SFTP, never heredocs: temporary name in the target folder, sha256 verified on the
host, then an atomic rename. Files whose remote sha256 already matches are skipped.

An interrupted upload leaves at most a `.NAME.SHA.part` file beside the target, never a partial
file at the final path; a rerun writes the same temporary name again and completes.
"""

from __future__ import annotations

import hashlib
import os
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from .errors import CommandError
from .shell import join


@dataclass
class Item:
    remote: str  # path relative to the sync root on the host
    data: bytes | None = None  # in-memory content (rendered scripts) ...
    local: Path | None = None  # ... or a local file
    mode: int = 0o644
    sha256: str = ""

    def digest(self) -> str:
        if not self.sha256:
            h = hashlib.sha256()
            if self.data is not None:
                h.update(self.data)
            else:
                with open(self.local, "rb") as f:
                    while chunk := f.read(1 << 20):
                        h.update(chunk)
            self.sha256 = h.hexdigest()
        return self.sha256

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else self.local.stat().st_size


@dataclass
class SyncReport:
    host: str
    root: str
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    bytes_sent: int = 0

    def rows(self):
        return [(p, "changed") for p in self.changed] + [(p, "unchanged") for p in self.unchanged]


# Hashing on the host runs under the host's Python: hashlib (OpenSSL, SHA-NI) is ~4x coreutils' sha256sum.
# Arguments come in pairs (path, expected size or -1); a file whose size differs is not worth hashing.
_HASH_CODE = """
import hashlib, os, sys
a = sys.argv[1:]
for p, want in zip(a[::2], a[1::2]):
    try:
        if int(want) >= 0 and os.path.getsize(p) != int(want):
            continue
        h = hashlib.sha256()
        with open(p, "rb") as f:
            while True:
                b = f.read(1 << 20)
                if not b:
                    break
                h.update(b)
    except OSError:
        continue
    print(h.hexdigest() + "  " + p)
"""

# Receives a file on stdin, writes it and hashes it in the same pass; prints the digest.
RECEIVE_CODE = """
import hashlib, os, sys
path, mode = sys.argv[1], int(sys.argv[2], 8)
try:
    import fcntl
    fcntl.fcntl(0, 1031, 1 << 20)  # F_SETPIPE_SZ: 1 MiB reads instead of 64 KiB ones
except (ImportError, OSError):
    pass
h = hashlib.sha256()
fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
try:
    while True:
        b = os.read(0, 1 << 20)
        if not b:
            break
        h.update(b)
        view = memoryview(b)
        while view:
            view = view[os.write(fd, view):]
finally:
    os.close(fd)
os.chmod(path, mode)
print(h.hexdigest())
"""


def _python(transport) -> str:
    from .render import sh_path

    return sh_path(transport.host.python)


def _hash_remote(transport, sized: list[tuple[str, int]], prefix: str = "") -> dict[str, str]:
    if not sized:
        return {}
    args = [str(v) for pair in sized for v in pair]
    res = transport.run(f"{prefix}{_python(transport)} -c {join([_HASH_CODE])} {join(args)}", check=True, what="sha256 on the host")
    out = {}
    for line in res.stdout.splitlines():
        digest, _, name = line.partition("  ")
        if name:
            out[name] = digest
    return out


def _remote_hashes(transport, root: str, items: list[Item]) -> dict[str, str]:
    """One round trip: create the folders and hash what is already there with the size we would send."""
    dirs = sorted({posixpath.dirname(posixpath.join(root, i.remote)) for i in items} | {root})
    return _hash_remote(transport, [(i.remote, i.size) for i in items], prefix=f"mkdir -p -- {join(dirs)} && cd {join([root])} && ")


def _mismatch(transport, item, tmps):
    transport.run(f"rm -f -- {join(tmps)}")
    return CommandError(f"{transport.name}: sha256 mismatch after uploading {item.remote}; nothing was replaced")


def sync(transport, root: str, items: list[Item], progress=None) -> SyncReport:
    root = transport.abspath(root)
    report = SyncReport(transport.name, root)
    remote = _remote_hashes(transport, root, items)
    verify, done = [], []
    for item in items:
        # Hash locally only when the host has a file of the same size; otherwise hash while sending.
        if item.remote in remote and remote[item.remote] == item.digest():
            report.unchanged.append(item.remote)
            continue
        final = posixpath.join(root, item.remote)
        tmp = posixpath.join(posixpath.dirname(final), f".{posixpath.basename(final)}.part")
        if item.data is not None:
            transport.write_bytes(tmp, item.data, item.mode)
            verify.append((item, tmp, final))
        else:
            # Large files stream through the fastest path the transport has, hashed on both sides in the same pass.
            local, remote_digest = transport.upload_hashed(str(item.local), tmp, item.mode, progress=progress)
            item.sha256 = local
            if remote_digest is None:
                verify.append((item, tmp, final))
            elif remote_digest != local:
                raise _mismatch(transport, item, [tmp])
            else:
                done.append((item, tmp, final))
        report.bytes_sent += item.size
    if verify:
        got = _hash_remote(transport, [(t, -1) for _, t, _ in verify])
        for item, tmp, final in verify:
            if got.get(tmp) != item.digest():
                raise _mismatch(transport, item, [t for _, t, _ in verify])
    for item, tmp, final in done + verify:
        transport.rename(tmp, final)
        report.changed.append(item.remote)
    return report


def tree_items(local_root: Path, files: list[Path], prefix: str = "") -> list[Item]:
    items = []
    for f in files:
        rel = f.relative_to(local_root).as_posix()
        mode = 0o755 if os.access(f, os.X_OK) or f.suffix in (".sh", ".py") else 0o644
        items.append(Item(remote=posixpath.join(prefix, rel) if prefix else rel, local=f, mode=mode))
    return items
