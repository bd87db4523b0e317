"""gpu-reset on a machine shared by two workdirs (two inventory hosts on the same real sshd, one device file).

A running GPU job of workdir B is never stopped by a reset of workdir A (`gpu-reset` or `run --reset-gpus`),
from two terminals at once, over several rounds; B's own reset still frees B's stale holder.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from conftest import add_workdir_host, make_env
from test_gpu_reset_cli import alive

PY = sys.executable
pytestmark = pytest.mark.skipif(subprocess.run(["which", "fuser"], capture_output=True).returncode != 0,
                                reason="fuser (psmisc) not installed")

HOLD = "import sys, time; f = open(sys.argv[1], 'rb'); print('holding', flush=True); time.sleep(600)"


def holders(dev: Path) -> set[int]:
    return {int(p) for p in subprocess.run(["fuser", str(dev)], capture_output=True, text=True).stdout.split()}


@pytest.fixture
def shared(tmp_path, sshd):
    dev = tmp_path / "nvidia0"
    dev.write_bytes(b"")
    env = add_workdir_host(make_env(tmp_path, sshd, host_env={"KIMI_EAGLE_GPU_DEVICES": str(dev)}), "gpu2",
                           tmp_path / "hostwork2")
    env.dev = dev
    yield env
    for pid in holders(dev):  # whatever a failed assertion left holding the device: ours, by pid
        subprocess.run(["kill", "-9", str(pid)])


def wait_holders(dev, n, timeout=30):
    deadline = time.monotonic() + timeout
    while len(holders(dev)) < n:
        assert time.monotonic() < deadline, "the device was never opened"
        time.sleep(0.05)
    return holders(dev)


def test_a_reset_of_one_workdir_keeps_another_workdirs_running_job(shared):
    env = shared
    r = env.cli("--json", "run", "exec", "--host", "gpu2", "--detach", "--no-gpu", "--", PY, "-c", HOLD, str(env.dev))
    assert r.code == 0, r.stderr
    victim_job = r.json()["id"]
    (victim,) = wait_holders(env.dev, 1)
    for _ in range(3):  # two terminals at once, several rounds
        with ThreadPoolExecutor(2) as pool:
            reset = pool.submit(env.cli, "--json", "gpu-reset", "--host", "gpu", "--grace", "1")
            run = pool.submit(env.cli, "run", "exec", "--host", "gpu", "--reset-gpus", "--no-gpu", "--", "true")
            reset, run = reset.result(), run.result()
        assert reset.code == 0 and run.code == 0, (reset.stdout, reset.stderr, run.stdout, run.stderr)
        (row,) = [h for h in reset.json()[0]["holders"] if h["pid"] == victim]
        assert row["owner"] == "other-workdir" and row["job_id"] == victim_job and row["action"] == "keep"
        assert alive(victim)
        st = env.cli("--json", "status", victim_job, "--host", "gpu2").json()["jobs"][0]
        assert st["state"] == "running", st
    # gpu2's own reset (not --stale-only) does stop its own job, and records it as stopped, not failed.
    own = env.cli("gpu-reset", "--host", "gpu2", "--grace", "1")
    assert own.code == 0, own.stdout + own.stderr
    deadline = time.monotonic() + 20
    while alive(victim):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    st = env.cli("--json", "status", victim_job, "--host", "gpu2").json()["jobs"][0]
    assert st["state"] == "stopped", st


def test_a_stale_holder_is_freed_only_by_its_own_workdir(shared):
    env = shared
    leaver = env.root / "leaver.py"
    leaver.write_text("import subprocess, sys\n"
                      f"subprocess.Popen([sys.executable, '-c', {HOLD!r}, {str(env.dev)!r}], stdout=subprocess.DEVNULL)\n")
    r = env.cli("run", "exec", "--host", "gpu2", "--no-gpu", "--", PY, str(leaver))
    assert r.code == 0, r.stdout + r.stderr
    (stale,) = wait_holders(env.dev, 1)
    other = env.cli("run", "exec", "--host", "gpu", "--reset-gpus", "--no-gpu", "--", "true")
    assert other.code == 0 and alive(stale), other.stdout + other.stderr
    own = env.cli("run", "exec", "--host", "gpu2", "--reset-gpus", "--no-gpu", "--", "true")
    assert own.code == 0, own.stdout + own.stderr
    assert f"pid {stale}" in own.stdout and not alive(stale)
