"""A REAL Slurm (slurmctld + two slurmd) behind the real sshd: nothing reported that did not happen.

A failed squeue is retried, then an error: never `lost` or `failed` (the job goes on and `logs --follow` sees it
succeed); job ids are input; a workdir with `%` keeps its logs; sbatch_args cannot take over managed flags.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from conftest import REPO, one_line_usage_error
from slurm_cluster import SlurmCluster, available
from test_slurm import slurm_env, wait_state

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(not available(), reason="needs slurm-wlm and root (.ci/run installs it)")]

PY = sys.executable


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=2, gpus=0).start()
    yield c
    c.stop()


def test_a_failed_squeue_is_an_error_never_a_state_and_the_job_goes_on(tmp_path, sshd, cluster):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"})
    # The job runs until the controller is back (the test says so with a file), so it spans the outage however
    # long that takes on a loaded machine, and ends right after (a fixed sleep made it wait ~40 s longer).
    back = tmp_path / "controller-back"
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\nprint('begin', flush=True)\nt = time.monotonic()\n"
                      "while not os.path.exists(sys.argv[1]) and time.monotonic() - t < 150:\n    time.sleep(0.2)\n"
                      "print('end' if os.path.exists(sys.argv[1]) else 'never told', flush=True)\n")
    r = env.cli("--json", "run", "exec", "--host", "login", "--detach", "--", PY, str(script), str(back))
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    wait_state(env, job, {"running"})
    e = {**os.environ, "HOME": str(env.home), "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    follower = subprocess.Popen([PY, "-m", "kimi_eagle", "--inventory", str(env.inventory), "logs", job, "--follow"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=e, cwd=env.root)
    try:
        time.sleep(2)
        cluster.stop_controller()
        try:
            listing = env.cli("--json", "status", "--host", "login")
        finally:
            cluster.start_controller()
            back.touch()
        assert listing.code == 1, (listing.stdout, listing.stderr)
        data = listing.json()
        assert "squeue failed" in data["errors"]["login"] and not data["jobs"], data
        out, err = follower.communicate(timeout=180)
    finally:
        if follower.poll() is None:
            follower.kill()
    assert follower.returncode == 0, (out[-2000:], err[-2000:])
    assert "[login] end" in out and f"job {job} succeeded" in err
    assert wait_state(env, job, {"succeeded"})["exit_code"] == 0


def test_job_ids_are_input_on_a_slurm_host(tmp_path, sshd, cluster):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"})
    r = env.cli("--json", "run", "exec", "--host", "login", "--detach", "--", PY, "-c", "import time; time.sleep(300)")
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    wait_state(env, job, {"running"})
    for bad in ("", f"../runs/{job}", str(env.workdir / "runs" / job), "-x"):
        for cmd in ("stop", "logs", "status"):
            line = one_line_usage_error(env.cli(cmd, "--host", "login", "--", bad))
            assert "not a job id" in line
        assert wait_state(env, job, {"running"}, timeout=5)["state"] == "running"
    assert env.cli("stop", job, "--host", "login", "--grace", "1").code == 0


def test_a_workdir_with_percent_keeps_its_log_and_state(tmp_path, sshd, cluster):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug", "shards": 2})
    work = tmp_path / "work%j%a%%x"
    env.inventory.write_text(env.inventory.read_text().replace(f"workdir: {env.workdir}", f"workdir: {work}"))
    r = env.cli("run", "exec", "--host", "login", "--", PY, "-c", "import sys; print('rank', sys.argv[sys.argv.index('--rank') + 1])")
    assert r.code == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "[login:0] rank 0" in r.stdout and "[login:1] rank 1" in r.stdout
    (run_dir,) = [p for p in (work / "runs").iterdir() if p.is_dir()]
    assert sorted(p.name for p in run_dir.glob("log*")) == ["log.0", "log.1"]


@pytest.mark.parametrize("flag", ["--output=/tmp/elsewhere.log", "--out=/tmp/x", "--test-only", "--chdir=/tmp",
                                  "--array=0-9", "--wait", "--partition=debug"])
def test_sbatch_args_cannot_set_managed_flags(tmp_path, sshd, cluster, flag):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug", "sbatch_args": [flag]})
    line = one_line_usage_error(env.cli("run", "exec", "--host", "login", "--", "true"))
    assert "sbatch_args" in line and "manages" in line, line
    assert not (env.workdir / "runs").exists()
