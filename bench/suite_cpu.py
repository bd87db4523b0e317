"""CPU-seconds per test of the suite, everything each test starts included (its CLI, sshd's sessions, detached
jobs, vLLM's engine processes): each xdist worker moves itself into a cgroup-v1 cpuacct group of its own, which
every descendant inherits. Root and a cgroup-v1 cpuacct mount needed (the 2-core box has them).

    PYTHONPATH=bench python3 -m pytest -q -p suite_cpu      # the suite, one JSON line per test in $KE_SUITE_CPU_DIR
    python3 bench/suite_cpu.py                              # CPU-seconds and wall seconds per file, the top tests
"""
from __future__ import annotations

import collections
import json
import os
import sys
import time

import pytest

ROOT = "/sys/fs/cgroup/cpuacct"
OUT = os.environ.get("KE_SUITE_CPU_DIR", "/tmp/kimi-eagle-suite-cpu")
WORKER = os.environ.get("PYTEST_XDIST_WORKER", "main")
# one group per worker of this run: two runs measured at once (their workers both named gw0, ...) must not share one
RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID", str(os.getpid()))[:12]
GROUP = f"{ROOT}/kimi_eagle_{RUN}_{WORKER}"


def pytest_configure(config):
    if "PYTEST_XDIST_WORKER" not in os.environ and getattr(config.option, "numprocesses", 0):
        return   # the xdist controller runs no test
    os.makedirs(GROUP, exist_ok=True)
    os.makedirs(OUT, exist_ok=True)
    with open(f"{GROUP}/cgroup.procs", "w") as f:
        f.write(str(os.getpid()))


def _used() -> float:
    with open(f"{GROUP}/cpuacct.usage") as f:
        return int(f.read()) / 1e9


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu, wall = _used(), time.time()
    yield
    with open(f"{OUT}/{WORKER}.jsonl", "a") as f:
        f.write(json.dumps({"id": item.nodeid, "cpu": _used() - cpu, "wall": time.time() - wall}) + "\n")


def main() -> None:
    rows = [json.loads(line) for name in sorted(os.listdir(OUT)) if name.endswith(".jsonl")
            for line in open(os.path.join(OUT, name))]
    cpu, wall = collections.Counter(), collections.Counter()
    for r in rows:
        cpu[r["id"].split("::")[0]] += r["cpu"]
        wall[r["id"].split("::")[0]] += r["wall"]
    print(f"{len(rows)} tests, {sum(cpu.values()):.0f} CPU-seconds\n  CPU-s  wall-s  file")
    for name, c in cpu.most_common(int(sys.argv[1]) if len(sys.argv) > 1 else 30):
        print(f"{c:7.0f} {wall[name]:7.0f}  {name}")


if __name__ == "__main__":
    main()
