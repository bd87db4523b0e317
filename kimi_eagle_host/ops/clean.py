#!/usr/bin/env python3
"""Remove a run's bulky folders (`kimi-eagle clean`), never while a job that uses them runs. Stdlib only.

The check and the renaming happen under flock(<runs>/.lock) and the machine's lock (ops/machine_claims.py), the
locks ops/jobs.py holds while it starts a job, and every pipeline job's output folder is recorded
(<runs>/<job>/output_dir, then in its machine claim) before its start: a job of any workdir on this machine
either started before the check (it is seen, and nothing is removed) or starts after the folders were renamed
aside. Two cleans at once take turns; the second finds what is left. Each folder is renamed aside first
(`.NAME.removing-<pid>-<start>-<hex>` next to it: no reader sees half of it), then the locks are released and the
asides deleted, so no job start on the machine waits for terabytes to go. An aside whose clean is gone (killed,
a dropped connection, a file it could not delete) is found by the next clean, shown in its sizes, and deleted.

A folder that is a link (hidden_states -> /bigdisk/hs) is followed: the space is where it points, so that folder
is emptied (renamed aside next to itself and made again, empty, with its mode) and the link stays, so the next
run writes where the user chose. A link that leads to a folder holding the run's folder, the runs dir or the
home folder is refused (exit 2, nothing removed).

  python -m kimi_eagle_host.ops.clean --runs-dir R --root OUT [--ended JOB,JOB] REL ...

--ended names jobs the controller knows have ended (a Slurm job cancelled before it wrote an exit code); any
other job of the folder without an exit code counts as running. One JSON document on stdout:
{"ok": true, "found": [[rel, bytes, files, real]], "removed": [rel], "left": []} (real: the folder's real path
where a link leads elsewhere, else null); {"ok": false, "busy": [{id, step, state}]} (exit 1, nothing removed);
{"ok": false, ..., "left": [[rel, path, error]]} (exit 1: what could not be renamed or deleted, and where it is).
"""

from __future__ import annotations

import argparse
import fcntl
import glob
import json
import os
import re
import secrets
import shutil
import stat
import sys

from kimi_eagle_host import procfs
from kimi_eagle_host.ops import machine_claims
from kimi_eagle_host.ops.jobs import LIVE_STATES, Processes, job_state, live_claims, read, read_meta, slurm_run


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
    busy, procs = [], Processes()  # one read of /proc for all the jobs
    names = sorted(os.listdir(runs)) if os.path.isdir(runs) else []
    for name in names:
        d = os.path.join(runs, name)
        recorded = (read(os.path.join(d, "output_dir")) or "").strip()
        if not recorded or os.path.realpath(recorded) != root or name in ended:
            continue
        meta = read_meta(d) or {}
        if slurm_run(d, meta):
            if not slurm_job_ended(d, meta):
                busy.append({"id": name, "step": meta.get("step"), "state": "submitted to Slurm"})
            continue
        if not os.path.isfile(os.path.join(d, "meta.json")):
            continue  # recorded, not started (yet): it starts after this removal, under the same lock
        st = job_state(d, procs)
        if st["state"] in LIVE_STATES:  # `ending` too: what its shell left may still write there
            busy.append({"id": name, "step": st["step"], "state": st["state"]})
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


class Refused(Exception):
    """A folder clean must not touch: one line, exit 2, nothing removed."""


def _holds(outer: str, inner: str) -> bool:
    return inner == outer or inner.startswith(outer.rstrip("/") + "/")


def _asides(real: str) -> list[str]:
    parent, name = os.path.split(real)
    return sorted(glob.glob(os.path.join(glob.escape(parent), "." + glob.escape(name) + ".removing-*")))


def _clean_alive(aside: str) -> bool:
    """Whether the clean that renamed this aside still runs (and deletes it): its pid and start are in the name."""
    m = re.search(r"\.removing-(\d+)-(\d+)-[0-9a-f]+$", aside)
    st = procfs.stat(int(m.group(1))) if m else None
    return st is not None and st.alive and st.start_ticks == int(m.group(2))


def leftovers(real: str) -> list[str]:
    """The asides of the folder that no running clean deletes: to be shown and deleted by this one."""
    return [p for p in _asides(real) if os.path.isdir(p) and not os.path.islink(p) and not _clean_alive(p)]


def _lost_link(path: str) -> str | None:
    """A link an earlier version renamed aside before it failed on it (it could not delete a link): still what
    names the data, put back by the next clean."""
    if os.path.lexists(path):
        return None
    return next((p for p in _asides(path) if os.path.islink(p)), None)


def locate(root: str, rel: str, runs: str) -> tuple[str, str]:
    """(the path rel names, the real folder behind it, links followed)."""
    path = os.path.join(root, rel)
    real = os.path.realpath(_lost_link(path) or path)
    for what, keep in (("the run's folder", root), ("the runs folder", runs),
                       ("the home folder", os.path.realpath(os.path.expanduser("~")))):
        if _holds(real, keep):
            raise Refused(f"{path} leads to {real}, which {'is' if real == keep else 'holds'} {what} {keep}: "
                          f"nothing was removed (point {rel} at a folder of its own, or remove what you want gone "
                          "by hand)")
    return path, real


def _present(path: str, real: str) -> bool:
    """Whether the folder is there to remove; the empty folder a link leads to once cleaned is not (the link, kept,
    is the user's layout)."""
    return os.path.isdir(real) and not (os.path.islink(path) and not os.listdir(real))


def _size(top: str) -> tuple[int, int]:
    size = count = 0
    for d, _, files in os.walk(top):
        for f in files:
            try:
                size += os.lstat(os.path.join(d, f)).st_size
                count += 1
            except OSError:
                pass
    return size, count


def _row(rel: str, path: str, real: str, parts: list[str]) -> list:
    """[rel, bytes, files, the real folder where a link leads elsewhere (else None)] of what goes."""
    sizes = [_size(p) for p in parts]
    return [rel, sum(s for s, _ in sizes), sum(n for _, n in sizes), real if real != path else None]


def measure(root: str, rels, runs: str) -> list:
    """The row of each folder that is there, or that an earlier clean left aside; reads only."""
    out = []
    for rel in rels:
        path, real = locate(root, rel, runs)
        parts = ([real] if _present(path, real) else []) + leftovers(real)
        if parts:
            out.append(_row(rel, path, real, parts))
    return out


def set_aside(root: str, rels, runs: str, left: list) -> list:
    """Rename each folder aside (call under the locks): [(rel, path, real, [asides to delete])], with the leftovers
    of earlier cleans. Every folder is checked before any is renamed; what cannot be renamed goes to `left`."""
    for rel in rels:
        locate(root, rel, runs)  # Refused: before anything is renamed
    me = procfs.stat(os.getpid())
    tag = f"{os.getpid()}-{me.start_ticks if me else 0}-{secrets.token_hex(4)}"
    out = []
    for rel in rels:
        path = os.path.join(root, rel)
        lost = _lost_link(path)
        if lost:
            os.rename(lost, path)
        path, real = locate(root, rel, runs)
        parts = leftovers(real)
        if _present(path, real):
            aside = os.path.join(os.path.dirname(real), f".{os.path.basename(real)}.removing-{tag}")
            try:
                mode = stat.S_IMODE(os.stat(real).st_mode)
                os.rename(real, aside)
                parts.append(aside)
                if os.path.islink(path):
                    os.mkdir(real, mode)  # the link keeps leading to a folder, now empty
            except OSError as exc:
                left.append([rel, real, exc.strerror or str(exc)])
        if parts:
            out.append((rel, path, real, parts))
    return out


def delete(asides, left: list) -> list:
    """Delete the asides (no lock needed: no job uses a renamed folder); the rels wholly removed. What cannot be
    deleted goes to `left`, for a later clean or a person."""
    removed = []
    for rel, _, _, parts in asides:
        failed = False
        for part in parts:
            try:
                shutil.rmtree(part)
            except OSError as exc:
                left.append([rel, part, exc.strerror or str(exc)])
                failed = True
        if not failed:
            removed.append(rel)
    return removed


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
    try:
        if a.measure:  # what `clean --dry-run` and the confirmation show
            print(json.dumps({"ok": True, "found": measure(root, a.rels, runs)}))
            return 0
        os.makedirs(runs, exist_ok=True)
        left = []
        # Both locks ops/jobs.py's start holds, in its order: no job of any workdir on this machine starts between
        # the check and the renaming.
        with open(os.path.join(runs, ".lock"), "a+") as lockf, machine_claims.locked():
            fcntl.flock(lockf, fcntl.LOCK_EX)
            busy = users(runs, root, set(filter(None, a.ended.split(","))))
            busy += machine_users(root, runs, busy)
            if busy:
                print(json.dumps({"ok": False, "busy": busy, "found": measure(root, a.rels, runs), "removed": []}))
                return 1
            asides = set_aside(root, a.rels, runs, left)
    except Refused as exc:
        print(json.dumps({"ok": False, "error": str(exc)}))
        return 2
    found = [_row(*aside) for aside in asides]  # measured without the locks too: no one else uses an aside
    removed = delete(asides, left)
    print(json.dumps({"ok": not left, "found": found, "removed": removed, "left": left}))
    return 0 if not left else 1


if __name__ == "__main__":
    sys.exit(main())
