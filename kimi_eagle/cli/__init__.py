"""The `kimi-eagle` command line: parses, calls the library, prints. No work happens here."""

import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> None:
    """The console script and `python -m kimi_eagle`. The command line's modules load here, inside the guard: a
    Ctrl-C that lands while they are still loading (a fifth of a start's time on a loaded box) came out as a
    KeyboardInterrupt traceback from an import line. Nothing has started by then, so it ends as any interrupted
    command does: 130, quietly."""
    try:
        from .app import main as run_command_line
    except KeyboardInterrupt:
        sys.exit(130)
    run_command_line(argv)


__all__ = ["main"]
