"""The `kimi-eagle` app: global options, the command modules it adds, and `main` (errors → exit codes).

Each command group lives in its own module and is added here; none of them imports this module.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from . import files, gpu, hosts, jobs, patch, preflight
from .context import console_ui, state
from ..errors import EXIT_FAILED, EXIT_USAGE, KimiEagleError

app = typer.Typer(
    name="kimi-eagle",
    help="Train EAGLE-3 draft heads on remote GPU hosts over SSH: patch, run, follow, reset.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


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


app.add_typer(hosts.app, name="hosts")
for _module in (files, jobs, patch, preflight, gpu):
    _module.register(app)


def main(argv: Optional[List[str]] = None) -> None:
    try:
        rc = app(args=argv, standalone_mode=False)
    except KimiEagleError as e:
        console_ui().error(str(e))
        sys.exit(e.exit_code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        console_ui().error("aborted")
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
