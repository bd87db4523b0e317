"""preflight: check a host for every known failure before the model load."""

from __future__ import annotations

from typing import Optional

import typer

from ..hosts.parallel import failure_exit
from .context import RECIPE_HELP, console_ui, split_extra, state

ICON = {"pass": "PASS", "warn": "WARN", "fail": "FAIL"}
STYLE = {"pass": "green", "warn": "yellow", "fail": "red"}


def preflight(
    ctx: typer.Context,
    step: str = typer.Argument("all", help="regenerate | prepare | extract | vocab | train | choose | eval | all"),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host (or group) from the inventory."),
    group: Optional[str] = typer.Option(None, "--group", "-g", help="Group from the inventory."),
    recipe: Optional[str] = typer.Option(None, "--recipe", "-c", metavar="FILE", help=RECIPE_HELP),
):
    """Check versions, patch, model config, layer ids, GPU memory, disk, dataset and the GPU lock, in seconds.

    `run` does this automatically (skip with --no-preflight). `KEY=VALUE` arguments override the recipe, as for
    `run`. Flags after `--` go to the check script.
    """
    overrides, extra = split_extra(ctx)
    if "=" in step:  # `preflight epochs=3`: an override, the step defaults to all
        overrides, step = [step, *overrides], "all"
    state.use_recipe(recipe, overrides)
    outcomes = state.api.preflight(step, host, group, extra)
    ui = console_ui()
    if state.json:
        ui.emit_json([{"host": o.host, "ok": bool(o.ok and o.value.ok), "error": str(o.error) if o.error else None,
                       "checks": o.value.checks if o.value else []} for o in outcomes])
    else:
        for o in outcomes:
            if not o.ok:
                ui.line(f"[{o.host}] failed: {o.error}", style="red")
                continue
            for c in o.value.checks:
                ui.line(f"[{o.host}] {ICON[c['status']]}  {c['name']}: {c['detail']}", style=STYLE[c["status"]])
                for line in (c.get("plan") or {}).get("lines", []):  # the storage plan's figures, under its verdict
                    ui.line(f"[{o.host}]       {line}")
                if c["status"] != "pass" and c.get("fix"):
                    ui.line(f"[{o.host}]       fix: {c['fix']}")
            ui.line(f"[{o.host}] preflight {'passed' if o.value.ok else 'FAILED'}", style="green" if o.value.ok else "red")
    if not all(o.ok and o.value.ok for o in outcomes):
        raise typer.Exit(failure_exit(outcomes))


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})(preflight)
