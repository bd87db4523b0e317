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
    sys.stdout.write(json.dumps(obj, indent=2, default=str) + "\n")
    sys.stdout.flush()


def table(title: str, columns: list[str], rows: list[list]) -> None:
    from rich.table import Table

    t = Table(title=title, title_justify="left")
    for c in columns:
        t.add_column(c)
    for r in rows:
        t.add_row(*["" if v is None else str(v) for v in r])
    console().print(t)


def line(text: str, style: str | None = None) -> None:
    console().print(text, style=style, markup=False, highlight=False, soft_wrap=True)
