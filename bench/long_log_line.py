"""Displaying one very long log line: kimi-eagle's splitter + printer vs writing the same bytes straight out.

The printer looks for progress bars in every line; that search must stay linear in the line's length.
For scale, the previous regex (quadratic on runs of spaces) is timed on short lines only.

    python bench/long_log_line.py [--mib 10] [--repeat 3]
"""

from __future__ import annotations

import argparse
import io
import json
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

OLD_PROGRESS = re.compile(r"^(?P<desc>.*?):?\s*(?P<pct>\d{1,3})%(?:\s*Completed\s*\||\|[^|]*\|)\s*(?P<n>\d+)/(?P<total>\d+)")


def through_kimi(data: bytes) -> float:
    from rich.console import Console

    from kimi_eagle.jobs.log_stream import LineSplitter
    from kimi_eagle.jobs.log_printer import Printer

    out = io.StringIO()
    splitter = LineSplitter(Printer("h", Console(file=out, force_terminal=False, width=200)))
    t0 = time.perf_counter()
    for i in range(0, len(data), 65536):  # the follower's read size
        splitter.feed(data[i:i + 65536])
    splitter.flush()
    return time.perf_counter() - t0


def straight(data: bytes) -> float:
    """The natural floor: decode and write the line, nothing else."""
    out = io.StringIO()
    t0 = time.perf_counter()
    out.write(data.decode())
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=10)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    # Words separated by long runs of spaces: the worst case of the old regex.
    unit = "x" + " " * 4095
    line = unit * ((a.mib << 20) // len(unit))
    data = (line + "\n").encode()
    kimi = min(through_kimi(data) for _ in range(a.repeat))
    base = min(straight(data) for _ in range(a.repeat))
    old = {}
    for kib in (2, 4, 8, 16):  # one run of spaces this long
        s = "x" + " " * (kib << 10) + "y"
        t0 = time.perf_counter()
        OLD_PROGRESS.search(s)
        old[f"{kib} KiB"] = round(time.perf_counter() - t0, 3)
    print(json.dumps({
        "line_mib": a.mib,
        "kimi_eagle_s": round(kimi, 3), "kimi_eagle_mib_per_s": round(a.mib / kimi, 1),
        "straight_write_s": round(base, 3), "ratio_vs_straight": round(kimi / base, 1),
        "old_regex_s_by_line_length": old,
    }, indent=1))


if __name__ == "__main__":
    main()
