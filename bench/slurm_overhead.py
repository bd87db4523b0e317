"""Overhead of going through Slurm: `kimi-eagle run exec` until the job's first log line arrives here,
for a job submitted with sbatch on a real (local) Slurm vs the same command started directly, over the same sshd.

    python bench/slurm_overhead.py [--runs 5]

Needs slurm-wlm and root (the benchmark starts slurmctld and one slurmd itself, like tests/test_slurm.py).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from _common import REPO, Bench, median

from slurm_cluster import SlurmCluster  # noqa: E402  (tests/ is on the path through _common)


def first_line_seconds(b: Bench, host: str) -> float:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(REPO), "HOME": str(b.tmp / "home")}
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-m", "kimi_eagle", "--inventory", str(b.inventory), "run", "exec", "--host", host,
                          "--", sys.executable, "-c", "print('first line', flush=True)"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    for line in p.stdout:
        if "first line" in line:
            elapsed = time.monotonic() - t0
            break
    else:
        raise RuntimeError(f"{host}: no first line: {p.stderr.read()[-2000:]}")
    p.wait(120)
    return elapsed


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    a = ap.parse_args()
    b = Bench()
    cluster = SlurmCluster(b.tmp / "slurm", nodes=1, gpus=0).start()
    try:
        # The same sshd host twice: `gpu` starts jobs directly, `login` submits them to Slurm.
        b.inventory.write_text(b.inventory.read_text() + b.host_entry(
            "login", env=f'SLURM_CONF: "{cluster.conf}", ', extra="    scheduler: slurm\n    slurm: {partition: debug}\n"))
        (b.tmp / "home").mkdir(exist_ok=True)
        first_line_seconds(b, "gpu")  # deploy payloads once, outside the measurement
        results = {"direct": [], "slurm": []}
        for _ in range(a.runs):
            results["direct"].append(first_line_seconds(b, "gpu"))
            results["slurm"].append(first_line_seconds(b, "login"))
        d, s = median(results["direct"]), median(results["slurm"])
        print(f"run exec -> first log line, median of {a.runs}: direct {d:.2f}s, Slurm {s:.2f}s "
              f"(+{s - d:.2f}s, {s / d:.2f}x)")
        print("  direct:", " ".join(f"{x:.2f}" for x in results["direct"]))
        print("  slurm: ", " ".join(f"{x:.2f}" for x in results["slurm"]))
    finally:
        cluster.stop()
        b.close()


if __name__ == "__main__":
    main()
