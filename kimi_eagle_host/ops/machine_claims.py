"""The machine's claims: which live job uses which folder and the GPUs. Stdlib only.

A claim belongs to the machine, not to a workdir or an inventory entry: two entries (or two workdirs, or two
controllers) that reach one machine as one user see the same claims. The registry is one folder per user and
machine: <base>/<boot id>/, where <base> is $KIMI_EAGLE_MACHINE_DIR or else ~/.cache/kimi-eagle/machine. A home
folder shared by several machines (NFS) holds one such folder per machine, and a machine never counts, nor
removes, another's claims; containers on one kernel share its boot id and its GPUs, so they share the claims
too. The claims of an earlier boot are dead by construction (no process outlives a reboot), and nothing reads
their folder again.

  .lock                 flock'd by whoever reads the claims and then acts on them (a job's start, clean)
  claims/<key>.json     one per job started on this machine: job_id, run_dir, workdir, output_dir, gpu, step,
                        started_at, boot_id, pgid (key: a digest of the job's run dir)

A claim counts only while its job's processes live (the caller says how to tell, from the processes); a claim
whose job is gone is ignored, and removed by the next caller that holds the lock. No marker decides.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import tempfile

from kimi_eagle_host import procfs


def _base() -> str:
    return os.environ.get("KIMI_EAGLE_MACHINE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "kimi-eagle",
                                                                     "machine")


def machine_dir() -> str:
    return os.path.join(_base(), procfs.boot_id() or "no-boot-id")


def _claims_dir() -> str:
    return os.path.join(machine_dir(), "claims")


def _legacy_claims_dir() -> str:
    """Where versions before the per-machine folders kept the claims, of every machine sharing the home: a job
    they started during this boot still counts (its boot id says it is this machine's)."""
    return os.path.join(_base(), "claims")


@contextlib.contextmanager
def locked():
    """The machine's lock, held for the block (not re-entrant: take it once per process)."""
    os.makedirs(_claims_dir(), exist_ok=True)
    with open(os.path.join(machine_dir(), ".lock"), "a+") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        yield


def _path(run_dir: str) -> str:
    key = hashlib.sha256(os.path.realpath(run_dir).encode()).hexdigest()[:32]
    return os.path.join(_claims_dir(), key + ".json")


def register(claim: dict) -> None:
    """Record (or update) a job's claim; call under locked(). Written aside, then renamed: never read half-written."""
    os.makedirs(_claims_dir(), exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=_claims_dir(), prefix=".claim-")
    with os.fdopen(fd, "w") as f:
        json.dump(claim, f)
    os.replace(tmp, _path(claim["run_dir"]))


def _read_all() -> list[tuple[str, dict]]:
    found = []
    for folder in (_claims_dir(), _legacy_claims_dir()):
        try:
            names = sorted(os.listdir(folder))
        except OSError:
            continue
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            path = os.path.join(folder, name)
            try:
                with open(path, "rb") as f:
                    claim = json.loads(f.read().decode())
            except (OSError, ValueError):
                continue  # unreadable: not a claim anyone can honour; left for a person to look at
            if not isinstance(claim, dict) or not claim.get("run_dir"):
                continue
            if folder == _legacy_claims_dir() and claim.get("boot_id") != procfs.boot_id():
                continue  # another machine's (or an earlier boot's): neither counted nor removed here
            found.append((path, claim))
    return found


def live(is_alive, prune: bool = False, where=None) -> list[dict]:
    """The claims (those `where(claim)` accepts) whose job still has processes (is_alive(claim)); with prune
    (under locked()), the others go."""
    out = []
    for path, claim in _read_all():
        if where is not None and not where(claim):
            continue
        if is_alive(claim):
            out.append(claim)
        elif prune:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    return out


def overlaps(a: str | None, b: str | None) -> bool:
    """Whether two folders are one, or one holds the other (removing either touches the other's files)."""
    if not a or not b:
        return False
    ra, rb = os.path.realpath(a).rstrip("/") or "/", os.path.realpath(b).rstrip("/") or "/"
    return ra == rb or ra.startswith(rb.rstrip("/") + "/") or rb.startswith(ra.rstrip("/") + "/")
