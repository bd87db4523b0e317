"""Uploads over SFTP, never heredocs: a temporary name in the target folder, sha256 verified on the
host, then an atomic rename. Files whose remote sha256 already matches are skipped.

Every temporary name is unique to its call (`.NAME.TOKEN.part`, TOKEN random), so two uploads of one name
at once never write the same file; the winner of the final rename holds its own bytes whole. A lease process
on the host creates the temporary files exclusively and holds a lock on each while the call runs; when the
controller goes away (killed, connection lost) it removes them, and the next upload of a name removes any
`.part` of that name that no lease holds. A full disk or a read-only folder is said in one line.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import posixpath
import secrets
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import CommandError, ConfigError, KimiEagleError
from ..shell import join
from .local_dest import writing


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
_SHA_FN = """
import hashlib, os, sys
def sha(p, size=None):
    h, left = hashlib.sha256(), size
    with open(p, "rb") as f:
        while left is None or left > 0:
            b = f.read(1 << 20 if left is None else min(1 << 20, left))
            if not b:
                break
            h.update(b)
            if left is not None:
                left -= len(b)
    return h.hexdigest()
"""

# Arguments come in pairs (path, expected size or -1); a file whose size differs is not worth hashing. "+N" (a
# download): the first N bytes, also of a file that has grown since it was listed with N bytes (a running job's log).
_HASH_CODE = _SHA_FN + """
a = sys.argv[1:]
for p, want in zip(a[::2], a[1::2]):
    try:
        prefix, n, size = want.startswith("+"), int(want), os.path.getsize(p)
        if n >= 0 and size != n and not (prefix and size > n):
            continue
        print(sha(p, n if prefix else None) + "  " + p)
    except OSError:
        continue
"""

# Arguments come in pairs (path, size): the paths whose file is larger now.
_GROWN_CODE = """
import json, os, sys
a = sys.argv[1:]
grown = []
for p, n in zip(a[::2], a[1::2]):
    try:
        if os.path.getsize(p) > int(n):
            grown.append(p)
    except OSError:
        pass
print(json.dumps(grown))
"""

# Verify what is about to be renamed (the temporary file itself, not the stream that filled it), then rename.
# Arguments come in triples (temporary, final, expected sha256 or "-" when the receiver hashed its own file).
# A folder where a file goes would fail its rename after the files before it were replaced: every destination is
# checked before the first rename, and then none is renamed.
_COMMIT_CODE = _SHA_FN + """
import json
a = sys.argv[1:]
todo = list(zip(a[0::3], a[1::3], a[2::3]))
bad = [final for tmp, final, want in todo if want != "-" and sha(tmp) != want]
in_the_way = [final for tmp, final, want in todo if os.path.isdir(final) and not os.path.islink(final)]
if not bad and not in_the_way:
    for tmp, final, want in todo:
        os.replace(tmp, final)
print(json.dumps({"mismatch": bad, "in_the_way": in_the_way}))
"""

# The lease: sweeps `.part` files of these names that no lease holds any more (and that stopped changing), then
# creates this call's temporary files exclusively and locks each. It says "ready" and then writes a heartbeat:
# when the controller is gone the write fails (or a signal comes) and it removes the files it still holds.
LEASE_CODE = """
import errno, fcntl, json, os, re, signal, sys, time
parts = sys.argv[1:]
held = []
def leave(*_):
    raise SystemExit(0)
for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
    signal.signal(s, leave)
def sweep(part):
    d, b = os.path.split(part)
    stem = re.escape(b[: -len(".part")].rsplit(".", 1)[0])
    pattern = re.compile(stem + r"(\\.[0-9a-f]{12})?\\.part")
    try:
        names = os.listdir(d)
    except OSError:
        return
    for n in names:
        if not pattern.fullmatch(n):
            continue
        try:
            fd = os.open(os.path.join(d, n), os.O_RDONLY)
        except OSError:
            continue
        try:
            if time.time() - os.fstat(fd).st_mtime > 2:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(os.path.join(d, n))
        except OSError:
            pass
        finally:
            os.close(fd)
try:
    try:
        for p in parts:
            sweep(p)
        for p in parts:
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            held.append((p, fd))
            fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
        print(json.dumps({"errno": e.errno, "path": e.filename, "error": e.strerror}), flush=True)
        raise SystemExit(1)
    print("ready", flush=True)
    while True:
        time.sleep(0.2)
        sys.stdout.write(".")
        sys.stdout.flush()
except (OSError, SystemExit, KeyboardInterrupt):
    pass
finally:
    for p, fd in held:
        try:
            os.unlink(p)  # gone already when it was renamed into place
        except OSError:
            pass
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # no complaint about a closed stdout on the way out
    except OSError:
        pass
"""

# Receives a file on stdin into a temporary file its lease created, hashing in the same pass; prints the digest.
# The file is this call's alone (created exclusively by the lease), so the digest is that of the bytes renamed.
RECEIVE_CODE = """
import hashlib, os, sys
path, mode = sys.argv[1], int(sys.argv[2], 8)
try:
    import fcntl
    fcntl.fcntl(0, 1031, 1 << 20)  # F_SETPIPE_SZ: 1 MiB reads instead of 64 KiB ones
except (ImportError, OSError):
    pass
h = hashlib.sha256()
try:
    fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
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
except OSError as e:
    sys.stderr.write("errno %d %s\\n" % (e.errno, e.strerror))
    sys.exit(3)
print(h.hexdigest())
"""

# Why a write failed, asked of the host: read-only, or how much room is left (bytes free to unprivileged users).
_SPACE_CODE = """
import os, sys
st = os.statvfs(sys.argv[1])
print(int(bool(st.f_flag & os.ST_RDONLY)), st.f_bavail * st.f_frsize)
"""


def _python(transport) -> str:
    from ..templating import sh_path

    return sh_path(transport.host.python)


def _hash_remote(transport, sized: list[tuple[str, int | str]], prefix: str = "") -> dict[str, str]:
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


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _why_not_written(transport, folder: str, need: int, errno_: int | None = None) -> str | None:
    """A one-line reason a write into `folder` failed, when it is space or a read-only file system."""
    import errno as E

    try:
        res = transport.run(f"{_python(transport)} -c {join([_SPACE_CODE, folder])}", timeout=30)
        ro, free = (int(x) for x in res.stdout.split())
    except Exception:  # the diagnosis is best effort; the caller still has its own error
        ro, free = errno_ == E.EROFS, None
    if ro or errno_ == E.EROFS:
        return f"{transport.name}:{folder} is read-only; nothing was replaced"
    if errno_ in (E.ENOSPC, E.EDQUOT) or (free is not None and free < need):
        room = "" if free is None else f" ({_human(free)} free, {_human(need)} needed)"
        return f"no space left on {transport.name}:{folder}{room}; nothing was replaced"
    return None


class _Lease:
    """The host-side holder of one call's temporary files (see LEASE_CODE)."""

    def __init__(self, transport, parts: list[str]):
        self.transport, self.parts = transport, parts
        self.stream = transport.stream(f"exec {_python(transport)} -u -c {join([LEASE_CODE, *parts])}")
        buf = b""
        for chunk in self.stream.chunks:
            buf += chunk
            if b"\n" in buf:
                break
        first = buf.split(b"\n", 1)[0].decode(errors="replace")
        if first != "ready":
            self.stream.close()
            try:
                failed = json.loads(first)
            except ValueError:
                raise CommandError(f"{transport.name}: cannot create temporary files for the upload: {first or 'no answer'}") from None
            folder = posixpath.dirname(failed.get("path") or parts[0])
            raise CommandError(_why_not_written(transport, folder, 0, failed.get("errno"))
                               or f"{transport.name}: cannot write {failed.get('path')}: {failed.get('error')}")

    def release(self, *, remove: bool = False) -> None:
        if remove:  # at once, not a heartbeat later: the caller reports a failure and must leave nothing
            self.transport.run(f"rm -f -- {join(self.parts)}", timeout=30)
        self.stream.close()


def _mismatch(transport, names):
    return CommandError(f"{transport.name}: sha256 mismatch after uploading {', '.join(names)}; nothing was replaced")


def sync(transport, root: str, items: list[Item], progress=None) -> SyncReport:
    root = transport.abspath(root)
    report = SyncReport(transport.name, root)
    remote = _remote_hashes(transport, root, items)
    # Hash locally only when the host has a file of the same size; otherwise hash while sending.
    send = [i for i in items if not (i.remote in remote and remote[i.remote] == i.digest())]
    report.unchanged = [i.remote for i in items if i not in send]
    if not send:
        return report
    token = secrets.token_hex(6)
    plan = []
    for item in send:
        final = posixpath.join(root, item.remote)
        plan.append((item, posixpath.join(posixpath.dirname(final), f".{posixpath.basename(final)}.{token}.part"), final))
    lease = _Lease(transport, [tmp for _, tmp, _ in plan])
    committed = False
    try:
        commit = []
        for item, tmp, final in plan:
            try:
                commit.append((tmp, final, _send(transport, item, tmp, progress)))
            except (OSError, KimiEagleError) as e:
                folder = posixpath.dirname(final)
                reason = _why_not_written(transport, folder, item.size, getattr(e, "errno", None) or _errno_in(str(e)))
                if reason:
                    raise CommandError(reason) from None
                raise
            report.bytes_sent += item.size
        args = [v for triple in commit for v in triple]
        res = transport.run(f"{_python(transport)} -c {join([_COMMIT_CODE])} {join(args)}", check=True,
                            what="verify and rename on the host")
        answer = json.loads(res.stdout.strip().splitlines()[-1])
        bad = answer["mismatch"]
        if answer["in_the_way"]:
            raise ConfigError(f"{transport.name}:{answer['in_the_way'][0]} is a folder where the upload puts a file; "
                              f"nothing was replaced")
        if bad:
            # SFTP's pipelined writes can lose a write error (ENOSPC) silently: the bytes are just not there.
            need = sum(i.size for i, _, final in plan if final in bad)
            raise CommandError(_why_not_written(transport, posixpath.dirname(bad[0]), need)
                               or str(_mismatch(transport, [posixpath.relpath(b, root) for b in bad])))
        committed = True
    finally:
        lease.release(remove=not committed)
    report.changed = [item.remote for item, _, _ in plan]
    return report


def _send(transport, item: Item, tmp: str, progress) -> str:
    """Write one item to its temporary file; returns the digest the host must verify, or "-" when the host
    already hashed the bytes it wrote (the OpenSSH path) and they matched ours."""
    if item.data is not None:
        transport.write_bytes(tmp, item.data, item.mode)
        return item.digest()
    # Large files stream through the fastest path the transport has, hashed on both sides in the same pass.
    local, remote_digest = transport.upload_hashed(str(item.local), tmp, item.mode, progress=progress)
    item.sha256 = local
    if remote_digest is None:
        return local
    if remote_digest != local:
        raise _mismatch(transport, [item.remote])
    return "-"


def _errno_in(message: str) -> int | None:
    """The errno a host-side receiver reported (`errno 28 …`), if any."""
    import re

    m = re.search(r"errno (\d+)", message)
    return int(m.group(1)) if m else None


def tree_items(local_root: Path, files: list[Path], prefix: str = "") -> list[Item]:
    items = []
    for f in files:
        rel = f.relative_to(local_root).as_posix()
        mode = 0o755 if os.access(f, os.X_OK) or f.suffix in (".sh", ".py") else 0o644
        items.append(Item(remote=posixpath.join(prefix, rel) if prefix else rel, local=f, mode=mode))
    return items


# -- the other way: host -> here ----------------------------------------------------------------------------
@dataclass
class FetchReport:
    host: str
    root: str  # the local folder
    changed: list[str] = field(default_factory=list)
    unchanged: list[str] = field(default_factory=list)
    bytes_received: int = 0
    skipped: list = field(default_factory=list)  # (folder, the job that wrote it or None): not this job's output
    growing: list[str] = field(default_factory=list)  # still being written on the host: copied as they were listed
    changing: list[str] = field(default_factory=list)  # rewritten on the host during every try: left as they were here

    def rows(self):
        return [(p, "changed") for p in self.changed] + [(p, "unchanged") for p in self.unchanged]


def _local_digest(path: Path) -> str:
    return Item(remote="", local=path).digest()


def _write_all(f, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[f.write(view):]


def _check_local_name(transport, rel: str) -> None:
    """A path under the destination, as the host named it: one that is absolute or climbs out ('..') would write
    where the host chose (~/.ssh/authorized_keys), so it is refused, naming the host."""
    if not isinstance(rel, str) or not rel or "\0" in rel or posixpath.isabs(rel) or ".." in rel.split("/"):
        raise CommandError(f"{transport.name}: the host named a file outside the destination ({rel!r}); nothing "
                           f"was copied")


# Arguments: paths. For each, its sha256 with the size and mtime it had before and after the hashing, when the two
# agree (else null: it changed while being read): {path: [sha256, size, mtime_ns] or null}. Without paths: a stat
# only, {path: [null, size, mtime_ns]} (the check after a copy).
_WHOLE_CODE = _SHA_FN + """
import json
def st(p):
    s = os.stat(p)
    return [s.st_size, s.st_mtime_ns]
hashing, a = sys.argv[1] == "hash", sys.argv[2:]
out = {}
for p in a:
    try:
        before = st(p)
        digest = sha(p) if hashing else None
        out[p] = [digest, *before] if st(p) == before else None
    except OSError:
        out[p] = None
print(json.dumps(out))
"""
# How often a file rewritten in place is copied again when it changed during the copy, before it is said `changing`.
WHOLE_TRIES = 3


def fetch(transport, files: list[tuple[str, str, int]], local_root: Path, appended=None) -> FetchReport:
    """Copy host files here: (absolute path on the host, path under `local_root`, size). Hashed on the host in
    one round trip; a local file of the same size and sha256 is skipped; each other file is written to a
    temporary name unique to this call, hashed while it arrives, checked against the host's digest and renamed
    into place, so a local path holds the old file or the whole new one.

    `appended(rel)` names the files only ever appended to (a running job's log and event files): each is copied as
    it was listed, its first `size` bytes, a snapshot checked against their digest, and named in `growing`; any
    other change (shrank, vanished, its listed bytes rewritten) fails the check. Every other file may be rewritten
    in place (a tracker's summary), where a prefix would be a cut copy of another content: it is copied whole, and
    renamed into place only if its size and mtime on the host were the same before its hashing and after its copy;
    one that changed is copied again, up to WHOLE_TRIES times, then named in `changing` and left as it was here."""
    local_root = Path(local_root)
    appended = appended or (lambda rel: False)
    report = FetchReport(transport.name, str(local_root))
    for _, rel, _ in files:   # every name before anything is written
        _check_local_name(transport, rel)
    grows = [f for f in files if appended(f[1])]
    token = secrets.token_hex(6)
    remote = _hash_remote(transport, [(path, f"+{int(size)}") for path, _, size in grows])
    for path, rel, size in grows:
        want = remote.get(path)
        if want is None:
            raise CommandError(f"{transport.name}: {path} changed or vanished while being read; run the command again")
        tmp = _receive(transport, path, rel, size, want, local_root, token, report)
        if tmp is not None:
            _into_place(tmp, local_root / rel, local_root)
            report.changed.append(rel)
            report.bytes_received += size
    _fetch_whole(transport, [(path, rel) for path, rel, _ in files if not appended(rel)], local_root, token, report)
    if grows:
        res = transport.run(f"{_python(transport)} -c {join([_GROWN_CODE, *[str(v) for f in grows for v in (f[0], f[2])]])}",
                            check=True, what="file sizes on the host")
        grown = set(json.loads(res.stdout.strip().splitlines()[-1]))
        report.growing = [rel for path, rel, _ in grows if path in grown]
    return report


def _whole(transport, how: str, paths: list[str]) -> dict:
    res = transport.run(f"{_python(transport)} -c {join([_WHOLE_CODE, how, *paths])}", check=True,
                        what="sha256 on the host")
    return json.loads(res.stdout.strip().splitlines()[-1])


def _fetch_whole(transport, files: list[tuple[str, str]], local_root: Path, token: str, report: FetchReport) -> None:
    """The files that may be rewritten in place (fetch): each copied whole and renamed into place only when it did not
    change from before its hashing to after its copy (checked file by file: one file at a time waits here, so a
    pull needs no more room than before)."""
    todo = files
    for _ in range(WHOLE_TRIES):
        if not todo:
            return
        hashed = _whole(transport, "hash", [path for path, _ in todo])
        same, again = [], []
        for path, rel in todo:
            found = hashed.get(path)
            if found is None:
                again.append((path, rel))  # changed while being hashed, or (for now) gone
                continue
            want, size, mtime = found
            tmp = _receive(transport, path, rel, size, want, local_root, token, report, strict=False)
            if tmp is None:
                same.append((path, rel, size, mtime))
            elif tmp is False:
                again.append((path, rel))  # changed while being copied
            else:
                try:
                    if _unchanged(transport, [(path, size, mtime)]):
                        _into_place(tmp, local_root / rel, local_root)
                        report.changed.append(rel)
                        report.bytes_received += size
                    else:
                        again.append((path, rel))
                finally:
                    tmp.unlink(missing_ok=True)
        kept = _unchanged(transport, [(path, size, mtime) for path, _, size, mtime in same])
        report.unchanged += [rel for path, rel, _, _ in same if path in kept]
        again += [(path, rel) for path, rel, _, _ in same if path not in kept]
        todo = again
    report.changing = [rel for _, rel in todo]


def _unchanged(transport, files: list[tuple[str, int, int]]) -> set[str]:
    """Those of the host files (path, size, mtime_ns when hashed) whose size and mtime are still those."""
    now = _whole(transport, "stat", [path for path, _, _ in files]) if files else {}
    return {path for path, size, mtime in files if now.get(path) and now[path][1:] == [size, mtime]}


def _receive(transport, path: str, rel: str, size: int, want: str, local_root: Path, token: str, report: FetchReport,
             strict: bool = True):
    """The first `size` bytes of host file `path` in a temporary file next to `rel` here, checked against `want`:
    the temporary file, None when the local file already holds them, or (strict=False) False when they did not
    match (strict: a CommandError)."""
    dest = local_root / rel
    with writing(local_root):
        if dest.is_file() and dest.stat().st_size == size and _local_digest(dest) == want:
            if strict:
                report.unchanged.append(rel)
            return None
        dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.parent / f".{dest.name}.{token}.part"
    h = hashlib.sha256()
    stream = transport.stream(f"exec head -c {int(size)} -- {join([path])}")  # what was listed and hashed
    done = False
    try:
        # Only the local file calls are guarded: a connection lost while reading chunks stays exit 5.
        with writing(local_root):
            f = open(tmp, "wb", buffering=0)  # unbuffered: a full disk fails in a guarded write, not at close
        with f:
            for chunk in stream.chunks:
                h.update(chunk)
                with writing(local_root):
                    _write_all(f, chunk)
        if h.hexdigest() != want:
            if not strict:
                return False
            raise CommandError(f"{transport.name}: sha256 mismatch copying {path} (it changed while being copied?); "
                               f"nothing was replaced, run the command again")
        done = True
        return tmp
    finally:
        try:
            stream.close()  # may raise itself on a connection that just dropped: the temporary file goes anyway
        finally:
            if not done:
                tmp.unlink(missing_ok=True)


def _into_place(tmp: Path, dest: Path, local_root: Path) -> None:
    try:
        with writing(local_root):
            if dest.is_dir():  # os.replace would name only the temporary file
                raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(dest))
            os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)
