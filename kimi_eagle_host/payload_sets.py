"""The payload sets on a host: <workdir>/.kimi-eagle/payloads/<digest>/kimi_eagle_host/, one folder per version of
this package, named by its content (kimi_eagle/hosts/session.py deploys them). A job's script names the folder of its
own set, so the job runs that code to its end whatever another controller deploys meanwhile.

`python -m kimi_eagle_host.payload_sets seal DIGEST`, run from the set just uploaded, writes the set's MANIFEST (the
mark that it is whole; a call checks it before running a module) or, where it is there, marks the set as used now.
Then it removes the sets nothing uses any more, so they do not pile up. A set goes only when
  - no deploy has used it for KEEP_DAYS (its MANIFEST's time; a folder without one: the folder's time), and
  - no job names it that may still run: a run folder whose scripts or settings name the set is left alone while it
    has no exit code (a job running, queued, or lost without one) or anything in it changed in the last KEEP_DAYS
    (a Slurm job's array task still running, or requeued after writing its exit code).
A command that started from a set just before it went (a `status` of a checkout not deployed for KEEP_DAYS) can fail
once; the next command deploys the set again. Folders of older layouts (payloads/kimi_eagle_host, payloads/*.py) are
never touched: jobs started by older versions may still run them.

Stdlib only, Python 3.8+, like every payload.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import time

from kimi_eagle_host.step_runtime import payload_root, host_runs_dir

MANIFEST = "MANIFEST"
KEEP_DAYS = 7
SET_NAME = re.compile(r"[0-9a-f]{16}")
# A removal under way: the set is renamed first, so a half-removed set never passes for a whole one.
REMOVING = re.compile(r"\.([0-9a-f]{16})\.removing\.\d+")
# The files of a run folder that name the set its job runs (job.sh, job.sbatch, node.sh; settings.json holds paths
# under {payloads}); never its logs.
NAMING = (".sh", ".sbatch", ".json")


def seal(root: str, digest: str) -> None:
    """Write `root`/MANIFEST (atomically: a reader sees the digest or nothing) or refresh its time."""
    path = os.path.join(root, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            if f.read().strip() == digest:
                os.utime(path)
                return
    except OSError:
        pass
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(digest)
    os.replace(tmp, path)


def _last_used(folder: str) -> float:
    try:
        return os.stat(os.path.join(folder, MANIFEST)).st_mtime
    except OSError:
        return os.stat(folder).st_mtime


def _may_run(run_dir: str, now: float) -> bool:
    """Whether the job of a run folder may still run (and import its set): see the module's docstring."""
    try:
        names = os.listdir(run_dir)
    except OSError:
        return False
    if not any(n.startswith("exit_code") for n in names):
        return True
    for n in names:
        try:
            if now - os.stat(os.path.join(run_dir, n)).st_mtime < KEEP_DAYS * 86400:
                return True
        except OSError:
            continue
    return False


def named_by_jobs(runs: str | None, sets: list[str], now: float) -> set[str]:
    """Those of `sets` that a job that may still run names."""
    named: set[str] = set()
    try:
        entries = os.listdir(runs) if runs else []
    except OSError:
        entries = []
    for entry in entries:
        run_dir = os.path.join(runs, entry)
        if not os.path.isdir(run_dir) or not _may_run(run_dir, now):
            continue
        try:
            files = [n for n in os.listdir(run_dir) if n.endswith(NAMING)]
        except OSError:  # removed meanwhile (`clean`)
            continue
        for n in files:
            try:
                with open(os.path.join(run_dir, n), encoding="utf-8", errors="replace") as f:
                    text = f.read(1 << 20)
            except OSError:
                continue
            named.update(s for s in sets if s in text)
    return named


def prune(payloads: str, keep: str, runs: str | None, now: float | None = None) -> list[str]:
    """Remove the sets in `payloads` that nothing uses (never `keep`, the set this runs from). Returns their names."""
    now = time.time() if now is None else now
    old = []
    for n in sorted(os.listdir(payloads)):
        folder = os.path.join(payloads, n)
        try:
            if REMOVING.fullmatch(n) and now - os.stat(folder).st_mtime > 3600:
                shutil.rmtree(folder, ignore_errors=True)  # a removal cut short (a reboot, a killed call)
            elif SET_NAME.fullmatch(n) and n != keep and os.path.isdir(folder):
                if now - _last_used(folder) > KEEP_DAYS * 86400:
                    old.append(n)
        except OSError:  # gone meanwhile: another prune
            continue
    if not old:
        return []
    used = named_by_jobs(runs, old, now)
    removed = []
    for n in old:
        if n in used:
            continue
        gone = os.path.join(payloads, f".{n}.removing.{os.getpid()}")
        try:
            os.rename(os.path.join(payloads, n), gone)
        except OSError:  # another prune took it first
            continue
        shutil.rmtree(gone, ignore_errors=True)
        removed.append(n)
    return removed


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kimi_eagle_host.payload_sets", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("seal", help="mark the set this runs from as whole and used now; remove sets nothing uses")
    s.add_argument("digest")
    a = ap.parse_args(argv)
    root = payload_root()
    if not SET_NAME.fullmatch(os.path.basename(root)) or not a.digest.startswith(os.path.basename(root)):
        ap.error(f"{root} is not the folder of payload set {a.digest}")  # run from a checkout, or a bug of ours
    seal(root, a.digest)
    removed = prune(os.path.dirname(root), os.path.basename(root), host_runs_dir())
    print(json.dumps({"sealed": a.digest, "removed": removed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
