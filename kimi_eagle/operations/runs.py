"""A run's output folder on a host, found by its job (the job records it: <workdir>/runs/<job>/output_dir, written by
kimi_eagle_host/ops/provenance.py) or given as a folder; pull.py and clean.py work on it."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass

from ..errors import ConfigError
from ..hosts.session import RUNS, HostSession
from ..shell import join


@dataclass
class RunDir:
    host: str
    path: str  # absolute, on the host
    job_id: str | None = None


def human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def host_python(session: HostSession) -> str:
    from ..templating import sh_path

    return sh_path(session.host.python)


def json_of(session: HostSession, code: str, args: list[str], what: str):
    """Run `code` with the host's Python; its last line of stdout, as JSON."""
    res = session.transport.run(f"{host_python(session)} -c {join([code, *args])}", check=True, what=what, timeout=3600)
    return json.loads(res.stdout.strip().splitlines()[-1])


def locate(session: HostSession, job_id: str | None = None, run_dir: str | None = None) -> RunDir:
    """The output folder of a job (its record) or the one given (relative paths are under the workdir)."""
    if bool(job_id) == bool(run_dir):
        raise ConfigError("name a job, or a run folder with --run DIR (not both)")
    if job_id:
        from ..jobs.job_info import check_job_id

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


