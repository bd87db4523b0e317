"""The `kimi-eagle` command line: parses, calls the library, prints. No work happens here."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import List, Optional

import typer

from .errors import EXIT_FAILED, EXIT_USAGE, ConfigError, KimiEagleError

app = typer.Typer(
    name="kimi-eagle",
    help="Train EAGLE-3 draft heads on remote GPU hosts over SSH: patch, run, follow, reset.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
hosts_app = typer.Typer(help="List, check and trust hosts.", invoke_without_command=True, no_args_is_help=False)
app.add_typer(hosts_app, name="hosts")


class State:
    inventory_path: Optional[str] = None
    json: bool = False
    verbose: int = 0
    _inventory = None

    @property
    def inventory(self):
        if self._inventory is None:
            from . import inventory

            self._inventory = inventory.load(self.inventory_path)
        return self._inventory


state = State()


@app.callback()
def _global(
    inventory: Optional[str] = typer.Option(
        None, "--inventory", "-i", envvar="KIMI_EAGLE_INVENTORY", metavar="PATH",
        help="Inventory file (default ./inventory.yaml, else the embedded local default).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output on stdout."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More detail (repeat for more)."),
):
    state.inventory_path = inventory
    state.json = json_out
    state.verbose = verbose


def _ui():
    from . import ui

    return ui


# ---------------------------------------------------------------------------------------------- hosts
@hosts_app.callback()
def hosts_list(ctx: typer.Context):
    """List the hosts of the inventory (or run a subcommand)."""
    if ctx.invoked_subcommand is not None:
        return
    inv = state.inventory
    groups = {m: [g for g, ms in inv.data.groups.items() if m in ms] for m in inv.hosts}
    rows = [
        dict(name=h.name, transport=h.transport, address=h.address if h.transport == "ssh" else "(this machine)",
             port=h.port, user=h.user, workdir=h.workdir, python=h.python, groups=groups[h.name])
        for h in inv.hosts.values()
    ]
    if state.json:
        return _ui().emit_json({"inventory": inv.path, "hosts": rows})
    _ui().table(
        f"hosts in {inv.path}", ["host", "transport", "address", "user", "workdir", "python", "groups"],
        [[r["name"], r["transport"], r["address"] + (f":{r['port']}" if r["port"] else ""), r["user"] or "",
          r["workdir"], r["python"], ", ".join(r["groups"])] for r in rows],
    )


@hosts_app.command("check")
def hosts_check(target: Optional[str] = typer.Argument(None, metavar="[HOST|GROUP]", help="Default: every host.")):
    """Connect to each host in parallel and report Python, torch/CUDA, transformers, vllm, speculators, GPUs."""
    from . import hosts

    outcomes = hosts.check(state.inventory.select(target))
    if state.json:
        _ui().emit_json([{"host": o.host, "ok": o.ok, "error": str(o.error) if o.error else None, **(o.value or {})} for o in outcomes])
    else:
        ui = _ui()
        for o in outcomes:
            if not o.ok:
                ui.line(f"[{o.host}] unreachable: {o.error}", style="red")
                continue
            d = o.value
            pk = d["packages"]
            show = lambda name: pk.get(name) or "missing"  # noqa: E731
            ui.line(f"[{o.host}] reachable  python {d['python']} ({d['executable']})", style="green")
            torch = show("torch") + (f" (CUDA {d['torch_cuda']})" if d.get("torch_cuda") else "")
            ui.line(f"[{o.host}] torch {torch}  transformers {show('transformers')}  vllm {show('vllm')}  speculators {show('speculators')}")
            if d.get("gpus"):
                for g in d["gpus"]:
                    ui.line(f"[{o.host}] GPU {g['index']}: {g['name']}  {g['memory_used_mib']}/{g['memory_total_mib']} MiB used")
            else:
                ui.line(f"[{o.host}] GPUs: none ({d.get('gpu_note') or 'no GPU'})", style="yellow")
    if not all(o.ok for o in outcomes):
        raise typer.Exit(EXIT_FAILED)


@hosts_app.command("trust")
def hosts_trust(
    host: str = typer.Argument(..., help="Host name from the inventory."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Record the key without asking."),
    fingerprint: Optional[str] = typer.Option(None, "--fingerprint", help="Record only if the key has this SHA256 fingerprint."),
):
    """Show a host's key fingerprint and record it in the known_hosts file (the inventory's, else ~/.ssh/known_hosts)."""
    from . import hosts, hostkeys

    h = state.inventory.one(host)
    hostname, port, key = hosts.offered_key(h)
    fp = hostkeys.fingerprint(key)
    ui = _ui()
    ui.line(f"{h.name} ({hostname}:{port}) offers {key.get_name()} {fp}")
    if fingerprint and fingerprint != fp:
        raise KimiEagleError(f"{h.name}: offered fingerprint {fp} does not match --fingerprint {fingerprint}; nothing recorded")
    if not (yes or fingerprint):
        if not sys.stdin.isatty():
            raise ConfigError(f"{h.name}: not a terminal; confirm with --yes or --fingerprint {fp}")
        if not typer.confirm("Trust this key?", default=False):
            raise typer.Exit(EXIT_FAILED)
    path = hosts.trust(h, hostname, port, key)
    ui.line(f"recorded in {path}", style="green")


# ---------------------------------------------------------------------------------------------- render
@app.command()
def render(
    what: str = typer.Argument(..., metavar="WHAT", help="probe | patch | gpu-reset | preflight | job STEP (e.g. 'job extract')."),
    step: Optional[str] = typer.Argument(None, help="The step, for WHAT=job: prepare|extract|vocab|train|all."),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host from the inventory."),
    out: Path = typer.Option(..., "--out", "-o", help="Local folder to write the rendered files into."),
):
    """Write exactly what would be uploaded and run, without touching the network."""
    from . import renderables, render as r

    files = renderables.files_for(what, step, state.inventory.one(host))
    written = r.write(out, files)
    if state.json:
        return _ui().emit_json([str(p) for p in written])
    for p in written:
        _ui().line(str(p))


# ---------------------------------------------------------------------------------------------- upload
@app.command()
def upload(
    paths: List[Path] = typer.Argument(..., exists=True, dir_okay=True, help="Local files or folders."),
    host: Optional[str] = typer.Option(None, "--host", "-H", help="Host (or group) from the inventory."),
    group: Optional[str] = typer.Option(None, "--group", "-g", help="Group from the inventory."),
    to: str = typer.Option(..., "--to", help="Folder on the host; relative paths are under the host's workdir."),
):
    """Copy files to hosts atomically, sha256-verified; files already there unchanged are skipped."""
    from . import transfer

    outcomes = transfer.upload(state.inventory.select(host, group), paths, to)
    if state.json:
        _ui().emit_json([{"host": o.host, "ok": o.ok, "error": str(o.error) if o.error else None,
                          **({"root": o.value.root, "changed": o.value.changed, "unchanged": o.value.unchanged,
                              "bytes_sent": o.value.bytes_sent} if o.value else {})} for o in outcomes])
    else:
        for o in outcomes:
            if not o.ok:
                _ui().line(f"[{o.host}] failed: {o.error}", style="red")
                continue
            for path, status in o.value.rows():
                _ui().line(f"[{o.host}] {status:9} {o.value.root}/{path}")
    if not all(o.ok for o in outcomes):
        raise typer.Exit(EXIT_FAILED)


def main(argv: Optional[List[str]] = None) -> None:
    from . import commands  # noqa: F401  (registers the commands that live beside this file)

    try:
        rc = app(args=argv, standalone_mode=False)
    except KimiEagleError as e:
        _ui().error(str(e))
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        _ui().error("aborted")
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception as e:  # click usage errors
        import click

        if isinstance(e, click.exceptions.ClickException):
            e.show()
            sys.exit(EXIT_USAGE if isinstance(e, click.UsageError) else e.exit_code)
        if isinstance(e, click.exceptions.Exit):
            sys.exit(e.exit_code)
        raise
    # With standalone_mode=False click returns the code of a typer.Exit instead of raising it.
    sys.exit(rc if isinstance(rc, int) else 0)
