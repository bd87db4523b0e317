"""run, logs, status, stop: detached jobs on a host, on a Slurm cluster, or over the hosts of a group."""

from __future__ import annotations

import time
from typing import Optional

import typer

from ..errors import EXIT_FAILED, EXIT_RUNNING, ConfigError
from ..parallel import failure_exit
from .context import RECIPE_HELP, console_ui, split_extra, state


def _host_for_job(job_id: str, host: Optional[str]):
    from .. import jobs

    jobs.check_job_id(job_id)
    if host:
        return state.inventory.one(host)
    remembered = jobs.host_of(job_id)
    if remembered and remembered in state.inventory.hosts:
        return state.inventory.hosts[remembered]
    if len(state.inventory.hosts) == 1:
        return next(iter(state.inventory.hosts.values()))
    raise ConfigError(f"job {job_id}: not started from this machine; name its host with --host")


class _Printers:
    """One log printer per label (host, or host:task for Slurm array tasks), closed together."""

    def __init__(self, ui):
        from .. import logview

        self.ui, self.logview, self.printers = ui, logview, {}

    def __call__(self, label: str):
        if label not in self.printers:
            self.printers[label] = self.logview.Printer(label, self.ui.console(), as_json=state.json)
        return self.printers[label]

    def close(self):
        for p in self.printers.values():
            p.close()


def _follow_and_exit(host, job_id: str, *, follow: bool, tail: Optional[int], session=None):
    from .. import backend, jobs

    ui = console_ui()
    printers = _Printers(ui)

    def reconnecting(n, wait):
        ui.err_console().print(f"[{host.name}] connection lost; reconnecting in {wait:.1f}s (attempt {n})", markup=False)

    try:
        result = backend.for_host(host).follow(host, job_id, lambda t: printers(f"{host.name}:{t}" if t else host.name),
                                               follow=follow, tail=tail, session=session, on_reconnect=reconnecting)
    except KeyboardInterrupt:
        printers.close()
        _detached_hint(job_id, f"on {host.name}", f" --host {host.name}")
        raise typer.Exit(EXIT_RUNNING)
    printers.close()
    job = result.job
    if state.json:
        ui.emit_json({"job": job.as_dict(), "reconnects": result.reconnects})
    elif follow or job.state not in ("running", "pending"):
        _final_line(ui, host.name, job)
        if follow and job.state == "succeeded":
            _show_result(host, job, session)
    raise typer.Exit(jobs.STATE_EXIT[job.state])


def _show_result(host, job, session) -> None:
    """The last word of a finished pipeline: where the result is, what it holds, what to run next."""
    from .. import results
    from ..host import HostSession

    s = session or HostSession(host)  # a closed session reconnects on use
    try:
        export = results.describe_export(s, job.step or "", job.id)
    finally:
        s.close()
    if export is None:
        return
    ui = console_ui()
    ui.line(f"[{host.name}] draft exported to {export.path}", style="green")
    ui.line(f"[{host.name}]   {export.what()}")
    ui.line(f"[{host.name}] next, serve the target with it (vLLM): {export.next_command()}")


def _detached_hint(job_id: str, where: str, host_opt: str = ""):
    console_ui().err_console().print(
        f"\ndetached; job {job_id} keeps running {where}.\n"
        f"  reattach: kimi-eagle logs {job_id} --follow{host_opt}\n"
        f"  stop:     kimi-eagle stop {job_id}{host_opt}",
        markup=False,
    )


def _final_line(ui, label: str, job):
    style = "green" if job.state == "succeeded" else "yellow" if job.state in ("running", "pending") else "red"
    code = "" if job.exit_code is None else f" (exit code {job.exit_code})"
    ui.err_console().print(f"[{label}] job {job.id} {job.state}{code}", style=style, markup=False)
    if job.headline and job.state not in ("running", "pending"):
        ui.line(f"[{label}] {job.headline}")  # a step's one-line result (eval's acceptance figures)


def run(
    ctx: typer.Context,
    step: str = typer.Argument(..., help="regenerate | prepare | extract | vocab | train | eval | all | exec (any command after --)"),
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
    gpu: Optional[bool] = typer.Option(None, "--gpu/--no-gpu", help="Take the host's GPU lock (default: regenerate, extract, train, eval, all)."),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-c", metavar="FILE", help=RECIPE_HELP),
):
    """Start a pipeline step (or `all`) as a detached job on the host; follow its log unless --detach.

    `KEY=VALUE` arguments override the recipe (or the inventory's pipeline): `kimi-eagle run all -c r.yaml epochs=3`.
    Flags after `--` go to the step's script, e.g. `kimi-eagle run extract -- --validate`;
    `kimi-eagle run exec -- CMD ARGS` runs any command with the same log, stop and exit-code guarantees.
    A Slurm host (`scheduler: slurm`) submits the job with sbatch instead; `--group G` runs over several hosts.
    """
    from .. import backend
    from ..host import HostSession
    from ..render_targets import Offline

    overrides, extra = split_extra(ctx, step_takes_command=step == "exec")
    state.use_recipe(recipe, overrides)
    if group:
        if host:
            raise ConfigError("give --host or --group, not both")
        return _run_group(step, group, extra, shard_by=shard_by, mode=mode, detach=detach, reset_gpus=reset_gpus,
                          no_preflight=no_preflight, gpu=gpu)
    h = state.inventory.one(host)
    be = backend.for_host(h)
    be.render(HostSession(h, transport=Offline(h)), step, extra)  # validate before connecting
    ui = console_ui()
    session = HostSession(h)
    try:
        _checks(session, step, reset_gpus=reset_gpus, no_preflight=no_preflight, gpu=gpu)
        job = be.start(session, step, extra, gpu=gpu)
    except BaseException:
        session.close()
        raise
    if state.json and detach:
        ui.emit_json(job.as_dict())
    else:
        where = f"Slurm job {job.extra['slurm_job_id']}, " if job.extra.get("slurm_job_id") else ""
        ui.err_console().print(f"[{h.name}] started job {job.id} ({step}), {where}log {job.log}", markup=False)
    if detach:
        session.close()
        if not state.json:
            ui.line(job.id)
        return
    _follow_and_exit(h, job.id, follow=True, tail=None, session=session)


def _checks(session, step: str, *, reset_gpus: bool, no_preflight: bool, gpu: bool | None = None):
    """Before a job starts on a host: our stale GPU holders (--reset-gpus), the scheduler, the step's preflight."""
    from .. import backend
    from ..slurm import SlurmPreflightError

    ui = console_ui()
    name = session.name
    be = backend.for_host(session.host)
    if reset_gpus and be.name == "direct":
        from .. import gpu_reset, jobs

        gpu_reset.reset_before_run(session, printer=lambda text: ui.line(f"[{name}] {text}"),
                                 wants_gpu=jobs.takes_gpu(step, gpu))
    if no_preflight:
        return
    problems = be.preflight(session, step)
    if problems:
        raise SlurmPreflightError("; ".join(problems))
    if step != "exec" and be.name == "direct":  # on Slurm the step runs on compute nodes, not on the login node
        from .. import preflight

        preflight.gate(session, step, printer=lambda text, style=None: ui.line(f"[{name}] {text}", style=style))


def _run_group(step, group, extra, *, shard_by, mode, detach, reset_gpus, no_preflight, gpu):
    from .. import groupjobs

    ui = console_ui()
    g, outcomes = groupjobs.start(state.inventory, group, step, extra, mode=mode, shard_by=shard_by, gpu=gpu,
                                  host_check=lambda s: _checks(s, step, reset_gpus=reset_gpus, no_preflight=no_preflight, gpu=gpu))
    err = ui.err_console()
    words = {"started": "started job", "done": "job", "running": "job", "failed": "failed"}
    for o in outcomes:
        style = "red" if o.action == "failed" else None
        what = f"{words[o.action]} {o.job_id}" if o.action != "failed" else "failed"
        err.print(f"[{o.host}] {what}: {o.message}", style=style, markup=False)
    failed = any(o.action == "failed" for o in outcomes)
    err.print(f"group job {g.id}: {step} on {', '.join(g.hosts)} ({g.mode})", markup=False)
    if detach:
        if state.json:
            ui.emit_json({"id": g.id, "mode": g.mode, "hosts": g.hosts,
                          "outcomes": [o.__dict__ for o in outcomes]})
        else:
            ui.line(g.id)
        raise typer.Exit(EXIT_FAILED if failed else 0)
    # This run's view: the jobs it started or found running (a resume does not replay finished hosts' logs).
    live = {o.host for o in outcomes if o.action in ("started", "running")}
    _follow_group_and_exit(g, follow=True, tail=None, start_failed=failed, hosts=live)


def _follow_group_and_exit(g, *, follow: bool, tail: Optional[int], start_failed: bool = False, hosts=None):
    from .. import groupjobs

    ui = console_ui()
    printers = _Printers(ui)

    def reconnecting(host, n, wait):
        ui.err_console().print(f"[{host}] connection lost; reconnecting in {wait:.1f}s (attempt {n})", markup=False)

    try:
        results = groupjobs.follow(state.inventory, g, printers, follow=follow, tail=tail, on_reconnect=reconnecting,
                                   hosts=hosts)
    except KeyboardInterrupt:
        printers.close()
        _detached_hint(g.id, f"on {', '.join(g.hosts)}")
        raise typer.Exit(EXIT_RUNNING)
    printers.close()
    for host, r in results.items():
        if isinstance(r, Exception):
            ui.err_console().print(f"[{host}] {r}", style="red", markup=False)
    gstate, rows = groupjobs.status(state.inventory, g)
    if state.json:
        ui.emit_json({"id": g.id, "state": gstate, "members": [r.as_dict() for r in rows]})
    elif follow or gstate not in ("running", "pending"):
        for r in rows:
            if r.job:
                _final_line(ui, r.host, r.job)
            else:
                ui.err_console().print(f"[{r.host}] {r.state}: {r.error}", style="red", markup=False)
        ui.err_console().print(f"group job {g.id} {gstate}", markup=False)
    code = groupjobs.exit_code(gstate)
    raise typer.Exit(code if not (start_failed and code == 0) else EXIT_FAILED)


def logs(
    job_id: str = typer.Argument(..., metavar="JOB"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host of the job (remembered for jobs started here)."),
    follow: bool = typer.Option(False, "--follow", "-f", help="Stream until the job ends; survive connection drops."),
    tail: Optional[int] = typer.Option(None, "--tail", "-n", min=0, help="Start with the last N lines."),
):
    """Print a job's log (a group job: every host's, prefixed). Exit: 0 succeeded, 1 failed, 3 running, 4 stopped or lost."""
    from .. import groupjobs

    if groupjobs.is_group_job(job_id):
        return _follow_group_and_exit(groupjobs.GroupJob.load(job_id), follow=follow, tail=tail)
    _follow_and_exit(_host_for_job(job_id, host), job_id, follow=follow, tail=tail)


def status(
    job_id: Optional[str] = typer.Argument(None, metavar="[JOB]"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host or group (default: every host)."),
):
    """List jobs with id, step, host, state, runtime and exit code (a group job: one row per host)."""
    from .. import backend, groupjobs, jobs
    from ..parallel import each_host

    ui = console_ui()
    if job_id is not None and groupjobs.is_group_job(job_id):
        g = groupjobs.GroupJob.load(job_id)
        gstate, rows = groupjobs.status(state.inventory, g)
        if state.json:
            ui.emit_json({"id": g.id, "group": g.group, "step": g.step, "mode": g.mode, "state": gstate,
                          "members": [r.as_dict() for r in rows]})
        else:
            table = [[r.host, r.shape, r.job.id if r.job else "", r.state, _duration(r.job.runtime_s) if r.job else "",
                      "" if not r.job or r.job.exit_code is None else r.job.exit_code, r.error or ""] for r in rows]
            ui.table(f"group job {g.id}: {g.step} ({gstate})", ["host", "part", "job", "state", "runtime", "exit", "error"], table)
        raise typer.Exit(groupjobs.exit_code(gstate))
    if job_id is not None:
        # One job, one host: an unknown job is bad input (exit 2), as for `logs` and `stop`.
        from ..host import HostSession
        from ..parallel import HostOutcome

        h = _host_for_job(job_id, host)
        with HostSession(h) as session:
            outcomes = [HostOutcome(h.name, backend.for_host(h).status(session, job_id))]
    else:
        outcomes = each_host(state.inventory.select(host), lambda s: backend.for_host(s.host).status(s, job_id))
    all_jobs = [j for o in outcomes if o.ok for j in o.value]
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
        for j in all_jobs:  # results worth seeing without opening the log (eval's acceptance figures)
            if j.headline:
                ui.line(f"{j.id}: {j.headline}")
    if job_id and all_jobs:
        raise typer.Exit(jobs.STATE_EXIT[all_jobs[0].state])
    if not all(o.ok for o in outcomes):
        raise typer.Exit(failure_exit(outcomes))


def _duration(seconds) -> str:
    if seconds is None:
        return ""
    s = int(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m{s % 60:02d}s" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def _stop_summary(job_id: str, data: dict) -> str:
    if data.get("already"):
        return f"job {job_id} is not running ({data['already']}); nothing to stop"
    sent = data["sent"]
    if "slurm_job_id" in data:  # Slurm: scancel --signal=TERM first, a hard scancel only when needed
        return (f"job {job_id} (Slurm {data['slurm_job_id']}) stopped: scancel --signal=TERM, then "
                f"{'scancel' if sent['KILL'] else 'no hard cancel needed'} ({data['elapsed_s']}s)")
    return (f"job {job_id} stopped: {len(data['signalled'])} processes, SIGTERM then "
            f"{'SIGKILL to ' + str(sent['KILL']) if sent['KILL'] else 'no SIGKILL needed'}; nothing left "
            f"({data['elapsed_s']}s)")


def stop(
    job_id: str = typer.Argument(..., metavar="JOB"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host of the job (remembered for jobs started here)."),
    grace: float = typer.Option(10.0, "--grace", min=0, help="Seconds between SIGTERM and SIGKILL."),
):
    """Stop a job: SIGTERM to its whole process group (Slurm: scancel --signal=TERM), SIGKILL after --grace.

    A group job: every host's job, in parallel."""
    from .. import backend, groupjobs
    from ..host import HostSession

    ui = console_ui()
    if groupjobs.is_group_job(job_id):
        g = groupjobs.GroupJob.load(job_id)
        outcomes = groupjobs.stop(state.inventory, g, grace)
        members = {m.host: m.job_id for m in g.members}
        if state.json:
            ui.emit_json({"id": g.id, "hosts": {o.host: (o.value if o.ok else {"error": str(o.error)}) for o in outcomes}})
        for o in outcomes:
            if not state.json:
                if o.ok:
                    ui.line(f"[{o.host}] {_stop_summary(members[o.host], o.value)}", style="green")
                else:
                    ui.line(f"[{o.host}] {o.error}", style="red")
        if not all(o.ok for o in outcomes):
            raise typer.Exit(failure_exit(outcomes))
        return
    h = _host_for_job(job_id, host)
    with HostSession(h) as session:
        data = backend.for_host(h).stop(session, job_id, grace)
    if state.json:
        return ui.emit_json(data)
    ui.line(f"[{h.name}] {_stop_summary(job_id, data)}", style=None if data.get("already") else "green")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(run)
    app.command()(logs)
    app.command()(status)
    app.command()(stop)
