"""Printing: rich for people, JSON for machines. Only the CLI layer calls this."""

from __future__ import annotations

import json
import sys
from functools import cache


@cache
def console():
    from rich.console import Console

    return Console(highlight=False)  # rich honours NO_COLOR


@cache
def err_console():
    from rich.console import Console

    return Console(stderr=True, highlight=False)


def error(message: str) -> None:
    err_console().print(f"[bold red]error:[/] {message}", markup=True, soft_wrap=True) if _markup_safe(message) else print(
        f"error: {message}", file=sys.stderr
    )


def _markup_safe(text: str) -> bool:
    return "[" not in text


def emit_json(obj) -> None:
    """The one JSON document of a command that answers once."""
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def emit_json_line(obj) -> None:
    """One record of a streaming command's JSON Lines (its log lines, then its result): one object, one line."""
    sys.stdout.write(json.dumps(obj, default=str, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def table(title: str, columns: list[str], rows: list[list], *, wrap: tuple[str, ...] = ()) -> None:
    """Rows under a title. Identifiers (every column not named in `wrap`) are never cut or folded: on a terminal
    wide enough, a boxed table whose `wrap` columns fold; otherwise (narrow, or piped) plain aligned lines that
    the terminal may wrap but nothing cuts, and that grep and cut read."""
    cells = [["" if v is None else str(v) for v in r] for r in rows]
    c = console()
    if c.is_terminal and _fits(columns, cells, wrap, c.width):
        from rich.table import Table

        t = Table(title=title, title_justify="left")
        for name in columns:
            whole = name not in wrap
            t.add_column(name, no_wrap=whole, overflow="ellipsis" if whole else "fold")
        for r in cells:
            t.add_row(*r)
        c.print(t)
        return
    widths = [max([len(name)] + [len(r[i]) for r in cells]) for i, name in enumerate(columns)]
    out = [title, _aligned(columns, widths)] + [_aligned(r, widths) for r in cells]
    c.file.write("\n".join(out) + "\n")
    c.file.flush()


def _aligned(cells: list[str], widths: list[int]) -> str:
    return "  ".join(v.ljust(w) for v, w in zip(cells, widths)).rstrip()


_FOLDED_MIN = 8  # the narrowest a folding column gets before the boxed table is given up


def _fits(columns: list[str], cells: list[list[str]], wrap, width: int) -> bool:
    """Whether a boxed table fits `width` with every identifier column at its full width."""
    need = 1
    for i, name in enumerate(columns):
        natural = max([len(name)] + [len(r[i]) for r in cells])
        need += 3 + (min(natural, _FOLDED_MIN) if name in wrap else natural)
    return need <= width


def line(text: str, style: str | None = None) -> None:
    """One line on stdout, never broken by rich: a path or an id in it stays whole for a pipe and for copying."""
    console().print(text, style=style, markup=False, highlight=False, soft_wrap=True)


def note(text: str, style: str | None = None) -> None:
    """A line about the command (not its result) on stderr, never broken by rich, as `line`."""
    err_console().print(text, style=style, markup=False, highlight=False, soft_wrap=True)
