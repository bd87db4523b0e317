"""Jobs and GPUs tell the truth, on the real sshd with real processes holding a device file."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from test_gpu_reset_cli import HOLDER, PY, alive, foreign_holder, gpu_env, holding, our_stale_holder, wait_held  # noqa: F401
from test_jobs import wait_state


def _gpu_job(env):
    """A GPU job whose shell starts a child that holds the device; returns (job id, shell pid, child pid)."""
    script = env.root / "holder.py"
    script.write_text(HOLDER)
    before = holding(env.dev)
    r = env.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--gpu", "--", PY, str(script), str(env.dev))
    assert r.code == 0, r.stderr
    job = r.json()
    deadline = time.monotonic() + 20
    while not holding(env.dev) - before:
        assert time.monotonic() < deadline, "the job never opened the device"
        time.sleep(0.05)
    (child,) = holding(env.dev) - before
    return job["id"], job["pid"], child


def test_reset_gpus_never_stops_a_running_job_and_refuses_with_the_lock_message(gpu_env):
    for _ in range(2):
        job_id, shell, child = _gpu_job(gpu_env)
        r = gpu_env.cli("run", "exec", "--host", "gpu", "--reset-gpus", "--gpu", "--", "true")
        assert r.code == 1, r.stdout + r.stderr
        assert f"GPU job {job_id}" in r.stderr and f"kimi-eagle stop {job_id}" in r.stderr
        assert alive(child) and alive(shell)
        assert wait_state(gpu_env, job_id, {"running"})["state"] == "running"
        # A run that does not want the GPU may still reset, but only stale holders: the running job's child stays.
        stale_job = our_stale_holder(gpu_env)
        stale = holding(gpu_env.dev) - {child}
        r = gpu_env.cli("run", "exec", "--host", "gpu", "--reset-gpus", "--no-gpu", "--", "true")
        assert r.code == 0, r.stdout + r.stderr
        assert alive(child) and not any(alive(p) for p in stale), (stale_job, r.stdout)
        assert gpu_env.cli("stop", job_id, "--host", "gpu", "--grace", "1").code == 0


def test_a_job_whose_shell_alone_was_killed_still_holds_the_lock_and_stop_ends_its_group(gpu_env):
    for _ in range(2):
        job_id, shell, child = _gpu_job(gpu_env)
        os.kill(shell, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while alive(shell) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(child)
        st = gpu_env.cli("--json", "status", job_id, "--host", "gpu").json()["jobs"][0]
        assert st["state"] == "running", st  # not `lost`: its group still holds the GPU
        second = gpu_env.cli("run", "exec", "--host", "gpu", "--detach", "--gpu", "--", "true")
        assert second.code == 1 and f"GPU job {job_id}" in second.stderr, second.stdout + second.stderr
        r = gpu_env.cli("stop", job_id, "--host", "gpu", "--grace", "1")
        assert r.code == 0 and "nothing to stop" not in r.stdout, r.stdout + r.stderr
        assert not alive(child)
        assert gpu_env.cli("--json", "status", job_id, "--host", "gpu").json()["jobs"][0]["state"] == "stopped"


def test_gpu_reset_records_a_stopped_job_as_stopped_and_names_what_is_still_held(gpu_env):
    job_id, shell, child = _gpu_job(gpu_env)
    foreign = foreign_holder(gpu_env)
    wait_held(gpu_env, 2)
    r = gpu_env.cli("gpu-reset", "--host", "gpu", "--grace", "1")
    assert r.code == 0, r.stdout + r.stderr
    assert not alive(child) and alive(foreign)
    job = wait_state(gpu_env, job_id, {"stopped", "failed", "lost"})
    assert job["state"] == "stopped", job
    assert "verified free" not in r.stdout
    assert f"still held by pid {foreign} (foreign" in r.stdout, r.stdout


def test_concurrent_gpu_resets_each_run_their_own_flags(gpu_env):
    """A dry run next to a real one: the dry run stops nothing and says so; the real one does what it was asked."""
    import json
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor

    from conftest import REPO

    def cli(*args):
        e = {**os.environ, "HOME": str(gpu_env.home), "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
        p = subprocess.run([sys.executable, "-m", "kimi_eagle", "--inventory", str(gpu_env.inventory), "--json", *args],
                           env=e, capture_output=True, text=True, timeout=300)
        return p.returncode, p.stdout, p.stderr

    for _ in range(3):
        foreign = foreign_holder(gpu_env)
        wait_held(gpu_env, 1)
        asks = [["gpu-reset", "--host", "gpu", "--all", "--dry-run"], ["gpu-reset", "--host", "gpu", "--grace", "1"]]
        with ThreadPoolExecutor(2) as pool:
            (rc1, out1, err1), (rc2, out2, err2) = pool.map(lambda a: cli(*a), asks)
        assert rc1 == 0 and rc2 == 0, (out1, err1, out2, err2)
        (dry,), (real,) = json.loads(out1), json.loads(out2)
        assert dry["mode"] == "dry-run" and real["mode"] == "ours", (dry["mode"], real["mode"])
        assert alive(foreign)  # neither was asked to stop a foreign process
        os.kill(foreign, signal.SIGKILL)


STRANGER = """
import os, sys, time
if sys.argv[2] == "own-group":
    os.setpgid(0, 0)  # `nohup cmd &` from a login shell: a group of its own, in the shell's session
f = open(sys.argv[1], "rb")
time.sleep(600)
"""


def test_a_strangers_group_that_got_a_dead_jobs_number_is_never_the_jobs(gpu_env):
    """A GPU job killed whole (no exit code). The kernel gives its number to a login shell that starts two GPU
    programs of someone else's and exits: one stays in the shell's group, one leads its own group in the shell's
    session. The job is lost and holds no lock; `stop`, gpu-reset and `run --reset-gpus` leave the strangers be."""
    job = gpu_env.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--gpu", "--", "sleep", "60").json()
    run_dir = Path(job["run_dir"])
    assert wait_state(gpu_env, job["id"], {"running"})["state"] == "running"
    os.killpg(job["pgid"], signal.SIGKILL)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_EAGLE_")}
    script = gpu_env.root / "stranger.py"
    script.write_text(STRANGER)
    shell = subprocess.Popen(["bash", "-c", f"{PY} {script} {gpu_env.dev} same-group >/dev/null & a=$!; "
                              f"{PY} {script} {gpu_env.dev} own-group >/dev/null & echo $a $!"],
                             start_new_session=True, stdout=subprocess.PIPE, text=True, env=env)
    strangers = [int(p) for p in shell.stdout.read().split()]
    shell.wait()  # the login shell is gone; its number lives on as its children's group and session
    try:
        wait_held(gpu_env, 2)
        number = shell.pid
        meta = json.loads((run_dir / "meta.json").read_text())
        meta["pgid"] = number  # the records as they read once the kernel gave the job's number to that shell
        (run_dir / "meta.json").write_text(json.dumps(meta))
        for name in ("pid", "pgid"):
            (run_dir / name).write_text(f"{number}\n")
        assert [os.getpgid(p) for p in strangers] == [number, strangers[1]]
        assert [os.getsid(p) for p in strangers] == [number, number]
        got = gpu_env.cli("--json", "status", "--host", "gpu").json()
        assert [j["state"] for j in got["jobs"] if j["id"] == job["id"]] == ["lost"], got
        r = gpu_env.cli("--json", "stop", job["id"], "--host", "gpu", "--grace", "1")
        assert r.code == 0 and not r.json()["stopped"], r.stdout
        r = gpu_env.cli("gpu-reset", "--host", "gpu", "--grace", "1")
        assert r.code == 0, r.stdout + r.stderr
        r = gpu_env.cli("run", "exec", "--host", "gpu", "--reset-gpus", "--gpu", "--", "true")
        assert r.code == 0, r.stdout + r.stderr  # not held by the lost job
        time.sleep(0.5)
        assert all(alive(p) for p in strangers), r.stdout
    finally:
        for p in strangers:
            os.kill(p, signal.SIGKILL)


def test_what_an_ending_gpu_jobs_shell_left_on_the_gpu_is_freed_by_run_reset_gpus(gpu_env):
    """A GPU job whose shell exits leaving a child on the device is `ending`: it holds the GPUs (a plain GPU run is
    refused, naming it), and the child is a stale holder: `run --reset-gpus --gpu` stops it and starts. The job keeps
    its shell's verdict (succeeded, not stopped)."""
    leaver = gpu_env.root / "gpu_leaver.py"
    leaver.write_text(f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {HOLDER!r}, {str(gpu_env.dev)!r}])\n")
    for _ in range(2):
        r = gpu_env.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--gpu", "--", PY, str(leaver))
        assert r.code == 0, r.stderr
        job_id = r.json()["id"]
        wait_held(gpu_env, 1)
        (child,) = holding(gpu_env.dev)
        job = wait_state(gpu_env, job_id, {"ending", "succeeded", "failed"})
        assert job["state"] == "ending" and job["left"] == [child], job
        plain = gpu_env.cli("run", "exec", "--host", "gpu", "--detach", "--gpu", "--", "true")
        assert plain.code == 1 and f"GPU job {job_id}" in plain.stderr and "has exited" in plain.stderr, plain.stderr
        r = gpu_env.cli("run", "exec", "--host", "gpu", "--reset-gpus", "--gpu", "--", "true")
        assert r.code == 0 and f"pid {child}" in r.stdout, r.stdout + r.stderr
        assert not alive(child)
        after = gpu_env.cli("--json", "status", job_id, "--host", "gpu").json()["jobs"][0]
        assert (after["state"], after["exit_code"]) == ("succeeded", 0), after
