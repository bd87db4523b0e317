"""The payload sets on a host: <workdir>/.kimi-eagle/payloads/<digest>/kimi_eagle_host/, one folder per version of
this package, named by its content (kimi_eagle/hosts/session.py deploys them). A job's script names the folder of its
own set, so the job runs that code to its end whatever another controller deploys meanwhile.

`python -m kimi_eagle_host.payload_sets seal DIGEST`, run from the set just uploaded, writes the set's MANIFEST (the
mark that it is whole; a call checks it before running a module) or, where it is there, marks the set as used now.
Then it removes the sets nothing uses any more, so they do not pile up. A set goes only when
  - no deploy has used it for KEEP_DAYS (its MANIFEST's time; a folder without one: the folder's time), and
  - no job names it that may still run: a run folder whose scripts or settings name the set is left alone while it
    has no exit code (a job running or queued) or anything in it changed in the last KEEP_DAYS (a Slurm job's array
    task still running, or requeued after writing its exit code). A job that is `lost` (its shell died without
    writing its end, and nothing of it runs: ops/jobs.py) counts as ended: it holds its set only for KEEP_DAYS after
    its folder last changed, not forever; so does a folder recorded by a start that never started its job (no
    meta.json).
The payload wrappers beside the sets (.kimi-eagle/bin/NAME-<sha256:12>.sh, kimi_eagle/hosts/session.py: one per
payload, set and env, never per call) go with their set: a wrapper unchanged for KEEP_DAYS whose set is gone is
removed. One whose set is there is never touched, so a call of another terminal, which seals its set before it
uploads and runs its wrapper, always finds both.
A command that started from a set just before it went (a `status` of a checkout not deployed for KEEP_DAYS) can fail
once; the next command deploys the set again. Folders of older layouts (payloads/kimi_eagle_host, payloads/*.py) and
wrappers that name no set are never touched: jobs started by older versions may still run them.

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

from kimi_eagle_host.ops.jobs import job_state, read_meta, slurm_run
from kimi_eagle_host.step_runtime import payload_root, host_runs_dir

MANIFEST = "MANIFEST"
KEEP_DAYS = 7
SET_NAME = re.compile(r"[0-9a-f]{16}")
# A removal under way: the set is renamed first, so a half-removed set never passes for a whole one.
REMOVING = re.compile(r"\.([0-9a-f]{16})\.removing\.\d+")
# The files of a run folder that name the set its job runs (job.sh, job.sbatch, node.sh; settings.json holds paths
# under {payloads}); never its logs.
NAMING = (".sh", ".sbatch", ".json")
# A payload wrapper (kimi_eagle/hosts/session.py payload_wrapper), and the set it names in its PYTHONPATH line.
WRAPPER = re.compile(r"[A-Za-z0-9_.-]+-[0-9a-f]{12}\.sh")
NAMED_SET = re.compile(r"\.kimi-eagle/payloads/([0-9a-f]{16})\b")


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
    if not any(n.startswith("exit_code") for n in names) and "meta.json" in names and not _lost(run_dir):
        return True
    # Ended, lost, or never started (recorded by a start that lost its host's answer: no meta.json; a start in
    # progress has fresh files): it may run only while something in it changed in the last KEEP_DAYS.
    for n in names:
        try:
            if now - os.stat(os.path.join(run_dir, n)).st_mtime < KEEP_DAYS * 86400:
                return True
        except OSError:
            continue
    return False


def _lost(run_dir: str) -> bool:
    """A job started here (its meta.json written) that died without writing its end: nothing of it can run again.
    A folder recorded but not started yet, or a Slurm job (queued or requeued where this host cannot see), is not."""
    meta = read_meta(run_dir)
    if not meta or slurm_run(run_dir, meta):
        return False
    return job_state(run_dir)["state"] == "lost"


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


def prune_wrappers(payloads: str, now: float | None = None) -> list[str]:
    """Remove the wrappers in <state>/bin whose set is gone from `payloads` and that no call wrote for KEEP_DAYS (a
    call writes its wrapper after it sealed its set, so its set is there). Returns their names."""
    now = time.time() if now is None else now
    bin_dir = os.path.join(os.path.dirname(payloads), "bin")
    try:
        names = sorted(os.listdir(bin_dir))
    except OSError:
        return []
    removed = []
    for n in names:
        path = os.path.join(bin_dir, n)
        try:
            if not WRAPPER.fullmatch(n) or now - os.stat(path).st_mtime <= KEEP_DAYS * 86400:
                continue
            with open(path, encoding="utf-8", errors="replace") as f:
                named = set(NAMED_SET.findall(f.read(1 << 16)))
            if not named or any(os.path.isdir(os.path.join(payloads, s)) for s in named):
                continue
            os.unlink(path)
        except OSError:  # gone meanwhile: another prune
            continue
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
    wrappers = prune_wrappers(os.path.dirname(root))
    print(json.dumps({"sealed": a.digest, "removed": removed, "removed_wrappers": wrappers}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
