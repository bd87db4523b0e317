"""`kimi-eagle render` and `upload`: files to look at, files to send."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..hosts.parallel import failure_exit
from .context import RECIPE_HELP, console_ui, split_extra, state

def render(
    ctx: typer.Context,
    what: str = typer.Argument(..., metavar="WHAT", help="probe | patch | gpu-reset | preflight | job STEP (e.g. 'job extract')."),
    step: Optional[str] = typer.Argument(None, help="The step, for WHAT=job: regenerate|prepare|extract|vocab|train|choose|eval|all|exec."),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host from the inventory."),
    out: Path = typer.Option(..., "--out", "-o", help="Local folder to write the rendered files into."),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-c", metavar="FILE", help=RECIPE_HELP),
):
    """Write exactly what would be uploaded and run, without touching the network.

    `KEY=VALUE` arguments override the recipe, as for `run`: `render job train --out r -c r.yaml epochs=3`.
    Flags after `--` are rendered as the real command passes them: `render job exec -- CMD ARGS`,
    `render job extract -- --validate`.
    """
    overrides, extra = split_extra(ctx, step_takes_command=step == "exec")
    if step and "=" in step and not step.startswith("-"):  # `render probe k=v`: an override, not a step
        overrides, step = [step, *overrides], None
    state.use_recipe(recipe, overrides)
    written = state.api.render(what, step, host, extra, out=out).written
    if state.json:
        return console_ui().emit_json([str(p) for p in written])
    for p in written:
        console_ui().line(str(p))


# ---------------------------------------------------------------------------------------------- upload
def upload(
    paths: List[Path] = typer.Argument(..., exists=True, dir_okay=True, help="Local files or folders."),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host (or group) from the inventory."),
    group: Optional[str] = typer.Option(None, "--group", "-g", help="Group from the inventory."),
    to: str = typer.Option(..., "--to", help="Folder on the host; relative paths are under the host's workdir."),
):
    """Copy files to hosts atomically, sha256-verified; files already there unchanged are skipped."""
    outcomes = state.api.upload(paths, to, host, group)
    if state.json:
        console_ui().emit_json([{"host": o.host, "ok": o.ok, "error": str(o.error) if o.error else None,
                          **({"root": o.value.root, "changed": o.value.changed, "unchanged": o.value.unchanged,
                              "bytes_sent": o.value.bytes_sent} if o.value else {})} for o in outcomes])
    else:
        for o in outcomes:
            if not o.ok:
                console_ui().line(f"[{o.host}] failed: {o.error}", style="red")
                continue
            for path, status in o.value.rows():
                console_ui().line(f"[{o.host}] {status:9} {o.value.root}/{path}")
    if not all(o.ok for o in outcomes):
        raise typer.Exit(failure_exit(outcomes))


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(render)
    app.command()(upload)
