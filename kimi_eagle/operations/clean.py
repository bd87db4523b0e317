"""`clean`: remove what is bulky once trained (hidden states, checkpoints), never while a job that uses the folder
runs: the last check and the removal happen on the host under the lock a job's start takes (the host half,
kimi_eagle_host/ops/clean.py), so no job starts in between, and two cleans at once take turns."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import CommandError, ConfigError, ConnectionFailed
from ..hosts.session import RUNS, HostSession
from ..jobs.job_info import LIVE
from ..shell import join
from .runs import RunDir, host_python

BULKY = ("hidden_states", "draft/checkpoints")  # what `clean` removes: terabytes at Kimi's size


@dataclass
class Bulky:
    rel: str
    bytes: int
    files: int
    at: str | None = None  # the real folder, where a link leads elsewhere (the one emptied; the link stays)


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


def measure(session: HostSession, run: RunDir) -> list[Bulky]:
    """Sizes of the run's bulky folders that exist (ops/clean.py --measure: reads only)."""
    data = _clean_on_host(session, ["--measure", "--runs-dir", RUNS, "--root", run.path, *BULKY])
    return [Bulky(*row) for row in data["found"]]


def _clean_on_host(session: HostSession, args: list[str]) -> dict:
    """kimi_eagle_host.ops.clean on the host: its JSON answer; a lost connection or a broken run is an error."""
    res = session.call("ops.clean", args, timeout=3600)
    if res.exited == -1:
        raise ConnectionFailed(f"{session.name}: connection lost while measuring or removing the run's folders",
                               result=res)
    try:
        data = json.loads(res.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        raise CommandError(f"{session.name}: ops.clean failed (exit {res.exited}): {res.stderr.strip()[-300:]}",
                           result=res) from None
    if data.get("error"):  # exit 2: a folder clean must not touch (a link to the home folder); nothing was done
        raise (ConfigError if res.exited == 2 else CommandError)(f"{session.name}: {data['error']}", result=res)
    return data


def users(session: HostSession, run: RunDir, listed: list | None = None) -> list:
    """Running (or queued) jobs whose outputs are this folder (from `listed`, the host's jobs, when given)."""
    from ..jobs.scheduler import for_host

    listed = for_host(session.host).status(session) if listed is None else listed
    live = [j for j in listed if j.state in LIVE]
    if not live:
        return []
    code = ("import os, sys\nroot = os.path.realpath(sys.argv[1])\nfor d in sys.argv[2:]:\n"
            "    try:\n        p = open(os.path.join(d, 'output_dir')).read().strip()\n    except OSError:\n        continue\n"
            "    if os.path.realpath(p) == root:\n        print(os.path.basename(d))\n")
    res = session.transport.run(f"{host_python(session)} -c {join([code, run.path, *[j.run_dir or session.path(f'{RUNS}/{j.id}') for j in live]])}",
                                check=True, what="which jobs use the run")
    using = set(res.stdout.split())
    return [j for j in live if j.id in using]


def clean(session: HostSession, run: RunDir, *, dry_run: bool = False, confirm=None) -> CleanResult:
    """Remove the run's hidden states and checkpoints. Refused while a job using them runs. `confirm(result)`
    is asked (with the sizes found) before anything is removed; False leaves everything as it is."""
    from ..jobs.scheduler import for_host

    result = CleanResult(run, measure(session, run), dry_run=dry_run)
    listed = for_host(session.host).status(session)
    busy = users(session, run, listed)
    if busy:
        raise _busy(session, run, busy[0].id, busy[0].step, busy[0].state)
    if dry_run or not result.found or (confirm is not None and not confirm(result)):
        return result
    # Checked again and removed on the host under the lock a job's start holds: a job started since the check
    # above (or while the user answered) is seen there, and nothing is removed.
    ended = ",".join(j.id for j in listed if j.state not in LIVE)
    data = _clean_on_host(session, ["--runs-dir", RUNS, "--root", run.path, "--ended", ended,
                                *(b.rel for b in result.found)])
    if data.get("busy"):
        b = data["busy"][0]
        raise _busy(session, run, b["id"], b.get("step"), b["state"], b.get("workdir") if b.get("other_workdir") else None)
    result.removed = data["removed"]
    result.gone_before = [b.rel for b in result.found if b.rel not in {f[0] for f in data["found"]}]
    if data.get("left"):
        rel, path, why = data["left"][0]
        more = f" (and {len(data['left']) - 1} more)" if len(data["left"]) > 1 else ""
        done = f"; removed {', '.join(result.removed)}" if result.removed else ""
        raise CommandError(f"{session.name}: could not remove all of {rel}: {path} is left ({why}){more}{done}. "
                           "Run clean again to finish it once the cause is fixed, or remove it by hand", result=result)
    if not data.get("ok"):
        raise CommandError(f"{session.name}: ops.clean: {data}")
    return result


def _busy(session: HostSession, run: RunDir, job_id: str, step, state: str, workdir: str | None = None) -> CommandError:
    if workdir:
        # a job of another workdir (another inventory entry) on the same machine: its claim is the machine's
        return CommandError(f"{session.name}: job {job_id} ({step}) of workdir {workdir} on this machine is {state} "
                            f"on {run.path}; nothing was removed. Wait for it, or stop it from the inventory entry "
                            f"that started it")
    return CommandError(f"{session.name}: job {job_id} ({step}) is {state} on {run.path}; nothing was removed. "
                        f"Wait for it, or stop it: kimi-eagle stop {job_id} --host {session.name}")
