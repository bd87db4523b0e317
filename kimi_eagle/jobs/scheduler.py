"""How a host runs a job: a detached process group over SSH (direct) or a Slurm submission (slurm).

The commands (run, logs, status, stop) and group jobs talk to a Scheduler and never ask which one it is.
`emit_for(task)` gives the line sink of one task's output ('' for a job with one output, the array index
for Slurm array tasks).
"""

from __future__ import annotations

import abc

from . import direct, job_info, layout


class Scheduler(abc.ABC):
    name: str

    @abc.abstractmethod
    def render(self, session, step: str, extra: list[str], shape: layout.Shape | None = None,
               job_id: str = "JOB-ID") -> dict[str, str]:
        """The files `start` would upload for `job_id`, {path relative to the workdir: text}; validates the input."""

    @abc.abstractmethod
    def start(self, session, step: str, extra: list[str], *, gpu: bool | None = None, shape: layout.Shape | None = None,
              job_id: str | None = None, files: dict[str, str] | None = None) -> job_info.Job:
        """Start the job; `files`: what render gave for this job_id (rendered once), where the scheduler can use it."""

    @abc.abstractmethod
    def status(self, session, job_id: str | None = None) -> list[job_info.Job]: ...

    @abc.abstractmethod
    def stop(self, session, job_id: str, grace: float = 10.0) -> dict: ...

    @abc.abstractmethod
    def follow(self, host, job_id: str, emit_for, *, follow: bool = True, tail: int | None = None, session=None,
               on_reconnect=None): ...

    def preflight(self, session, step: str) -> list[str]:
        """Scheduler-level problems (one line each) that make a start pointless; the step's own checks are separate."""
        return []


class Direct(Scheduler):
    """A detached job in its own session and process group (kimi_eagle_host/ops/jobs.py on the host)."""

    name = "direct"

    def render(self, session, step, extra, shape=None, job_id="JOB-ID"):
        return direct.job_files(session, step, extra, job_id, shape)

    def start(self, session, step, extra, *, gpu=None, shape=None, job_id=None, files=None):
        return direct.start(session, step, extra, gpu=gpu, shape=shape, job_id=job_id, files=files)

    def status(self, session, job_id=None):
        return direct.status(session, job_id)

    def stop(self, session, job_id, grace=10.0):
        return direct.stop(session, job_id, grace)

    def follow(self, host, job_id, emit_for, *, follow=True, tail=None, session=None, on_reconnect=None):
        from . import log_stream

        return log_stream.follow(host, job_id, emit_for(""), follow=follow, tail=tail, session=session, on_reconnect=on_reconnect)


class Slurm(Scheduler):
    """sbatch on the host (a login node); see slurm.py."""

    name = "slurm"

    def render(self, session, step, extra, shape=None, job_id="JOB-ID"):
        self._unshaped(session, shape)
        from . import slurm

        return slurm.job_files(session, step, extra, job_id)

    def start(self, session, step, extra, *, gpu=None, shape=None, job_id=None, files=None):
        self._unshaped(session, shape)
        from . import slurm

        return slurm.start(session, step, extra, job_id=job_id, files=files)

    @staticmethod
    def _unshaped(session, shape) -> None:
        if shape is not None and (shape.ranks or shape.torchrun):
            from ..errors import ConfigError

            raise ConfigError(f"{session.name}: a Slurm host shapes its own jobs (slurm.shards, slurm.nodes); "
                              "it cannot be part of a --group run")

    def status(self, session, job_id=None):
        from . import slurm

        return slurm.status(session, job_id)

    def stop(self, session, job_id, grace=10.0):
        from . import slurm

        return slurm.stop(session, job_id, grace)

    def follow(self, host, job_id, emit_for, *, follow=True, tail=None, session=None, on_reconnect=None):
        from . import slurm

        return slurm.follow(host, job_id, emit_for, follow=follow, tail=tail, session=session, on_reconnect=on_reconnect)

    def preflight(self, session, step):
        from . import slurm

        return slurm.preflight(session, step)


SCHEDULERS = {"direct": Direct(), "slurm": Slurm()}


def for_host(host) -> Scheduler:
    return SCHEDULERS[host.scheduler]
