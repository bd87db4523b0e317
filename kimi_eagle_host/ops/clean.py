#!/usr/bin/env python3
"""Remove a run's bulky folders (`kimi-eagle clean`), never while a job that uses them runs. Stdlib only.

The check and the removal happen under flock(<runs>/.lock) and the machine's lock (ops/machine_claims.py), the
locks ops/jobs.py holds while it starts a job, and every pipeline job's output folder is recorded
(<runs>/<job>/output_dir, then in its machine claim) before its start: a job of any workdir on this machine
either started before the check (it is seen, and nothing is removed) or starts after the removal. Two cleans at once take turns;
the second finds what is left. A folder is renamed aside first (no reader sees half of it), then deleted.

  python -m kimi_eagle_host.ops.clean --runs-dir R --root OUT [--ended JOB,JOB] REL ...

--ended names jobs the controller knows have ended (a Slurm job cancelled before it wrote an exit code); any
other job of the folder without an exit code counts as running. One JSON document on stdout:
{"ok": true, "found": [[rel, bytes, files]], "removed": [rel]} or {"ok": false, "busy": [{id, step, state}]}
(exit 1, nothing removed).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import secrets
import shutil
import sys


from kimi_eagle_host.ops import machine_claims
from kimi_eagle_host.ops.jobs import job_state, live_claims, read, read_meta


def slurm_job_ended(run_dir: str, meta: dict) -> bool:
    """Stopped, or every task has recorded its exit: an array's tasks each write exit_code.<task>, and one task that
    ended leaves the others writing into the folder."""
    if os.path.exists(os.path.join(run_dir, "stopped")):
        return True
    n = meta.get("tasks") or 0
    names = [f"exit_code.{t}" for t in range(n)] if isinstance(n, int) and n > 0 else ["exit_code"]
    return all(os.path.isfile(os.path.join(run_dir, name)) for name in names)


def users(runs: str, root: str, ended: set) -> list[dict]:
    """Jobs whose recorded output folder is `root` and that may be running."""
    busy = []
    names = sorted(os.listdir(runs)) if os.path.isdir(runs) else []
    for name in names:
        d = os.path.join(runs, name)
        recorded = (read(os.path.join(d, "output_dir")) or "").strip()
        if not recorded or os.path.realpath(recorded) != root or name in ended:
            continue
        meta = read_meta(d) or {}
        if os.path.exists(os.path.join(d, "slurm_job_id")) or meta.get("scheduler") == "slurm":
            if not slurm_job_ended(d, meta):
                busy.append({"id": name, "step": meta.get("step"), "state": "submitted to Slurm"})
            continue
        if not os.path.isfile(os.path.join(d, "meta.json")):
            continue  # recorded, not started (yet): it starts after this removal, under the same lock
        st = job_state(d)
        if st["state"] == "running":
            busy.append({"id": name, "step": st["step"], "state": "running"})
    return busy


def machine_users(root: str, runs: str, seen: list) -> list[dict]:
    """Live jobs of any workdir on this machine (the machine's claims) whose output folder is `root`, holds it,
    or lies under it; those of this runs dir already in `seen` are not repeated."""
    known = {os.path.realpath(os.path.join(runs, b["id"])) for b in seen}

    def output_dir(claim):  # recorded at the start, or by the job itself since (an exec running provenance.py)
        return claim.get("output_dir") or (read(os.path.join(claim["run_dir"], "output_dir")) or "").strip()

    return [{"id": c["job_id"], "step": c.get("step"), "state": "running", "workdir": c.get("workdir"),
             "other_workdir": os.path.realpath(os.path.dirname(c["run_dir"])) != os.path.realpath(runs)}
            for c in live_claims(where=lambda c: machine_claims.overlaps(output_dir(c), root))
            if os.path.realpath(c["run_dir"]) not in known]


def measure(root: str, rels) -> list:
    out = []
    for rel in rels:
        base = os.path.join(root, rel)
        if not os.path.isdir(base):
            continue
        size = count = 0
        for d, _, files in os.walk(base):
            for f in files:
                try:
                    size += os.lstat(os.path.join(d, f)).st_size
                    count += 1
                except OSError:
                    pass
        out.append([rel, size, count])
    return out


def remove(root: str, rels) -> list:
    gone = []
    for rel in rels:
        base = os.path.join(root, rel)
        aside = os.path.join(os.path.dirname(base), "." + os.path.basename(base) + ".removing-" + secrets.token_hex(6))
        try:
            os.rename(base, aside)
        except FileNotFoundError:
            continue
        shutil.rmtree(aside)
        gone.append(rel)
    return gone


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs-dir", required=True, help="the host's job folders")
    ap.add_argument("--root", required=True, help="the run's output folder")
    ap.add_argument("--ended", default="", help="jobs the controller knows have ended (comma list)")
    ap.add_argument("--measure", action="store_true", help="only say the folders' sizes: remove nothing, take no lock")
    ap.add_argument("rels", nargs="+", help="folders under the output folder to remove")
    a = ap.parse_args(argv)
    if any(os.path.isabs(r) or ".." in r.split("/") for r in a.rels):
        print(json.dumps({"ok": False, "error": "folders must be relative to the output folder"}))
        return 2
    runs, root = os.path.abspath(a.runs_dir), os.path.realpath(a.root)
    if a.measure:  # what `clean --dry-run` and the confirmation show
        print(json.dumps({"ok": True, "found": measure(root, a.rels)}))
        return 0
    os.makedirs(runs, exist_ok=True)
    # Both locks ops/jobs.py's start holds, in its order: no job of any workdir on this machine starts between the
    # check and the removal.
    with open(os.path.join(runs, ".lock"), "a+") as lockf, machine_claims.locked():
        fcntl.flock(lockf, fcntl.LOCK_EX)
        busy = users(runs, root, set(filter(None, a.ended.split(","))))
        busy += machine_users(root, runs, busy)
        if busy:
            print(json.dumps({"ok": False, "busy": busy, "found": measure(root, a.rels), "removed": []}))
            return 1
        found = measure(root, a.rels)
        print(json.dumps({"ok": True, "found": found, "removed": remove(root, [f[0] for f in found])}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
