"""gpu-reset: stop GPU holders on hosts (only ours unless --all) and verify the memory is free."""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from ..errors import EXIT_FAILED, EXIT_USAGE, ConfigError
from ..hosts.parallel import failure_exit
from .context import console_ui, state


def gpu_reset(
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host (or group) from the inventory."),
    group: Optional[str] = typer.Option(None, "--group", "-g", help="Group from the inventory."),
    all_: bool = typer.Option(False, "--all", help="Stop every holder, other users' too (asks first)."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask before --all."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Show the plan; stop nothing."),
    grace: float = typer.Option(10.0, "--grace", min=0, help="Seconds between SIGTERM and SIGKILL."),
    timeout: float = typer.Option(60.0, "--timeout", min=0, help="Seconds to wait for processes to go and memory to free."),
    require_gpu: bool = typer.Option(False, "--require-gpu", help="Fail on a host without an NVIDIA driver."),
    device_path: List[str] = typer.Option([], "--device-path", help="Device files/globs to inspect (default /dev/nvidia*)."),
):
    """Find every process holding a GPU (fuser + nvidia-smi), stop ours (or --all), verify memory is back."""
    kw = dict(grace=grace, timeout=timeout, require_gpu=require_gpu, device_paths=device_path)
    ui = console_ui()
    if all_ and not dry_run and not yes:
        plans = state.api.gpu_reset(host, group, stop_all=True, dry_run=True, **kw)
        _print(plans, ui)
        if not sys.stdin.isatty():
            raise ConfigError("gpu-reset --all stops other users' processes: confirm with --yes (nothing was stopped)")
        if not typer.confirm("Stop every process listed above?", default=False):
            raise typer.Exit(EXIT_FAILED)
        # Signal only what the user saw and confirmed, never a process that appeared since, nor one that got the
        # number of a confirmed process which has exited (the host checks each pid's start time).
        confirmed = {o.host: [(h["pid"], h.get("start_ticks")) for h in o.value.holders] for o in plans if o.ok}
        outcomes = state.api.gpu_reset(host, group, stop_all=True, only_pids=confirmed, **kw)
    else:
        outcomes = state.api.gpu_reset(host, group, stop_all=all_, dry_run=dry_run, **kw)
    _print(outcomes, ui)
    if not all(o.ok and o.value.ok for o in outcomes):
        failed = [o.error for o in outcomes if not o.ok]
        # Every failing host refused the input (a --device-path that is no GPU node there): bad input, exit 2.
        refused = failed and all(isinstance(e, ConfigError) for e in failed)
        raise typer.Exit(EXIT_USAGE if refused else failure_exit(outcomes))


def _print(outcomes, ui) -> None:
    if state.json:
        ui.emit_json([{"host": o.host, "ok": bool(o.ok and o.value.ok), "error": str(o.error) if o.error else None,
                       **(o.value.data if o.value else {})} for o in outcomes])
        return
    for o in outcomes:
        if not o.ok:
            ui.line(f"[{o.host}] failed: {o.error}", style="red")
            continue
        d = o.value.data
        if d.get("note"):
            ui.line(f"[{o.host}] {d['note']}", style="yellow")
        if d.get("holders"):
            rows = [[h.get("pid"), h.get("user"), h.get("owner"), (h.get("cmd") or "")[:50], h.get("gpu", ""),
                     h.get("mem_mib", ""), h.get("action") if h.get("action") != "none" else f"(would {h.get('planned', 'keep')})",
                     h.get("result", "")] for h in d["holders"]]
            ui.table(f"[{o.host}] GPU holders ({d.get('mode', '')})",
                     ["pid", "user", "owner", "command", "gpu", "MiB", "action", "result"], rows,
                     wrap=("command", "action", "result"))
        elif not d.get("note"):
            ui.line(f"[{o.host}] no process holds a GPU")
        for g in d.get("gpus", []):
            if g.get("mem_total") is None:  # [N/A] from nvidia-smi: a unified-memory GPU (GB10, Grace Hopper)
                ui.line(f"[{o.host}] GPU {g.get('index')}: memory unknown")
                continue
            ui.line(f"[{o.host}] GPU {g.get('index')}: {g.get('mem_used_before')} -> {g.get('mem_used_after')} MiB used "
                    f"of {g.get('mem_total')}")
        for w in d.get("warnings", []):
            ui.line(f"[{o.host}] {w}", style="yellow")
        for p in d.get("problems", []):
            ui.line(f"[{o.host}] still held: {p}", style="red")
        if d.get("elapsed_s") is not None and d.get("mode") != "dry-run" and d.get("holders"):
            ui.line(f"[{o.host}] {o.value.verdict()}",
                    style="green" if o.value.ok and not o.value.still_held else "yellow" if o.value.ok else "red")


def register(app: typer.Typer) -> None:
    """Add this module's commands to the top-level app."""
    app.command("gpu-reset")(gpu_reset)
