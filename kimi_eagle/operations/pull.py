"""`pull`: bring back what a user keeps from a run: the export, the choose and eval reports, the recorded settings and versions,
the tensorboard events and the job logs, sha256-verified and skipping what is already here (sync.fetch, the
upload's hashing the other way)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..errors import CommandError
from ..hosts import sync
from ..hosts.session import RUNS, HostSession
from .runs import RunDir, json_of

JOB_FILES = ("log", "meta.json", "exit_code", "headline")  # a job's own record, from <workdir>/runs/<job>/

# Outputs that one job writes for the whole folder, and the file in them that names the job (train's
# training_info.json, choose's and eval's report.json): `pull JOB` takes them only when JOB wrote them.
OWNED = {"draft/export": "training_info.json", "choose": "report.json", "eval": "report.json"}
# Files in such a folder that one job writes alone and that name it: `pull JOB` takes them where the folder's report
# is another job's or absent (a run without held-out prompts writes only eval's served smoke test).
OWN_FILES = {"eval": ["smoke.json"]}

# The files only ever appended to while a job runs, copied as prefixes of their listed size (sync.fetch): the job's log,
# tensorboard's event files, wandb's run stream (.wandb) and logs. Everything else may be rewritten in place (wandb's
# summary JSON, mlflow's meta.yaml, trackio's database) and is copied whole.
APPENDED = re.compile(r"(?:^|.*/)(?:log|events\.out\.tfevents\.[^/]*|[^/]*\.wandb|[^/]*\.log)")

# Lists what `pull` takes: {"files": [[host path, local path, size]], "skipped": [[folder, writer or null]]}.
# Temporary files (.NAME.TOKEN.part/.tmp) are not outputs.
_LIST = r"""
import json, os, sys
root, runs, job = sys.argv[1], sys.argv[2], sys.argv[3]
subs, job_files, owned = sys.argv[4].split(","), sys.argv[5].split(","), json.loads(sys.argv[6])
own_files = json.loads(sys.argv[7])
out, skipped = [], []
def add(path, rel):
    if os.path.isfile(path) and not os.path.basename(path).startswith("."):
        out.append([path, rel, os.path.getsize(path)])
def named(path):
    try:
        with open(path, "rb") as f:
            found = json.loads(f.read().decode())
        return found.get("job_id") if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None
for s in subs:
    base = os.path.join(root, s)
    writer = named(os.path.join(base, owned[s])) if s in owned else None
    if job and s in owned and os.path.isdir(base) and writer != job:
        alone = [f for f in own_files.get(s, []) if named(os.path.join(base, f)) == job]
        for f in alone:
            add(os.path.join(base, f), os.path.join(s, f))
        if writer is not None or not alone:
            skipped.append([s, writer])
        continue
    for d, dirs, files in os.walk(base):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in sorted(files):
            add(os.path.join(d, f), os.path.join(s, os.path.relpath(os.path.join(d, f), base)))
ids = [job] if job else sorted(os.listdir(runs)) if os.path.isdir(runs) else []
for j in ids:
    try:
        with open(os.path.join(runs, j, "output_dir")) as f:
            mine = os.path.realpath(f.read().strip()) == os.path.realpath(root)
    except OSError:
        mine = False
    if mine or j == job:
        for name in job_files:
            add(os.path.join(runs, j, name), os.path.join("logs", j, name))
print(json.dumps({"files": out, "skipped": skipped}))
"""



def pull(session: HostSession, run: RunDir, dest: Path) -> sync.FetchReport:
    """Copy the run's export, reports, recorded settings, tensorboard events and job logs into `dest`."""
    subs = ["draft/export", "choose", "eval"]
    subs += [f"runs/{run.job_id}", f"tracking/{run.job_id}"] if run.job_id else ["runs", "tracking"]
    listed = json_of(session, _LIST, [run.path, session.path(RUNS), run.job_id or "", ",".join(subs),
                                       ",".join(JOB_FILES), json.dumps(OWNED),
                                       json.dumps(OWN_FILES)], "listing the run's files")
    if not listed["files"]:
        raise CommandError(f"{session.name}:{run.path}: nothing to pull (no export, report or log there yet)")
    report = sync.fetch(session.transport, [tuple(f) for f in listed["files"]], dest,
                        appended=lambda rel: APPENDED.fullmatch(rel) is not None)
    report.skipped = [tuple(s) for s in listed["skipped"]]
    return report
