"""pull and clean: a run's results brought here, its bulky intermediates removed there."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Optional

import typer

from ..errors import EXIT_FAILED, ConfigError
from .context import console_ui, state


def pull(
    job_id: Optional[str] = typer.Argument(None, metavar="JOB", help="A pipeline job (its outputs are recorded)."),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host of the job or the folder."),
    run_dir: Optional[str] = typer.Option(None, "--run", metavar="DIR", help="A run's output folder on the host "
                                          "(relative: under the workdir), instead of a job."),
    to: Optional[Path] = typer.Option(None, "--to", metavar="DIR", help="Local folder (default ./pulled/JOB or "
                                      "./pulled/HOST/DIRNAME)."),
):
    """Copy a run's draft export, eval report, recorded settings and versions, tensorboard events and job logs
    here: sha256-verified, files already here unchanged are skipped."""
    from ..operations import runs

    _job_or_run("pull", job_id, run_dir)
    pulled = state.api.pull(job_id, host, run_dir, to)
    h, run, dest, report = pulled.host, pulled.run, pulled.dest, pulled.report
    ui = console_ui()
    if state.json:
        return ui.emit_json({"host": h, "run": run.path, "to": str(dest), "changed": report.changed,
                             "unchanged": report.unchanged, "bytes_received": report.bytes_received,
                             "growing": report.growing, "changing": report.changing,
                             "skipped": [{"folder": f, "written_by": w} for f, w in report.skipped]})
    for path, status in report.rows():
        ui.line(f"[{h}] {status:9} {dest / path}")
    for folder, writer in report.skipped:
        ui.line(f"[{h}] skipped   {run.path}/{folder}: written by {f'job {writer}' if writer else 'no recorded job'}, "
                f"not by {job_id} (pull that job, or the folder with --run)", style="yellow")
    if report.growing:
        ui.line(f"[{h}] still being written on the host, copied as they were when listed (pull again for more): "
                f"{', '.join(report.growing)}", style="yellow")
    if report.changing:
        ui.line(f"[{h}] rewritten on the host all through the copy, left as they were here (pull again later): "
                f"{', '.join(report.changing)}", style="yellow")
    ui.line(f"[{h}] pulled {run.path} into {dest}: {len(report.changed)} copied ({runs.human(report.bytes_received)}), "
            f"{len(report.unchanged)} unchanged", style="green")
    if (dest / "tracking").is_dir():
        ui.line(f"[{h}] see the curves: tensorboard --logdir {dest / 'tracking'}")


def clean(
    job_id: Optional[str] = typer.Argument(None, metavar="JOB", help="A pipeline job (its outputs are recorded)."),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host of the job or the folder."),
    run_dir: Optional[str] = typer.Option(None, "--run", metavar="DIR", help="A run's output folder on the host "
                                          "(relative: under the workdir), instead of a job."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Say what would be removed and how big it is; remove nothing."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before removing."),
):
    """Remove a run's bulky intermediates on the host (hidden states, checkpoints), after showing their size.

    The export, reports and logs stay. Refused while a job that uses the folder runs."""
    from ..operations import runs

    _job_or_run("clean", job_id, run_dir)
    ui = console_ui()
    h = state.api.job_host(job_id, host) if job_id else state.inventory.one(host)

    def ask(result) -> bool:
        for b in result.found:
            ui.line(f"[{h.name}] {result.run.path}/{b.rel}{_where(b)}: {runs.human(b.bytes)} in {b.files} files")
        if yes:
            return True
        if not sys.stdin.isatty():
            raise ConfigError(f"clean removes {runs.human(result.bytes)} on {h.name}: confirm with --yes "
                              "(nothing was removed)")
        return typer.confirm(f"Remove {runs.human(result.bytes)} on {h.name}?", default=False)

    result = state.api.clean(job_id, h.name, run_dir, dry_run=dry_run, confirm=ask)
    run = result.run
    if state.json:
        return ui.emit_json({"host": h.name, "run": run.path, "dry_run": dry_run, "removed": result.removed,
                             "gone_before": result.gone_before, "found": [b.__dict__ for b in result.found],
                             "bytes": result.bytes, "freed": result.freed})
    if not result.found:
        ui.line(f"[{h.name}] {run.path}: no hidden states or checkpoints; nothing to remove")
    elif dry_run:
        for b in result.found:
            ui.line(f"[{h.name}] would remove {run.path}/{b.rel}{_where(b)}: {runs.human(b.bytes)} in {b.files} files")
        ui.line(f"[{h.name}] --dry-run: {runs.human(result.bytes)} would be freed; nothing was removed")
    elif result.removed or result.gone_before:
        if result.removed:
            ui.line(f"[{h.name}] removed {', '.join(result.removed)} from {run.path}: {runs.human(result.freed)} freed",
                    style="green")
        if result.gone_before:
            ui.line(f"[{h.name}] {', '.join(result.gone_before)}: already removed (by another clean)")
    else:
        ui.line(f"[{h.name}] nothing was removed")
        raise typer.Exit(EXIT_FAILED)


def _where(b) -> str:
    """Where a link leads: the folder whose space clean frees (a link itself stays, to an empty folder)."""
    return f" (at {b.at})" if b.at else ""


def _job_or_run(command: str, job_id: Optional[str], run_dir: Optional[str]) -> None:
    """The run is named by a JOB or by --run DIR: said before a host is chosen or reached."""
    if bool(job_id) == bool(run_dir):
        what = "a JOB or --run DIR, not both" if job_id else "which run: a JOB, or its output folder with --run DIR"
        raise ConfigError(f"kimi-eagle {command}: name {what} (see: kimi-eagle {command} --help)")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    app.command()(pull)
    app.command()(clean)
