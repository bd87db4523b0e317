"""A run's outputs on a host: find them (by job or by folder), bring back what a user keeps (`pull`), remove
what is bulky once trained (`clean`).

A pipeline job records where its outputs are (`<workdir>/runs/<job>/output_dir`, written by kimi_eagle_host/ops/provenance.py),
so a job id is enough. `pull` copies the export, the eval report, the recorded settings and versions, the
tensorboard events and the job logs, sha256-verified and skipping what is already here (sync.fetch, the
upload's hashing the other way). `clean` removes the hidden states and the checkpoints, never while a job that
uses the folder runs: the last check and the removal happen on the host under the lock a job's start takes
(kimi_eagle_host/ops/clean.py), so no job starts in between, and two cleans at once take turns.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from pathlib import Path

from . import sync
from .errors import CommandError, ConfigError, ConnectionFailed
from .host import RUNS, HostSession
from .shell import join

KEPT = ("draft/export", "eval", "runs", "tracking")  # what `pull` brings back, under the output folder
BULKY = ("hidden_states", "draft/checkpoints")  # what `clean` removes: terabytes at Kimi's size
JOB_FILES = ("log", "meta.json", "exit_code", "headline")  # a job's own record, from <workdir>/runs/<job>/

# Outputs that one job writes for the whole folder, and the file in them that names the job (train's
# training_info.json, eval's report.json): `pull JOB` takes them only when JOB wrote them.
OWNED = {"draft/export": "training_info.json", "eval": "report.json"}

# Lists what `pull` takes: {"files": [[host path, local path, size]], "skipped": [[folder, writer or null]]}.
# Temporary files (.NAME.TOKEN.part/.tmp) are not outputs.
_LIST = r"""
import json, os, sys
root, runs, job = sys.argv[1], sys.argv[2], sys.argv[3]
subs, job_files, owned = sys.argv[4].split(","), sys.argv[5].split(","), json.loads(sys.argv[6])
out, skipped = [], []
def add(path, rel):
    if os.path.isfile(path) and not os.path.basename(path).startswith("."):
        out.append([path, rel, os.path.getsize(path)])
def writer(s):
    try:
        with open(os.path.join(root, s, owned[s]), "rb") as f:
            found = json.loads(f.read().decode())
        return found.get("job_id") if isinstance(found, dict) else None
    except (OSError, ValueError):
        return None
for s in subs:
    base = os.path.join(root, s)
    if job and s in owned and os.path.isdir(base) and writer(s) != job:
        skipped.append([s, writer(s)])
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


@dataclass
class RunDir:
    host: str
    path: str  # absolute, on the host
    job_id: str | None = None


@dataclass
class Bulky:
    rel: str
    bytes: int
    files: int


@dataclass
class CleanResult:
    run: RunDir
    found: list[Bulky] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    gone_before: list[str] = field(default_factory=list)  # confirmed, then removed by another clean first
    dry_run: bool = False

    @property
    def bytes(self) -> int:
        return sum(b.bytes for b in self.found)

    @property
    def freed(self) -> int:
        return sum(b.bytes for b in self.found if b.rel in self.removed)


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def _python(session: HostSession) -> str:
    from .render import sh_path

    return sh_path(session.host.python)


def _json_of(session: HostSession, code: str, args: list[str], what: str):
    res = session.transport.run(f"{_python(session)} -c {join([code, *args])}", check=True, what=what, timeout=3600)
    return json.loads(res.stdout.strip().splitlines()[-1])


def locate(session: HostSession, job_id: str | None = None, run_dir: str | None = None) -> RunDir:
    """The output folder of a job (its record) or the one given (relative paths are under the workdir)."""
    if bool(job_id) == bool(run_dir):
        raise ConfigError("name a job, or a run folder with --run DIR (not both)")
    if job_id:
        from .jobs import check_job_id

        check_job_id(job_id)
        res = session.transport.run(f"cat -- {join([session.path(f'{RUNS}/{job_id}/output_dir')])}")
        if res.exited != 0 or not res.stdout.strip():
            raise ConfigError(f"{session.name}: job {job_id} has no record of its output folder (not a pipeline job, "
                              f"or not started by this kimi-eagle); name the folder with --run DIR")
        return RunDir(session.name, res.stdout.strip(), job_id)
    path = run_dir if run_dir.startswith(("/", "~")) else session.path(run_dir)
    path = posixpath.normpath(session.transport.abspath(path))
    if session.transport.run(f"test -d {join([path])}").exited != 0:
        raise ConfigError(f"{session.name}:{path}: no such folder")
    return RunDir(session.name, path, None)


def pull(session: HostSession, run: RunDir, dest: Path) -> sync.FetchReport:
    """Copy the run's export, reports, recorded settings, tensorboard events and job logs into `dest`."""
    subs = ["draft/export", "eval"]
    subs += [f"runs/{run.job_id}", f"tracking/{run.job_id}"] if run.job_id else ["runs", "tracking"]
    listed = _json_of(session, _LIST, [run.path, session.path(RUNS), run.job_id or "", ",".join(subs),
                                       ",".join(JOB_FILES), json.dumps(OWNED)], "listing the run's files")
    if not listed["files"]:
        raise CommandError(f"{session.name}:{run.path}: nothing to pull (no export, report or log there yet)")
    report = sync.fetch(session.transport, [tuple(f) for f in listed["files"]], dest)
    report.skipped = [tuple(s) for s in listed["skipped"]]
    return report


def measure(session: HostSession, run: RunDir) -> list[Bulky]:
    """Sizes of the run's bulky folders that exist (ops/clean.py --measure: reads only)."""
    data = _clean_run(session, ["--measure", "--runs-dir", RUNS, "--root", run.path, *BULKY])
    return [Bulky(*row) for row in data["found"]]


def _clean_run(session: HostSession, args: list[str]) -> dict:
    """kimi_eagle_host.ops.clean on the host: its JSON answer; a lost connection or a broken run is an error."""
    res = session.call("ops.clean", args, timeout=3600)
    if res.exited == -1:
        raise ConnectionFailed(f"{session.name}: connection lost while measuring or removing the run's folders",
                               result=res)
    try:
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise CommandError(f"{session.name}: ops.clean failed (exit {res.exited}): {res.stderr.strip()[-300:]}",
                           result=res) from None


def users(session: HostSession, run: RunDir, listed: list | None = None) -> list:
    """Running (or queued) jobs whose outputs are this folder (from `listed`, the host's jobs, when given)."""
    from .backend import for_host

    listed = for_host(session.host).status(session) if listed is None else listed
    live = [j for j in listed if j.state in ("running", "pending")]
    if not live:
        return []
    code = ("import os, sys\nroot = os.path.realpath(sys.argv[1])\nfor d in sys.argv[2:]:\n"
            "    try:\n        p = open(os.path.join(d, 'output_dir')).read().strip()\n    except OSError:\n        continue\n"
            "    if os.path.realpath(p) == root:\n        print(os.path.basename(d))\n")
    res = session.transport.run(f"{_python(session)} -c {join([code, run.path, *[j.run_dir or session.path(f'{RUNS}/{j.id}') for j in live]])}",
                                check=True, what="which jobs use the run")
    using = set(res.stdout.split())
    return [j for j in live if j.id in using]


def clean(session: HostSession, run: RunDir, *, dry_run: bool = False, confirm=None) -> CleanResult:
    """Remove the run's hidden states and checkpoints. Refused while a job using them runs. `confirm(result)`
    is asked (with the sizes found) before anything is removed; False leaves everything as it is."""
    from .backend import for_host

    result = CleanResult(run, measure(session, run), dry_run=dry_run)
    listed = for_host(session.host).status(session)
    busy = users(session, run, listed)
    if busy:
        raise _busy(session, run, busy[0].id, busy[0].step, busy[0].state)
    if dry_run or not result.found or (confirm is not None and not confirm(result)):
        return result
    # Checked again and removed on the host under the lock a job's start holds: a job started since the check
    # above (or while the user answered) is seen there, and nothing is removed.
    ended = ",".join(j.id for j in listed if j.state not in ("running", "pending"))
    data = _clean_run(session, ["--runs-dir", RUNS, "--root", run.path, "--ended", ended,
                                *(b.rel for b in result.found)])
    if data.get("busy"):
        b = data["busy"][0]
        raise _busy(session, run, b["id"], b.get("step"), b["state"], b.get("workdir") if b.get("other_workdir") else None)
    if not data.get("ok"):
        raise CommandError(f"{session.name}: ops.clean: {data.get('error') or data}")
    result.removed = data["removed"]
    result.gone_before = [b.rel for b in result.found if b.rel not in {f[0] for f in data["found"]}]
    return result


def _busy(session: HostSession, run: RunDir, job_id: str, step, state: str, workdir: str | None = None) -> CommandError:
    if workdir:
        # a job of another workdir (another inventory entry) on the same machine: its claim is the machine's
        return CommandError(f"{session.name}: job {job_id} ({step}) of workdir {workdir} on this machine is {state} "
                            f"on {run.path}; nothing was removed. Wait for it, or stop it from the inventory entry "
                            f"that started it")
    return CommandError(f"{session.name}: job {job_id} ({step}) is {state} on {run.path}; nothing was removed. "
                        f"Wait for it, or stop it: kimi-eagle stop {job_id} --host {session.name}")
