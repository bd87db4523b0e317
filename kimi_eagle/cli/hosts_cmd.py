"""`kimi-eagle hosts`: list, check and trust the inventory's hosts."""

from __future__ import annotations

import sys
from typing import Optional

import typer

from ..errors import EXIT_FAILED, ConfigError, HostUnreachable
from ..hosts.parallel import failure_exit
from .context import console_ui, state

app = typer.Typer(help="List, check and trust hosts.", invoke_without_command=True, no_args_is_help=False)

@app.callback()
def hosts_list(ctx: typer.Context):
    """List the hosts of the inventory (or run a subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    from dataclasses import asdict

    rows = [asdict(r) for r in state.api.hosts()]
    if state.json:
        return console_ui().emit_json({"inventory": state.inventory.path, "hosts": rows})
    console_ui().table(
        f"hosts in {state.inventory.path}", ["host", "transport", "address", "user", "workdir", "python", "groups"],
        [[r["name"], r["transport"], r["address"] + (f":{r['port']}" if r["port"] else ""), r["user"] or "",
          r["workdir"], r["python"], ", ".join(r["groups"])] for r in rows],
        wrap=("groups",),
    )


@app.command("check")
def hosts_check(target: Optional[str] = typer.Argument(None, metavar="[HOST|GROUP]", help="Default: every host.")):
    """Connect to each host in parallel and report Python, torch/CUDA, transformers, vllm, speculators, GPUs."""
    outcomes = state.api.check(target)
    if state.json:
        console_ui().emit_json([{"host": o.host, "ok": o.ok, "error": str(o.error) if o.error else None, **(o.value or {})} for o in outcomes])
    else:
        ui = console_ui()
        for o in outcomes:
            if not o.ok:
                # "unreachable" only when no connection was made; a refused key or a failed probe is "failed".
                ui.line(f"[{o.host}] {'unreachable' if isinstance(o.error, HostUnreachable) else 'failed'}: {o.error}",
                        style="red")
                continue
            d = o.value
            pk = d["packages"]
            show = lambda name: pk.get(name) or "missing"  # noqa: E731
            ui.line(f"[{o.host}] reachable  python {d['python']} ({d['executable']})", style="green")
            torch = show("torch") + (f" (CUDA {d['torch_cuda']})" if d.get("torch_cuda") else "")
            ui.line(f"[{o.host}] torch {torch}  transformers {show('transformers')}  vllm {show('vllm')}  speculators {show('speculators')}")
            if d.get("gpus"):
                for g in d["gpus"]:
                    # None where nvidia-smi says [N/A] (unified-memory GPUs)
                    used, total = g.get("memory_used_mib"), g.get("memory_total_mib")
                    memory = "memory unknown" if total is None else f"{'?' if used is None else used}/{total} MiB used"
                    ui.line(f"[{o.host}] GPU {g['index']}: {g['name']}  {memory}")
            else:
                ui.line(f"[{o.host}] GPUs: none ({d.get('gpu_note') or 'no GPU'})", style="yellow")
    if not all(o.ok for o in outcomes):
        raise typer.Exit(failure_exit(outcomes))


@app.command("trust")
def hosts_trust(
    host: str = typer.Argument(..., help="Host name from the inventory."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Record the key without asking."),
    fingerprint: Optional[str] = typer.Option(None, "--fingerprint", metavar="SHA256:…",
                                              help="Record only if the key has this SHA256 fingerprint."),
    replace: Optional[str] = typer.Option(
        None, "--replace", metavar="SHA256:…",
        help="The host's key changed and you verified the new one: remove the recorded key with this fingerprint "
             "(needs --fingerprint naming the new key)."),
):
    """Show a host's key fingerprint and record it in the known_hosts file (the inventory's, else ~/.ssh/known_hosts).

    A changed key is refused; replace it only with --replace OLD --fingerprint NEW.
    """
    if replace and not fingerprint:
        raise ConfigError(f"{state.inventory.one(host).name}: --replace {replace} needs --fingerprint naming the new key")
    offered = state.api.offered_key(host)
    ui = console_ui()
    ui.line(f"{offered.host} ({offered.hostname}:{offered.port}) offers {offered.key_type} {offered.fingerprint}")
    if not (yes or fingerprint):
        if not sys.stdin.isatty():
            raise ConfigError(f"{offered.host}: not a terminal; confirm with --yes or --fingerprint {offered.fingerprint}")
        if not typer.confirm("Trust this key?", default=False):
            raise typer.Exit(EXIT_FAILED)
    done = state.api.trust(offered, fingerprint=fingerprint, replace=replace)
    for old in done.removed:
        ui.line(f"removed the old key {old.key_type} {old.fingerprint} from {old.path}", style="yellow")
    ui.line(f"recorded in {done.path}" if done.added else f"already recorded in {done.path}; nothing added", style="green")
