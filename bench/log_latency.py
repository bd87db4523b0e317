"""Latency from a line written on the host to the local handler (p50/p99), and sustained lines/s
(first to last line received),
kimi-eagle's follower vs `ssh host tail -F`, in the same run.

    python bench/log_latency.py [--lines 400] [--burst 200000]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time

from _common import Bench, median, pct

WRITER = """
import sys, time
n, delay, path = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
time.sleep(1.0)  # both followers are attached before the first line (measures following, not start-up)
with open(path, "a", buffering=1) as f:
    for i in range(n):
        f.write(f"{time.time():.6f} line {i} {'x' * 60}\\n")
        if delay:
            time.sleep(delay)
"""


def start_job(session, n, delay):
    from kimi_eagle.jobs import direct

    return direct.start(session, "exec", [sys.executable, "-c", WRITER, str(n), str(delay), "/dev/stdout"], gpu=False)


def follow_kimi(b, n, delay):
    """Latency per line and total time through kimi_eagle.jobs.log_stream.follow."""
    from kimi_eagle.jobs import log_stream
    from kimi_eagle.hosts.session import HostSession

    with HostSession(b.host()) as s:
        job = start_job(s, n, delay)
        lat, arrivals = [], []

        def emit(kind, text):
            parts = text.split(" ", 2)
            if len(parts) > 1 and parts[1] == "line":
                now = time.time()
                lat.append((now - float(parts[0])) * 1000)
                arrivals.append(now)

        log_stream.follow(b.host(), job.id, emit, session=s)
        return lat, len(arrivals), arrivals[-1] - arrivals[0]


def follow_ssh_tail(b, n, delay):
    """The same writer, followed by plain `ssh host tail -F`."""
    log = b.tmp / f"tail-{n}-{delay}.log"
    log.write_text("")
    proc = subprocess.Popen(b.ssh_argv() + ["tail", "-n", "+1", "-F", str(log)], stdout=subprocess.PIPE, text=True, bufsize=1)
    lat, arrivals = [], []
    writer = threading.Thread(target=subprocess.run, args=([sys.executable, "-c", WRITER, str(n), str(delay), str(log)],))
    writer.start()
    for line in proc.stdout:
        parts = line.split(" ", 2)
        if len(parts) > 1 and parts[1] == "line":
            now = time.time()
            lat.append((now - float(parts[0])) * 1000)
            arrivals.append(now)
            if len(lat) == n:
                break
    elapsed = arrivals[-1] - arrivals[0]
    proc.kill()
    writer.join()
    return lat, len(lat), elapsed


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lines", type=int, default=400, help="paced lines for latency (10 ms apart)")
    ap.add_argument("--burst", type=int, default=200000, help="unpaced lines for throughput")
    a = ap.parse_args()
    b = Bench()
    try:
        out = {}
        for name, fn in (("kimi-eagle logs --follow", follow_kimi), ("ssh host tail -F", follow_ssh_tail)):
            lat, n, _ = fn(b, a.lines, 0.01)
            _, nb, secs = fn(b, a.burst, 0)
            out[name] = {"p50_ms": round(median(lat), 2), "p99_ms": round(pct(lat, 99), 2), "lines": n,
                         "burst_lines": nb, "burst_lines_per_s": round((nb - 1) / secs)}
        k, s = out["kimi-eagle logs --follow"], out["ssh host tail -F"]
        out["ratios"] = {"p50_latency_kimi_over_ssh": round(k["p50_ms"] / s["p50_ms"], 2),
                         "lines_per_s_kimi_over_ssh": round(k["burst_lines_per_s"] / s["burst_lines_per_s"], 2)}
        print(json.dumps(out, indent=2))
    finally:
        b.close()


if __name__ == "__main__":
    main()
