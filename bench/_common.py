"""Shared set-up for benchmarks: a real sshd on 127.0.0.1 and an inventory pointing at it."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO))

from sshd import Sshd  # noqa: E402


class Bench:
    """A loopback sshd, a known_hosts file that trusts it, and an inventory with host `gpu`."""

    def __init__(self):
        self.tmp = Path(tempfile.mkdtemp(prefix="kimi-eagle-bench-"))
        self.sshd = Sshd(self.tmp / "sshd").start()
        self.known_hosts = self.tmp / "known_hosts"
        self.known_hosts.write_text(self.sshd.host_key_line())
        self.workdir = self.tmp / "work"
        self.inventory = self.tmp / "inventory.yaml"
        self.inventory.write_text("hosts:\n" + self.host_entry("gpu"))

    def host_entry(self, name: str, env: str = "", extra: str = "") -> str:
        """Inventory lines of a host on the loopback sshd (`env`: more `K: V, ` pairs; `extra`: more fields)."""
        return f"""  {name}:
    address: 127.0.0.1
    port: {self.sshd.port}
    user: root
    identity_file: {self.sshd.client_key}
    known_hosts: {self.known_hosts}
    python: {sys.executable}
    workdir: {self.workdir}
    env: {{{env}PYTHONPATH: "{REPO}"}}
{extra}"""

    def ssh_argv(self) -> list[str]:
        return ["ssh", "-T", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={self.known_hosts}",
                "-o", "StrictHostKeyChecking=yes", "-i", str(self.sshd.client_key), "-p", str(self.sshd.port), "root@127.0.0.1"]

    def host(self):
        from kimi_eagle.config import inventory

        return inventory.load(self.inventory).hosts["gpu"]

    def close(self):
        import shutil

        self.sshd.stop()
        shutil.rmtree(self.tmp, ignore_errors=True)  # the upload benchmark leaves gigabytes here


def pct(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def median(values):
    return statistics.median(values)


def pipeline_step(python, module: str, *args, env=None, timeout: float = 3600):
    """`python -m kimi_eagle_host.pipeline.MODULE ARGS`: (its result, the last line it printed; seconds). A step that
    fails ends the benchmark with its stderr's tail."""
    t0 = time.perf_counter()
    p = subprocess.run([str(python), "-m", f"kimi_eagle_host.pipeline.{module}", *map(str, args)], capture_output=True,
                       text=True, env=env, timeout=timeout)
    lines = p.stdout.strip().splitlines()
    if p.returncode or not lines:
        sys.exit(f"{module} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(lines[-1]), time.perf_counter() - t0
