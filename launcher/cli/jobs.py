"""run, logs, status, stop: detached jobs on a host."""

from __future__ import annotations

import time
from typing import Optional

import typer

from .context import console_ui, state
from ..errors import EXIT_RUNNING, ConfigError


def _host_for_job(job_id: str, host: Optional[str]):
    from .. import jobs

    if host:
        return state.inventory.one(host)
    remembered = jobs.host_of(job_id)
    if remembered and remembered in state.inventory.hosts:
        return state.inventory.hosts[remembered]
    if len(state.inventory.hosts) == 1:
        return next(iter(state.inventory.hosts.values()))
    raise ConfigError(f"job {job_id}: not started from this machine; name its host with --host")


def _follow_and_exit(host, job_id: str, *, follow: bool, tail: Optional[int], session=None):
    from .. import jobs, logs, logview

    ui = console_ui()
    printer = logview.Printer(host.name, ui.console(), as_json=state.json)

    def reconnecting(n, wait):
        ui.err_console().print(f"[{host.name}] connection lost; reconnecting in {wait:.1f}s (attempt {n})", markup=False)

    try:
        result = logs.follow(host, job_id, printer, follow=follow, tail=tail, session=session, on_reconnect=reconnecting)
    except KeyboardInterrupt:
        printer.close()
        ui.err_console().print(
            f"\ndetached; job {job_id} keeps running on {host.name}.\n"
            f"  reattach: kimi-eagle logs {job_id} --follow --host {host.name}\n"
            f"  stop:     kimi-eagle stop {job_id} --host {host.name}",
            markup=False,
        )
        raise typer.Exit(EXIT_RUNNING)
    printer.close()
    job = result.job
    if state.json:
        ui.emit_json({"job": job.as_dict(), "reconnects": result.reconnects})
    elif follow or job.state != "running":
        style = "green" if job.state == "succeeded" else "yellow" if job.state == "running" else "red"
        code = "" if job.exit_code is None else f" (exit code {job.exit_code})"
        ui.err_console().print(f"[{host.name}] job {job.id} {job.state}{code}", style=style, markup=False)
    raise typer.Exit(jobs.STATE_EXIT[job.state])


def run(
    ctx: typer.Context,
    step: str = typer.Argument(..., help="prepare | extract | vocab | train | all | exec (any command after --)"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host from the inventory."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Start and return; follow later with `logs`."),
    reset_gpus: bool = typer.Option(False, "--reset-gpus", help="First stop our own stale GPU holders on the host."),
    no_preflight: bool = typer.Option(False, "--no-preflight", help="Skip the preflight checks."),
    gpu: Optional[bool] = typer.Option(None, "--gpu/--no-gpu", help="Take the host's GPU lock (default: extract, train, all)."),
):
    """Start a pipeline step (or `all`) as a detached job on the host; follow its log unless --detach.

    Flags after `--` go to the step's script, e.g. `kimi-eagle run extract -- --validate`;
    `kimi-eagle run exec -- CMD ARGS` runs any command with the same log, stop and exit-code guarantees.
    """
    from .. import jobs
    from ..host import HostSession

    h = state.inventory.one(host)
    extra = list(ctx.args)
    from ..renderables import Offline

    jobs.render_job(HostSession(h, transport=Offline(h)), step, extra)  # validate before connecting
    ui = console_ui()
    session = HostSession(h)
    try:
        if reset_gpus:
            from .. import gpu

            gpu.reset_before_run(session, printer=lambda text: ui.line(f"[{h.name}] {text}"))
        if not no_preflight and step != "exec":
            from .. import preflight

            preflight.gate(session, step, printer=lambda text, style=None: ui.line(f"[{h.name}] {text}", style=style))
        job = jobs.start(session, step, extra, gpu=gpu)
    except BaseException:
        session.close()
        raise
    if state.json and detach:
        ui.emit_json(job.as_dict())
    else:
        ui.err_console().print(f"[{h.name}] started job {job.id} ({step}), log {job.log}", markup=False)
    if detach:
        session.close()
        if not state.json:
            ui.line(job.id)
        return
    _follow_and_exit(h, job.id, follow=True, tail=None, session=session)


def logs(
    job_id: str = typer.Argument(..., metavar="JOB"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host of the job (remembered for jobs started here)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream until the job ends; survive connection drops."),
    tail: Optional[int] = typer.Option(None, "--tail", "-n", min=0, help="Start with the last N lines."),
):
    """Print a job's log. Exit code: 0 succeeded, 1 failed, 3 still running, 4 stopped or lost."""
    _follow_and_exit(_host_for_job(job_id, host), job_id, follow=follow, tail=tail)


def status(
    job_id: Optional[str] = typer.Argument(None, metavar="[JOB]"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host or group (default: every host)."),
):
    """List jobs with id, step, host, state, runtime and exit code."""
    from .. import jobs
    from ..errors import EXIT_FAILED
    from ..parallel import each_host

    if job_id:
        # One job, one host: an unknown job is bad input (exit 2), as for `logs` and `stop`.
        from ..host import HostSession
        from ..parallel import HostOutcome

        h = _host_for_job(job_id, host)
        with HostSession(h) as session:
            outcomes = [HostOutcome(h.name, jobs.status(session, job_id))]
    else:
        outcomes = each_host(state.inventory.select(host), lambda s: jobs.status(s, job_id))
    all_jobs = [j for o in outcomes if o.ok for j in o.value]
    ui = console_ui()
    if state.json:
        ui.emit_json({"jobs": [j.as_dict() for j in all_jobs],
                      "errors": {o.host: str(o.error) for o in outcomes if not o.ok}})
    else:
        for o in outcomes:
            if not o.ok:
                ui.line(f"[{o.host}] {o.error}", style="red")
        rows = [[j.id, j.step, j.host, j.state, _duration(j.runtime_s), "" if j.exit_code is None else j.exit_code,
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.started_at)) if j.started_at else ""] for j in all_jobs]
        ui.table("jobs", ["job", "step", "host", "state", "runtime", "exit", "started"], rows)
    if job_id and all_jobs:
        raise typer.Exit(jobs.STATE_EXIT[all_jobs[0].state])
    if not all(o.ok for o in outcomes):
        raise typer.Exit(EXIT_FAILED)


def _duration(seconds) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def stop(
    job_id: str = typer.Argument(..., metavar="JOB"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host of the job (remembered for jobs started here)."),
    grace: float = typer.Option(10.0, "--grace", min=0, help="Seconds between SIGTERM and SIGKILL."),
):
    """Stop a job: SIGTERM to its whole process group, SIGKILL after --grace, verify nothing is left."""
    from .. import jobs
    from ..host import HostSession

    h = _host_for_job(job_id, host)
    with HostSession(h) as session:
        data = jobs.stop(session, job_id, grace)
    ui = console_ui()
    if state.json:
        return ui.emit_json(data)
    if data.get("already"):
        ui.line(f"[{h.name}] job {job_id} is not running ({data['already']}); nothing to stop")
        return
    sent = data["sent"]
    ui.line(f"[{h.name}] job {job_id} stopped: {len(data['signalled'])} processes, SIGTERM then "
            f"{'SIGKILL to ' + str(sent['KILL']) if sent['KILL'] else 'no SIGKILL needed'}; nothing left "
            f"({data['elapsed_s']}s)", style="green")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run)
    app.command()(logs)
    app.command()(status)
    app.command()(stop)
