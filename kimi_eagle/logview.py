"""Showing a log stream to a person: host-prefixed lines, and progress bars instead of bar spam.

tqdm bars and vLLM's `Loading safetensors checkpoint shards: k/n` arrive as carriage-return
updates; on a terminal they become rich progress bars, elsewhere only a finished bar is printed.
"""

from __future__ import annotations

import json
import re
import sys

# "desc:  45%|####5     | 45/100 [00:01<00:02, 30.0it/s]" and vLLM's "...: 40% Completed | 2/5 [...]".
# Anchored on the percent sign, with no open-ended prefix: every attempt starts at a digit before a `%`
# and stops at the next `|`, so a line of any length is scanned in linear time (a leading `.*?` with a
# following `\s*` was quadratic on runs of spaces: 45 s for a 60 KB line).
PROGRESS = re.compile(r"(?<!\d)(?P<pct>\d{1,3})%(?:[ \t]*Completed[ \t]*\||\|[^|]*\|)[ \t]*(?P<n>\d+)/(?P<total>\d+)")


def parse_progress(text: str):
    m = PROGRESS.search(text)
    if not m:
        return None
    desc = text[: m.start()].strip().rstrip(":").strip()
    return (desc or "progress"), int(m.group("n")), int(m.group("total"))


class Printer:
    def __init__(self, host: str, console, as_json: bool = False):
        self.host, self.console, self.as_json = host, console, as_json
        self.progress = None
        self.tasks: dict[str, int] = {}
        self.done: set[str] = set()
        self.drawn: set[str] = set()  # bars seen as redraws, so their newline-ended last frame is theirs too

    def __call__(self, kind: str, text: str) -> None:
        # Only carriage-return redraws are bars, and the newline-ended last frame of a bar already drawn; any
        # other finished line is printed as it is, however much it looks like one.
        bar = parse_progress(text) if kind == "progress" or self.tasks or self.drawn else None
        if bar and (kind == "progress" or bar[0] in self.drawn):
            self._bar(*bar)
            return
        if kind == "progress":
            return  # a bare carriage-return redraw with nothing to show
        if self.as_json:
            sys.stdout.write(json.dumps({"host": self.host, "line": text}, ensure_ascii=False) + "\n")
            sys.stdout.flush()
        elif self.progress is not None:
            self.console.print(f"[{self.host}] {text}", markup=False, highlight=False, soft_wrap=True)  # above the bars
        else:
            # Plain lines skip rich's renderer: a busy log must not be slowed down by printing it.
            f = self.console.file
            f.write(f"[{self.host}] {text}\n")
            f.flush()

    def _bar(self, desc: str, n: int, total: int) -> None:
        key = desc
        self.drawn.add(key)
        if self.as_json or not self.console.is_terminal:
            if n >= total and key not in self.done:
                self.done.add(key)
                self("line", f"{desc}: {n}/{total} done")
            elif n < total:
                self.done.discard(key)
            return
        if self.progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn(f"[{self.host}] {{task.description}}"), BarColumn(), MofNCompleteColumn(),
                                     TimeRemainingColumn(), console=self.console, transient=False)
            self.progress.start()
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(desc, total=total)
        self.progress.update(self.tasks[key], completed=n, total=total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
