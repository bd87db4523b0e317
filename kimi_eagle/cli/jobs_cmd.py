"""run, logs, status, stop: detached jobs on a host, on a Slurm cluster, or over the hosts of a group."""

from __future__ import annotations

import time
from typing import Optional

import typer

from ..errors import EXIT_RUNNING, ConfigError
from ..hosts.parallel import failure_exit
from ..jobs import interrupts
from .context import RECIPE_HELP, console_ui, split_extra, state


class _Printers:
    """One log printer per label (host, or host:task for Slurm array tasks), closed together."""

    def __init__(self, ui):
        from ..jobs import log_printer

        self.ui, self.log_printer, self.printers = ui, log_printer, {}

    def __call__(self, label: str):
        if label not in self.printers:
            self.printers[label] = self.log_printer.Printer(label, self.ui.console(), as_json=state.json)
        return self.printers[label]

    def close(self):
        for p in self.printers.values():
            p.close()


def _reconnecting_line(host: str, wait: float) -> str:
    """Said once per outage (log_stream.Reconnects), however many attempts it takes."""
    from ..jobs.log_stream import MAX_WAIT

    return (f"[{host}] connection lost; reconnecting (first try in {wait:.1f}s, then ever less often, "
            f"up to {MAX_WAIT:.0f}s apart)")


def _follow_and_exit(job_id: str, host: Optional[str], *, follow: bool, tail: Optional[int], session=None):
    from ..jobs import job_info

    name = state.api.job_host(job_id, host).name
    ui = console_ui()
    printers = _Printers(ui)

    def reconnecting(n, wait):
        ui.note(_reconnecting_line(name, wait))

    try:
        result = state.api.follow(job_id, printers, host=name, follow=follow, tail=tail, session=session,
                                  on_reconnect=reconnecting)
    except KeyboardInterrupt:
        printers.close()
        _detached_hint(job_id, f"on {name}", f" --host {name}")
        raise typer.Exit(EXIT_RUNNING)
    printers.close()
    job = result.job
    if state.json:
        ui.emit_json_line({"job": job.as_dict(), "reconnects": result.reconnects,
                           "reconnect_attempts": result.reconnect_attempts})
    elif follow or job.state not in ("running", "pending"):
        _final_line(ui, name, job)
        if follow and job.state in ("succeeded", "ending") and job.exit_code == 0:
            _show_result(name, job, session)
    raise typer.Exit(job_info.exit_code_of(job.state, job.exit_code))


def _show_result(host: str, job, session) -> None:
    """The last word of a finished pipeline: where the result is, what it holds, what to run next."""
    export = state.api.export(host, job.step or "", session, job_id=job.id)
    if export is None:
        return
    ui = console_ui()
    ui.line(f"[{host}] draft exported to {export.path}", style="green")
    ui.line(f"[{host}]   {export.what()}")
    ui.line(f"[{host}] next, serve the target with it (vLLM): {export.next_command()}")


def _detached_hint(job_id: str, where: str, host_opt: str = ""):
    console_ui().note(
        f"\ndetached; job {job_id} keeps running {where}.\n"
        f"  reattach: kimi-eagle logs {job_id} --follow{host_opt}\n"
        f"  stop:     kimi-eagle stop {job_id}{host_opt}"
    )


def _final_line(ui, label: str, job):
    from ..jobs import job_info

    style = "green" if job.state == "succeeded" else "yellow" if job.state in job_info.LIVE else "red"
    code = "" if job.exit_code is None else f" (exit code {job.exit_code})"
    ui.note(f"[{label}] job {job.id} {job.state}{code}", style=style)
    if job.state == "ending":
        ui.note(f"[{label}] {_ending_note(job)}", style=style)
    if job.headline and job.state not in ("running", "pending"):
        ui.line(f"[{label}] {job.headline}")  # a step's one-line result (eval's acceptance figures)


def _ending_note(job) -> str:
    return (f"its shell has exited, but processes it left still run (pids {' '.join(map(str, job.left))}) and keep "
            f"the job's claims (the GPUs, its output folder) until they exit: kimi-eagle stop {job.id} --host "
            f"{job.host} ends them")


def run(
    ctx: typer.Context,
    step: str = typer.Argument(..., help="regenerate | prepare | extract | vocab | train | choose | eval | all | exec (any command after --)"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host from the inventory."),
    group: Optional[str] = typer.Option(None, "--group", "-g", help="Run over the hosts of this group: extract as shards "
                                        "(one job per host), train as one multi-node torchrun job."),
    shard_by: str = typer.Option("hosts", "--shard-by", help="Group shards: one rank per host (hosts) or per GPU (gpus: "
                                 "the hosts' `gpus:` counts)."),
    mode: Optional[str] = typer.Option(None, "--mode", help="Group runs of exec: shards (the command gets --rank R "
                                       "--world-size W) or torchrun (a Python script, on every host)."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Start and return; follow later with `logs`."),
    reset_gpus: bool = typer.Option(False, "--reset-gpus", help="First stop our own stale GPU holders on the host."),
    no_preflight: bool = typer.Option(False, "--no-preflight", help="Skip the preflight checks."),
    gpu: Optional[bool] = typer.Option(None, "--gpu/--no-gpu", help="Take the host's GPU lock (default: regenerate, extract, train, choose, eval, all)."),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-c", metavar="FILE", help=RECIPE_HELP),
):
    """Start a pipeline step (or `all`) as a detached job on the host; follow its log unless --detach.

    `KEY=VALUE` arguments override the recipe (or the inventory's pipeline): `kimi-eagle run all -c r.yaml epochs=3`.
    Flags after `--` go to the step's script, e.g. `kimi-eagle run extract -- --validate`;
    `kimi-eagle run exec -- CMD ARGS` runs any command with the same log, stop and exit-code guarantees.
    A Slurm host (`scheduler: slurm`) submits the job with sbatch instead; `--group G` runs over several hosts.
    """
    overrides, extra = split_extra(ctx, step_takes_command=step == "exec")
    state.use_recipe(recipe, overrides)
    if group:
        if host:
            raise ConfigError("give --host or --group, not both")
        return _run_group(step, group, extra, shard_by=shard_by, mode=mode, detach=detach, reset_gpus=reset_gpus,
                          no_preflight=no_preflight, gpu=gpu)
    ui = console_ui()
    try:
        started = state.api.run(step, host, extra, reset_gpus=reset_gpus, preflight=not no_preflight, gpu=gpu,
                                notify=_notifier(ui), keep_session=not detach)
        job = started.job
        with interrupts.naming_job(started.host, job.id, step):  # a Ctrl-C before the id is shown still names it
            _show_started(ui, started.host, job, step, detach)
        interrupts.shown()
    except interrupts.StartInterrupted as e:  # the job started and is recorded: say which, exit as interrupted
        ui.error(e.message)
        interrupts.shown()
        raise typer.Exit(130) from None
    if detach:
        return
    _follow_and_exit(job.id, started.host, follow=True, tail=None, session=started.session)


def _show_started(ui, host: str, job, step: str, detach: bool) -> None:
    if state.json and detach:
        ui.emit_json(job.as_dict())
    elif state.json:
        ui.emit_json_line({"started": job.as_dict()})  # the first record of the followed run's JSON Lines
    else:
        where = f"Slurm job {job.extra['slurm_job_id']}, " if job.extra.get("slurm_job_id") else ""
        ui.note(f"[{host}] started job {job.id} ({step}), {where}log {job.log}")
    if detach and not state.json:
        ui.line(job.id)


def _notifier(ui):
    """Where a start's progress notes go: stdout for a person; stderr under --json, whose stdout is only JSON."""
    if state.json:
        return lambda text, style=None: ui.note(text, style=style)
    return lambda text, style=None: ui.line(text, style=style)


def _run_group(step, group, extra, *, shard_by, mode, detach, reset_gpus, no_preflight, gpu):
    ui = console_ui()
    words = {"started": "started job", "done": "job", "running": "job", "failed": "failed"}
    try:
        started = state.api.run_group(step, group, extra, shard_by=shard_by, mode=mode, reset_gpus=reset_gpus,
                                      preflight=not no_preflight, gpu=gpu,
                                      notify=_notifier(ui))
        g, outcomes = started.group_job, started.outcomes
        # recorded: a Ctrl-C before the group job's id is shown still names it
        with interrupts.naming(interrupts.StartInterrupted.for_group(g.id, g.hosts)):
            for o in outcomes:
                style = "red" if o.action == "failed" else None
                what = f"{words[o.action]} {o.job_id}" if o.action != "failed" else "failed"
                ui.note(f"[{o.host}] {what}: {o.message}", style=style)
            ui.note(f"group job {g.id}: {step} on {', '.join(g.hosts)} ({g.mode})")
            if detach:
                if state.json:
                    ui.emit_json({"id": g.id, "mode": g.mode, "hosts": g.hosts,
                                  "outcomes": [o.as_dict() for o in outcomes]})
                else:
                    ui.line(g.id)
        interrupts.shown()
    except interrupts.StartInterrupted as e:  # the group job started and is recorded: say which, exit as interrupted
        ui.error(e.message)
        interrupts.shown()
        raise typer.Exit(130) from None
    if detach:
        raise typer.Exit(started.exit_code)
    # This run's view: the jobs it started or found running (a resume does not replay finished hosts' logs).
    live = {o.host for o in outcomes if o.action in ("started", "running")}
    _follow_group_and_exit(g, follow=True, tail=None, start_code=started.exit_code, hosts=live)


def _follow_group_and_exit(g, *, follow: bool, tail: Optional[int], start_code: int = 0, hosts=None):
    g = state.api.group_job(g)
    ui = console_ui()
    printers = _Printers(ui)

    def reconnecting(host, n, wait):
        ui.note(_reconnecting_line(host, wait))

    try:
        status, errors = state.api.follow_group(g, printers, follow=follow, tail=tail, on_reconnect=reconnecting,
                                                hosts=hosts)
    except KeyboardInterrupt:
        printers.close()
        _detached_hint(g.id, f"on {', '.join(g.hosts)}")
        raise typer.Exit(EXIT_RUNNING)
    printers.close()
    for host, e in errors.items():
        ui.note(f"[{host}] {e}", style="red")
    gstate, rows = status.state, status.members
    if state.json:
        ui.emit_json_line({"id": g.id, "state": gstate, "members": [r.as_dict() for r in rows]})
    elif follow or gstate not in ("running", "pending"):
        for r in rows:
            if r.job:
                _final_line(ui, r.host, r.job)
            else:
                ui.note(f"[{r.host}] {r.state}: {r.error}", style="red")
        ui.note(f"group job {g.id} {gstate}")
    code = status.exit_code
    raise typer.Exit(code or start_code)  # what ran succeeded: a start that failed still decides


def logs(
    job_id: str = typer.Argument(..., metavar="JOB"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host of the job (remembered for jobs started here)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream until the job ends; survive connection drops."),
    tail: Optional[int] = typer.Option(None, "--tail", "-n", min=0, help="Start with the last N lines."),
):
    """Print a job's log (a group job: every host's, prefixed). Exit: 0 succeeded, 1 failed, 3 running, 4 stopped or lost."""
    if state.api.is_group_job(job_id):
        return _follow_group_and_exit(job_id, follow=follow, tail=tail)
    _follow_and_exit(job_id, host, follow=follow, tail=tail)


def status(
    job_id: Optional[str] = typer.Argument(None, metavar="[JOB]"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host or group (default: every host)."),
):
    """List jobs with id, step, host, state, runtime and exit code (a group job: one row per host)."""
    from ..errors import failure_exit as exit_for_errors
    from ..jobs import job_info

    ui = console_ui()
    if job_id is not None and state.api.is_group_job(job_id):
        st = state.api.group_status(job_id)
        g, gstate, rows = st.group_job, st.state, st.members
        if state.json:
            ui.emit_json({"id": g.id, "group": g.group, "step": g.step, "mode": g.mode, "state": gstate,
                          "members": [r.as_dict() for r in rows]})
        else:
            table = [[r.host, r.shape, r.job.id if r.job else "", r.state, _duration(r.job.runtime_s) if r.job else "",
                      "" if not r.job or r.job.exit_code is None else r.job.exit_code, r.error or ""] for r in rows]
            ui.table(f"group job {g.id}: {g.step} ({gstate})", ["host", "part", "job", "state", "runtime", "exit", "error"], table,
                     wrap=("error",))
        raise typer.Exit(st.exit_code)
    # One job, one host: an unknown job is bad input (exit 2), as for `logs` and `stop`.
    listed = state.api.status(job_id, host)
    all_jobs = listed.jobs
    if state.json:
        ui.emit_json({"jobs": [j.as_dict() for j in all_jobs], "errors": {h: str(e) for h, e in listed.errors.items()}})
    else:
        for name, error in listed.errors.items():
            ui.line(f"[{name}] {error}", style="red")
        rows = [[j.id, j.step, j.host, j.state, _duration(j.runtime_s), "" if j.exit_code is None else j.exit_code,
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.started_at)) if j.started_at else ""] for j in all_jobs]
        ui.table("jobs", ["job", "step", "host", "state", "runtime", "exit", "started"], rows, wrap=("started",))
        for j in all_jobs:  # results worth seeing without opening the log (eval's acceptance figures)
            if j.headline:
                ui.line(f"{j.id}: {j.headline}")
            if j.state == "ending":
                ui.line(f"{j.id}: {_ending_note(j)}", style="yellow")
    if job_id and all_jobs:
        raise typer.Exit(job_info.exit_code_of(all_jobs[0].state, all_jobs[0].exit_code))
    if listed.errors:
        raise typer.Exit(exit_for_errors(listed.errors.values()))


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
    """Stop a job: SIGTERM to its whole process group (Slurm: scancel --signal=TERM), SIGKILL after --grace.

    A group job: every host's job, in parallel."""
    ui = console_ui()
    if state.api.is_group_job(job_id):
        outcomes = state.api.stop_group(job_id, grace)
        if state.json:
            ui.emit_json({"id": job_id, "hosts": {o.host: (o.value.data if o.ok else {"error": str(o.error)})
                                                  for o in outcomes}})
        for o in outcomes:
            if not state.json:
                if o.ok:
                    ui.line(f"[{o.host}] {o.value.summary()}", style="green")
                else:
                    ui.line(f"[{o.host}] {o.error}", style="red")
        if not all(o.ok for o in outcomes):
            raise typer.Exit(failure_exit(outcomes))
        return
    stopped = state.api.stop(job_id, host, grace)
    if state.json:
        return ui.emit_json(stopped.data)
    ui.line(f"[{stopped.host}] {stopped.summary()}", style=None if stopped.data.get("already") else "green")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run)
    app.command()(logs)
    app.command()(status)
    app.command()(stop)
