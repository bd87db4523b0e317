"""The `kimi-eagle` app: global options, the command modules it adds, and `main` (errors → exit codes).

Each command group lives in its own module and is added here; none of them imports this module.
"""

from __future__ import annotations

import sys
import time
from typing import List, Optional

import typer

from ..errors import EXIT_FAILED, EXIT_TRANSPORT, EXIT_USAGE, KimiEagleError, is_transport_failure
from ..jobs import interrupts
from . import deploy_patch_cmd, files_cmd, gpu_reset_cmd, hosts_cmd, jobs_cmd, preflight_cmd, runs_cmd
from .context import console_ui, state

app = typer.Typer(
    name="kimi-eagle",
    help="Train EAGLE-3 draft heads on remote GPU hosts over SSH: patch, run, follow, reset.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=True,  # --install-completion, --show-completion (bash, zsh, fish, PowerShell)
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _print_version(value: bool) -> None:
    if value:
        from .. import __version__

        print(f"kimi-eagle {__version__}")
        raise typer.Exit()


@app.callback()
def _global(
    inventory: Optional[str] = typer.Option(
        None, "--inventory", "-i", envvar="KIMI_EAGLE_INVENTORY", metavar="PATH",
        help="Inventory file (default ./inventory.yaml, else the embedded local default).",
    ),
    json_out: bool = typer.Option(False, "--json", help="Machine-readable output on stdout (also accepted after the command)."),
    verbose: int = typer.Option(0, "--verbose", "-v", count=True, help="More detail (repeat for more)."),
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version,
                                 help="Print the version and exit."),
):
    state.inventory_path = inventory
    state.json = json_out
    state.verbose = verbose


app.add_typer(hosts_cmd.app, name="hosts")
for _module in (files_cmd, jobs_cmd, runs_cmd, deploy_patch_cmd, preflight_cmd, gpu_reset_cmd):
    _module.register(app)


def command():
    """The click command behind `app`, with flags shown without a value placeholder (newer typer prints `<bool>`)."""
    cmd = typer.main.get_command(app)
    todo = [cmd]
    while todo:
        c = todo.pop()
        todo += list(getattr(c, "commands", {}).values())
        for p in c.params:
            _no_placeholder(p)
        c.get_help_option = lambda ctx, _made=c.get_help_option: _no_placeholder(_made(ctx))  # made per call
    return cmd


def _no_placeholder(param):
    if param is not None and getattr(param, "is_flag", False) and not getattr(param, "count", False):
        param.metavar = ""
    return param


def _click_kind(e: BaseException) -> str | None:
    """What a click exception is, whichever click raised it: typer >= 0.2x bundles its own as `typer._click`,
    older typer uses the `click` package, so the classes are matched by name within either module."""
    kinds = {c.__name__ for c in type(e).__mro__ if c.__module__.split(".")[0] in ("click", "typer")}
    for name, kind in (("UsageError", "usage"), ("Abort", "abort"), ("Exit", "exit"), ("ClickException", "click")):
        if name in kinds:
            return kind
    return None


def _usage_line(e) -> str:
    ctx = getattr(e, "ctx", None)
    where = ctx.command_path if ctx is not None else "kimi-eagle"
    message = " ".join(e.format_message().split())  # click's "Did you mean …" comes on a line of its own
    return f"{where}: {message} (see: {where} --help)"


def _global_flags_first(argv: List[str]) -> List[str]:
    """`kimi-eagle hosts --json` means `kimi-eagle --json hosts`: --json is accepted after any command (before a
    `--`, after which everything belongs to the step or the command)."""
    end = argv.index("--") if "--" in argv else len(argv)
    if "--json" not in argv[:end]:
        return argv
    return ["--json"] + [a for a in argv[:end] if a != "--json"] + argv[end:]


def _say_started(interrupt) -> None:
    """Ctrl-C that came while a job was starting, after it started (interrupts.StartInterrupted, or a plain
    KeyboardInterrupt before the job was shown): name the job."""
    message = interrupts.what_to_say(interrupt)
    if message:
        console_ui().error(message)


def _keep_ctrl_c(default):
    """An unraisable-exception hook: a Ctrl-C that lands in a weakref callback or a __del__ cannot be raised there,
    so Python prints 'Exception ignored in ...' with a traceback and goes on as if it never came (seen once in 12
    interrupted starts). Deliver it again instead, at the main thread's next instruction, where the command's own
    handling of Ctrl-C sees it; anything else goes to `default`."""
    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _interrupt_main_after(sys._getframe())
            return
        default(unraisable)
    return hook


def _interrupt_main_after(frame) -> None:
    """Ctrl-C for the main thread once it has left `frame`. Called in the main thread, interrupt_main() would fire
    inside that very frame, since Python looks for signals as soon as the call returns: the Ctrl-C became unraisable
    a second time ('Exception ignored in sys.unraisablehook', seen in CI). A helper thread waits for the frame to
    leave the main thread's stack first."""
    import _thread
    import threading

    if threading.current_thread() is not threading.main_thread():
        _thread.interrupt_main()
        return
    main_id = threading.main_thread().ident

    def still_inside() -> bool:
        f = sys._current_frames().get(main_id)
        while f is not None:
            if f is frame:
                return True
            f = f.f_back
        return False

    def deliver():
        while still_inside():
            time.sleep(0.001)
        _thread.interrupt_main()

    threading.Thread(target=deliver, name="deliver-ctrl-c", daemon=True).start()


def main(argv: Optional[List[str]] = None) -> None:
    sys.unraisablehook = _keep_ctrl_c(sys.__unraisablehook__)
    argv = _global_flags_first(list(sys.argv[1:] if argv is None else argv))
    state.argv = argv
    interrupts.shown()  # a start of an earlier command in this process (a test's, an API caller's) is not this one's
    try:
        rc = command().main(args=argv, prog_name="kimi-eagle", standalone_mode=False)
    except KimiEagleError as e:
        console_ui().error(str(e))
        sys.exit(e.exit_code)
    except KeyboardInterrupt as e:
        _say_started(e)
        sys.exit(130)
    except Exception as e:
        kind = _click_kind(e)
        if kind == "usage":
            console_ui().error(_usage_line(e))
            sys.exit(EXIT_USAGE)
        if kind == "abort" and e.__context__ is not None and is_transport_failure(e.__context__):
            # click turns an EOFError (paramiko's word for a connection that went away) into Abort
            console_ui().error(f"connection lost: {type(e.__context__).__name__}: {e.__context__}")
            sys.exit(EXIT_TRANSPORT)
        if kind == "abort":
            console_ui().error("aborted")
            sys.exit(EXIT_FAILED)
        if kind == "exit":
            _say_started(e.__cause__)  # typer turns Ctrl-C into Exit(130)
            sys.exit(e.exit_code)
        if kind == "click":
            console_ui().error(e.format_message())
            sys.exit(e.exit_code)
        if is_transport_failure(e):  # a connection that dropped mid-command: the network's fault, not the job's
            console_ui().error(f"connection failed: {type(e).__name__}: {e}")
            sys.exit(EXIT_TRANSPORT)
        raise
    # With standalone_mode=False click returns the code of a typer.Exit instead of raising it; typer turns a Ctrl-C
    # that no command caught into Exit(130).
    if rc == 130:
        _say_started(None)
    sys.exit(rc if isinstance(rc, int) else 0)
