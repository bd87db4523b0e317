"""Per-command latency vs `ssh host true`, and `kimi-eagle --help` cold start, in the same run.

    python bench/latency.py [--repeat 15]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _common import REPO, Bench, median, pct


def timed(argv, repeat, env=None):
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        out.append((time.perf_counter() - t0) * 1000)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=15)
    a = ap.parse_args()
    b = Bench()
    try:
        env = {**os.environ, "PYTHONPATH": str(REPO), "KIMI_EAGLE_INVENTORY": str(b.inventory)}
        cli = [sys.executable, "-m", "kimi_eagle"]
        subprocess.run(cli + ["hosts", "check", "gpu"], check=True, env=env, stdout=subprocess.DEVNULL)  # first deploy
        rows = {
            "ssh host true": timed(b.ssh_argv() + ["true"], a.repeat),
            "kimi-eagle --help": timed(cli + ["--help"], a.repeat, env),
            "kimi-eagle status --host gpu": timed(cli + ["status", "--host", "gpu"], a.repeat, env),
            "kimi-eagle hosts check gpu": timed(cli + ["hosts", "check", "gpu"], a.repeat, env),
        }
        # The library on one open connection: what each step of a command costs after connecting.
        from kimi_eagle.hosts.session import HostSession

        with HostSession(b.host()) as s:
            s.transport.run("true")
            lib = []
            for _ in range(a.repeat * 4):
                t0 = time.perf_counter()
                s.transport.run("true", check=True)
                lib.append((time.perf_counter() - t0) * 1000)
        rows["library: run('true') on an open connection"] = lib
        base = median(rows["ssh host true"])
        report = {
            name: {"p50_ms": round(median(v), 1), "p90_ms": round(pct(v, 90), 1), "ratio_to_ssh_true": round(median(v) / base, 2)}
            for name, v in rows.items()
        }
        print(json.dumps({"repeat": a.repeat, "results": report}, indent=2))
    finally:
        b.close()


if __name__ == "__main__":
    main()
