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


def sbatch_wrapper(tmp_path, body: str) -> dict:
    """The host env that puts an `sbatch` first on the login node's PATH: `body` (bash), around the real one
    ("$REAL" "$@")."""
    import shutil

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(f"#!/usr/bin/env bash\nREAL={shutil.which('sbatch')}\n{body}\n")
    (bin_dir / "sbatch").chmod(0o755)
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}


@pytest.mark.parametrize("cut", ["after", "before"])
def test_a_connection_lost_during_sbatch_names_the_job_and_keeps_it_recorded(tmp_path, sshd, cluster, cut):
    """A real drop (the sshd processes of the submitting connection killed) right after sbatch queued the job, or
    before it ran: the job is in this machine's index, the error names it with what shows whether it was queued,
    and `status JOB` then finds it or says it never got a Slurm id. The job was queued unnamed and unrecorded."""
    cutter = sshd.cutter(tmp_path / "cut-connection")
    # before: the drop, then sbatch fails (the host's shell goes on after a drop; only a failing sbatch queues nothing)
    body = f'"$REAL" "$@"; rc=$?; {cutter}; exit $rc' if cut == "after" else f"{cutter}; exit 1"
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"}, host_env=sbatch_wrapper(tmp_path, body))
    r = env.cli("run", "exec", "--host", "login", "--detach", "--no-preflight", "--", "sleep", "60")
    assert r.code == 5, (r.stdout, r.stderr)
    (job,) = [p.name for p in (env.workdir / "runs").iterdir() if p.is_dir()]
    assert f"job {job} may have started on login" in r.stderr and f"kimi-eagle status {job}" in r.stderr, r.stderr
    if cut == "after":
        assert wait_state(env, job, {"pending", "running"})["state"] in ("pending", "running")
        assert env.cli("stop", job, "--grace", "1").code == 0
    else:
        st = env.cli("status", job)
        assert st.code == 2 and "got no answer and no Slurm job id is recorded" in st.stderr, st.stderr


def test_an_sbatch_that_does_not_answer_in_time_is_a_timeout_not_a_refusal(tmp_path, sshd, cluster, monkeypatch):
    """sbatch queues the job but answers after the submission's time limit (a busy slurmctld): the start says it
    timed out and that the job may be queued, naming it; it said "sbatch refused the job" and left it unrecorded."""
    from kimi_eagle.api import Controller
    from kimi_eagle.errors import ConnectionFailed
    from kimi_eagle.jobs import slurm

    monkeypatch.setattr(slurm, "SUBMIT_TIMEOUT_S", 2.0, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the job index, shared with env.cli below
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"},
                    host_env=sbatch_wrapper(tmp_path, '"$REAL" "$@"; rc=$?; sleep 6; exit $rc'))
    with pytest.raises(ConnectionFailed) as raised:
        Controller(env.inventory).run("exec", host="login", extra=["sleep", "60"], preflight=False)
    said = str(raised.value)
    (job,) = [p.name for p in (env.workdir / "runs").iterdir() if p.is_dir()]
    assert "sbatch gave no answer within 2s" in said and f"job {job} may have started" in said, said
    assert "refused" not in said
    deadline = time.monotonic() + 60
    while (st := env.cli("--json", "status", job)).code == 2:  # "no Slurm job" until sbatch returned
        assert time.monotonic() < deadline and "got no answer" in st.stderr, st.stderr
        time.sleep(0.5)
    assert st.json()["jobs"][0]["state"] in ("pending", "running"), st.stdout
    assert env.cli("stop", job, "--grace", "1").code == 0


@pytest.mark.parametrize("session", ["own", "given"])
def test_a_drop_during_the_tail_read_still_prints_only_the_last_lines(tmp_path, sshd, cluster, monkeypatch, session):
    """`logs --tail 3 --follow` of a Slurm job whose connection drops (really: the sshd's connection processes killed)
    just as the tail is read: after the reconnect the last 3 lines come, then what the job writes later. The task
    was taken as read, and the whole log came from byte 0; over a connection of its own (`logs`, not `run`'s), the
    follow gave up at once ("cannot follow"), the connection not yet counted as having worked."""
    from kimi_eagle.config import inventory
    from kimi_eagle.hosts.session import HostSession
    from kimi_eagle.hosts.transport.ssh import SSHTransport
    from kimi_eagle.jobs import slurm

    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"})
    release = tmp_path / "release"
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\nfor i in range(1000):\n    print('old line', i)\nsys.stdout.flush()\n"
                      "t = time.monotonic()\nwhile not os.path.exists(sys.argv[1]) and time.monotonic() - t < 150:\n"
                      "    time.sleep(0.1)\nprint('new line', flush=True)\n")
    r = env.cli("--json", "run", "exec", "--host", "login", "--detach", "--no-preflight", "--", PY, str(script), str(release))
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    log = env.workdir / "runs" / job / "log"
    deadline = time.monotonic() + 120
    while not (log.exists() and "old line 999" in log.read_text()):
        assert time.monotonic() < deadline, "the job never wrote its lines"
        time.sleep(0.2)

    real_run, cuts = SSHTransport.run, []

    def run(self, command, **kw):
        if command.startswith("head -c") and not cuts:  # the tail read: the connection drops just before it
            cuts.append(command)
            sshd.drop_connections()
            deadline = time.monotonic() + 20
            while self._conn is not None and self._conn.is_connected and time.monotonic() < deadline:
                time.sleep(0.05)
        return real_run(self, command, **kw)

    monkeypatch.setattr(SSHTransport, "run", run)
    lines = []

    def emit_for(task):
        def emit(kind, text):
            lines.append(text)
            if text == "old line 999":
                release.touch()
        return emit

    host = inventory.load(env.inventory).hosts["login"]
    result = slurm.follow(host, job, emit_for, tail=3, poll_s=0.2, session=HostSession(host) if session == "given" else None)
    assert cuts and result.reconnects >= 1, (cuts, result)
    got = [ln for ln in lines if " line" in ln]
    assert got == ["old line 997", "old line 998", "old line 999", "new line"], (len(got), got[:3])
