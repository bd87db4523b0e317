"""bench/gpu/loopback_host.py, the loopback SSH host the GPU-machine CLI runs (gpu_e2e.py, kimi_stage.py) share: its
sshd and inventory entry take `hosts trust` and `hosts check` through the real CLI, as those runs begin."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench" / "gpu"))
import loopback_host  # noqa: E402


def test_the_loopback_host_is_reached_through_the_cli(tmp_path):
    assert loopback_host.controller_site(sys.executable, tmp_path / "site") is None   # this Python has them
    loopback_host.openssh_on_path(tmp_path)
    sshd, known = loopback_host.start_sshd(tmp_path)
    try:
        inv = tmp_path / "inventory.yaml"
        inv.write_text("hosts:\n" + loopback_host.host_entry("h200", sshd, known, python=sys.executable,
                                                              workdir=tmp_path / "w", env={"A_VAR": "x y"}))
        env = {**os.environ, "KIMI_EAGLE_INVENTORY": str(inv), "PYTHONPATH": str(REPO), "NO_COLOR": "1"}

        def cli(*a):
            return subprocess.run([sys.executable, "-m", "kimi_eagle", *a], capture_output=True, text=True, env=env,
                                  timeout=300)

        assert cli("hosts", "check", "h200").returncode == 1                 # unknown key: refused until trusted
        assert cli("hosts", "trust", "h200", "--yes").returncode == 0
        r = cli("--json", "hosts", "check", "h200")
        assert r.returncode == 0, r.stdout + r.stderr
        assert json.loads(r.stdout)[0]["python"]
        r = cli("run", "exec", "--host", "h200", "--no-preflight", "--no-gpu", "--", "sh", "-c", "echo $A_VAR")
        assert r.returncode == 0 and "x y" in r.stdout, r.stdout + r.stderr
    finally:
        sshd.stop()
