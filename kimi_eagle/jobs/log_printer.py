"""Showing a log stream to a person: host-prefixed lines, and progress bars instead of bar spam.

The steps' own progress lines (`@kimi-eagle-progress {json}`, printed by step_runtime.progress_line: done/total,
ETA, loss, acceptance, tokens/s) become one bar per step on a terminal, with those figures beside it, and a plain
line each elsewhere. tqdm bars and vLLM's `Loading safetensors checkpoint shards: k/n` arrive as
carriage-return updates; on a terminal they become rich progress bars, elsewhere only a finished bar is printed.
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


POINT_MARK = "@kimi-eagle-progress "  # kimi_eagle_host/step_runtime.py writes it
NOTE_MARK = "==> kimi-eagle: "  # the job script's own lines (a step starts, the job exited)

# What a job may print that would act on the user's terminal instead of showing: escape sequences (CSI such as
# colours and cursor moves, OSC such as window titles, ending in BEL or ST; other two-byte ESC codes), and any
# other C0/C1 control character but the tab. The log file on the host keeps them; only what is shown loses them.
_CONTROL = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[ -/]*[0-~]?"
                      r"|[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """`text` without terminal control sequences."""
    return _CONTROL.sub("", text)


def parse_point(text: str) -> dict | None:
    """A step's progress line as {step, done, total, ...figures}, or None."""
    if not text.startswith(POINT_MARK):
        return None
    try:
        point = json.loads(text[len(POINT_MARK):])
    except ValueError:
        return None
    ok = isinstance(point, dict) and isinstance(point.get("step"), str) and all(
        isinstance(point.get(k), int) for k in ("done", "total"))
    return point if ok else None


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s"


def figures(point: dict) -> str:
    """What a progress point says besides done/total, as a person reads it."""
    parts = []
    if "eta_s" in point and point["done"] < point["total"]:
        parts.append(f"eta {_duration(point['eta_s'])}")
    if isinstance(point.get("loss"), (int, float)):
        parts.append(f"loss {point['loss']:.4f}")
    if isinstance(point.get("acc"), (int, float)):
        parts.append(f"acc {point['acc']:.2f}")
    if isinstance(point.get("accept_len"), (int, float)):
        parts.append(f"accept {point['accept_len']:.2f}")
    if isinstance(point.get("tok_s"), (int, float)):
        parts.append(f"{point['tok_s']:,.0f} tok/s")
    if isinstance(point.get("prompts_s"), (int, float)):
        parts.append(f"{point['prompts_s']:.2f} prompts/s")
    parts += _online(point)
    return "  ".join(parts)


def _online(point: dict) -> list[str]:
    """An online train's flow: the engine's tokens/s, the buffer's fill and who waited for whom (seconds so far)."""
    parts = []
    if isinstance(point.get("engine_tok_s"), (int, float)):
        parts.append(f"engine {point['engine_tok_s']:,.0f} tok/s")
    if isinstance(point.get("buffer_fill"), (int, float)):
        parts.append(f"buffer {100 * point['buffer_fill']:.0f}%")
    waits = [(who, point.get(f"{who}_wait_s")) for who in ("trainer", "engine")]
    if all(isinstance(s, (int, float)) for _, s in waits):
        parts.append("waiting: " + ", ".join(f"{who} {_duration(s)}" for who, s in waits))
    return parts


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
        self.stepped: set[str] = set()  # steps that print progress lines: their tqdm bar would be a second bar

    def __call__(self, kind: str, text: str) -> None:
        text = printable(text)
        note = text.find(NOTE_MARK) if kind == "line" else -1
        if note > 0:  # the job's last output had no newline and the script's note ran into it: two lines
            self("line", text[:note])
            text = text[note:]
        at = text.find(POINT_MARK) if kind == "line" else -1
        if at > 0:  # a tqdm redraw (no newline of its own) ran into the step's progress line: two things
            self("progress", text[:at])
            text = text[at:]
        point = parse_point(text) if at >= 0 else None
        if point is not None:
            return self._point(point)
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

    def _point(self, point: dict) -> None:
        step, done, total = point["step"], point["done"], point["total"]
        self.stepped.add(step)
        if self.as_json:
            sys.stdout.write(json.dumps({"host": self.host, "progress": point}) + "\n")
            sys.stdout.flush()
            return
        if not self.console.is_terminal:
            pct = f" ({100 * done // total}%)" if total else ""
            self("line", f"{step} {done}/{total}{pct}  {figures(point)}".rstrip())
            return
        self._ensure_progress()
        key = f"step:{step}"
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(step, total=total, info="")
        self.progress.update(self.tasks[key], completed=done, total=total, info=figures(point))

    def _ensure_progress(self) -> None:
        if self.progress is None:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.progress = Progress(TextColumn(f"[{self.host}] {{task.description}}", markup=False), BarColumn(), MofNCompleteColumn(),
                                     _InfoOrRemaining(), console=self.console, transient=False)
            self.progress.start()

    def _bar(self, desc: str, n: int, total: int) -> None:
        key = desc
        self.drawn.add(key)
        if desc.split("[")[0] in self.stepped:
            return  # the step's own bar, with its figures, shows this already
        if self.as_json or not self.console.is_terminal:
            if n >= total and key not in self.done:
                self.done.add(key)
                self("line", f"{desc}: {n}/{total} done")
            elif n < total:
                self.done.discard(key)
            return
        self._ensure_progress()
        if key not in self.tasks:
            self.tasks[key] = self.progress.add_task(desc, total=total, info="")
        self.progress.update(self.tasks[key], completed=n, total=total)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None


def _InfoOrRemaining():
    """A step's bar shows its own figures (ETA from the host's pace, loss, acceptance, tokens/s); a tqdm bar
    shows rich's estimate of the time remaining."""
    from rich.progress import ProgressColumn, TimeRemainingColumn

    class Column(ProgressColumn):
        remaining = TimeRemainingColumn()

        def render(self, task):
            from rich.text import Text

            info = task.fields.get("info")
            return Text(info) if info else self.remaining.render(task)

    return Column()
