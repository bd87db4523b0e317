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


def _remote_hashes(transport, root: str, paths: list[str]) -> dict[str, str]:
    """One round trip: create the folders and hash whatever is already there."""
    dirs = sorted({posixpath.dirname(posixpath.join(root, p)) for p in paths} | {root})
    cmd = f"mkdir -p -- {join(dirs)} && cd {join([root])} && sha256sum -- {join(paths)} 2>/dev/null; true"
    res = transport.run(cmd, check=True, what=f"prepare {root}")
    out = {}
    for line in res.stdout.splitlines():
        digest, _, name = line.partition("  ")
        if name:
            out[name] = digest
    return out


def sync(transport, root: str, items: list[Item], progress=None) -> SyncReport:
    root = transport.abspath(root)
    report = SyncReport(transport.name, root)
    remote = _remote_hashes(transport, root, [i.remote for i in items])
    pending = []
    for item in items:
        if remote.get(item.remote) == item.digest():
            report.unchanged.append(item.remote)
            continue
        final = posixpath.join(root, item.remote)
        tmp = posixpath.join(posixpath.dirname(final), f".{posixpath.basename(final)}.{item.digest()[:12]}.part")
        if item.data is not None:
            transport.write_bytes(tmp, item.data, item.mode)
        else:
            transport.upload_file(str(item.local), tmp, item.mode, progress=progress)
        pending.append((item, tmp, final))
        report.bytes_sent += item.size
    if pending:
        res = transport.run(f"sha256sum -- {join([t for _, t, _ in pending])}", check=True, what="verify upload")
        got = {}
        for line in res.stdout.splitlines():
            digest, _, name = line.partition("  ")
            got[name] = digest
        for item, tmp, final in pending:
            if got.get(tmp) != item.digest():
                transport.run(f"rm -f -- {join([t for _, t, _ in pending])}")
                raise CommandError(f"{transport.name}: sha256 mismatch after uploading {item.remote}; nothing was replaced")
        for item, tmp, final in pending:
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
