"""`kimi-eagle deploy-patch`: patch speculators on the hosts (and `render patch`)."""

from __future__ import annotations

from typing import Optional

import typer

from ..errors import EXIT_OK, EXIT_USAGE, ConfigError
from ..hosts.parallel import failure_exit
from .context import console_ui, state


def deploy_patch(
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host (or group) from the inventory."),
    group: Optional[str] = typer.Option(None, "--group", "-g", help="Group from the inventory."),
    patch_set: str = typer.Option("auto", "--patch-set", "-p", metavar="NAME",
                                  help="Patch set name (or file stem); 'auto' picks the set matching the installed version."),
    check: bool = typer.Option(False, "--check", help="Report what an apply would do; change nothing."),
    diff: bool = typer.Option(False, "--diff", help="Like --check, plus the unified diff per file."),
    revert: bool = typer.Option(False, "--revert", help="Put the pristine (original) files back."),
):
    """Patch the installed speculators on each host so hidden-state extraction runs on Kimi-K2.5 (idempotent).

    Exit 0 when every file ends in the wanted state (for --check/--diff: nothing failed) or the host needs no
    patch (vLLM >= 0.18 extracts natively: "skipped, nothing to patch"); 1 otherwise
    (a failed or skipped file, an unsupported version, an unreachable host); 2 for bad usage or an unknown set.
    """
    from ..operations import deploy_patch

    if revert and (check or diff):
        raise ConfigError("--revert cannot be combined with --check/--diff")
    mode = "revert" if revert else "diff" if diff else "check" if check else "apply"
    outcomes = state.api.deploy_patch(host, group, patch_set, mode)

    if state.json:
        console_ui().emit_json([
            {"host": o.host, "error": str(o.error) if o.error else None,
             **(o.value.to_dict() if o.value is not None else {"mode": mode, "files": []}),
             "ok": deploy_patch.succeeded(o)}
            for o in outcomes
        ])
    else:
        for o in outcomes:
            _show(o, mode, deploy_patch.succeeded(o))

    usage = [o for o in outcomes if isinstance(o.error, ConfigError)]
    if usage:
        for o in usage:  # the host refused its input (e.g. a malformed patch-set file): one line each
            console_ui().error(str(o.error))
        raise typer.Exit(EXIT_USAGE)
    raise typer.Exit(EXIT_OK if all(deploy_patch.succeeded(o) for o in outcomes) else failure_exit(outcomes))


_VERDICT = {"apply": "patched", "revert": "reverted", "check": "check passed", "diff": "check passed"}
_FAILED = {"apply": "NOT patched", "revert": "NOT reverted", "check": "check failed", "diff": "check failed"}
_STYLE = {"changed": "green", "reverted": "green", "ok": "green", "would-change": "yellow",
          "skipped": "red", "failed": "red"}


def _show(o, mode: str, good: bool) -> None:
    ui = console_ui()
    if isinstance(o.error, ConfigError):
        return  # reported on stderr with exit 2
    if o.error is not None:
        ui.line(f"[{o.host}] failed: {o.error}", style="red")
        return
    r = o.value
    what = f"{r.package} {r.version}" if r.package else "no package"
    title = f"{o.host}: {what}, patch set {r.patch_set or '(none)'}, {mode}"
    if r.files:
        from rich.table import Table
        from rich.text import Text

        t = Table(title=Text(title), title_justify="left")
        t.add_column("file", overflow="fold")
        t.add_column("status", no_wrap=True)
        t.add_column("reason", overflow="fold")
        for f in r.files:
            t.add_row(Text(f.path), Text(f.status, style=_STYLE.get(f.status, "")), Text(f.reason))
        ui.console().print(t)
    else:
        ui.line(title)
    if mode == "diff":
        for f in r.files:
            if f.diff:
                _show_diff(f.diff)
            elif f.status == "ok":
                ui.line(f"[{o.host}] {f.path}: no diff (already patched)")
    counts = ", ".join(f"{n} {s}" for s, n in sorted(r.counts().items()))
    if good and r.not_needed:
        ui.line(f"[{o.host}] skipped, {r.not_needed}", style="green")
    elif good:
        ui.line(f"[{o.host}] {_VERDICT[mode]} ({counts})", style="green")
    else:
        why = r.why_not()
        ui.line(f"[{o.host}] {_FAILED[mode]}" + (f": {why}" if why else "") + (f" ({counts})" if counts else ""), style="red")


def _show_diff(text: str) -> None:
    ui = console_ui()
    con = ui.console()
    if con.is_terminal and not con.no_color:
        from rich.syntax import Syntax

        con.print(Syntax(text.rstrip("\n"), "diff", word_wrap=True, background_color="default"))
    else:
        ui.line(text.rstrip("\n"))


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    app.command("deploy-patch")(deploy_patch)
