"""Jobs through a REAL Slurm (Debian's slurm-wlm: slurmctld + two slurmd emulating nodes n1, n2), submitted
through our product over the real sshd: the sshd host is the login node.

A 2-node torchrun job (gloo on CPU, c10d on the first node), two of them at once on one first node, a job array whose tasks get their ranks, a failing
array task, a cancel with a grace signal, preflight against sinfo, a real prepare + sharded extraction, and a
train requeued (as a preemption does) mid-run and again once finished.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time

import pytest

from conftest import REPO, TINY_PIPELINE, make_env
from slurm_cluster import SlurmCluster, available

pytestmark = [pytest.mark.slurm, pytest.mark.skipif(not available(), reason="needs slurm-wlm and root (.ci/run installs it)")]

PY = sys.executable
DDP = str(REPO / "tests" / "ddp_tiny.py")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = SlurmCluster(tmp_path_factory.mktemp("slurm"), nodes=2, cpus=2, gpus=2).start()
    yield c
    c.stop()


def slurm_env(tmp_path, sshd, cluster, slurm: dict, name="login", pipeline="", host_env: dict | None = None):
    env = make_env(tmp_path, sshd, host_env={"SLURM_CONF": str(cluster.conf), "OMP_NUM_THREADS": "1",
                                             "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
                                             **(host_env or {})})
    text = env.inventory.read_text().replace("\n  gpu:\n", f"\n  {name}:\n", 1)
    text = text.replace(f"    known_hosts:", f"    scheduler: slurm\n    slurm: {json.dumps(slurm)}\n    known_hosts:", 1)
    env.inventory.write_text(text + pipeline)
    return env


def wait_state(env, job_id, states, timeout=120):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = env.cli("--json", "status", job_id).json()["jobs"][0]
        if job["state"] in states:
            return job
        time.sleep(0.5)
    raise AssertionError(f"{job_id} never reached {states}: {job}")


def test_two_node_torchrun_job(tmp_path, sshd, cluster):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug", "nodes": 2, "gres": "gpu:1", "time_limit": "10:00"})
    out = tmp_path / "ddp"
    r = env.cli("run", "exec", "--host", "login", "--", DDP, "--out", str(out), timeout=300)
    assert r.code == 0, (r.stdout[-3000:], r.stderr[-3000:])
    ranks = [json.loads((out / f"ddp-rank{i}.json").read_text()) for i in range(2)]
    assert {x["world"] for x in ranks} == {2} and ranks[0]["checksum"] == ranks[1]["checksum"]
    assert "[login] ==> kimi-eagle: slurm job" in r.stdout and "(2 nodes)" in r.stdout
    job = env.cli("--json", "status", "--host", "login").json()["jobs"][-1]
    assert job["state"] == "succeeded" and job["exit_code"] == 0
    # The Slurm job id is recorded in the job directory on the login node, and Slurm agrees on the nodes.
    slurm_id = (tmp_path / "hostwork" / "runs" / job["id"] / "slurm_job_id").read_text().strip()
    assert slurm_id == job["slurm_job_id"]
    shown = cluster.run(["scontrol", "show", "job", slurm_id]).stdout
    assert "NumNodes=2" in shown and "JobState=COMPLETED" in shown


def test_two_torchrun_jobs_on_one_first_node_each_get_a_rendezvous_port_of_their_own(tmp_path, sshd, cluster):
    """Both jobs' first node is n1 (and every emulated node is this machine). A fixed port (29500 when the inventory
    sets none) failed the second with EADDRINUSE; unset, each job picks one free on its first node as it starts."""
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug", "nodes": 2, "gres": "gpu:1", "time_limit": "10:00"})
    ids = []
    for _ in range(2):
        r = env.cli("--json", "run", "exec", "--host", "login", "--detach", "--", DDP, "--steps", "10", "--sleep", "1")
        assert r.code == 0, r.stderr
        ids.append(r.json()["id"])
    jobs = [wait_state(env, j, {"succeeded", "failed", "lost", "stopped"}, timeout=300) for j in ids]
    logs = [(env.workdir / "runs" / j / "log").read_text() for j in ids]
    assert [j["state"] for j in jobs] == ["succeeded", "succeeded"], logs
    assert jobs[1]["started_at"] < jobs[0]["ended_at"], jobs   # they ran at the same time
    endpoints = [re.search(r"rendezvous at (\S+)", log).group(1) for log in logs]
    assert endpoints[0] != endpoints[1] and not any(e.endswith(":29500") for e in endpoints), endpoints


def test_job_array_gives_each_task_its_rank_and_reports_a_failing_task(tmp_path, sshd, cluster):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug", "shards": 3})
    script = tmp_path / "task.py"
    script.write_text("import sys\nr = sys.argv.index('--rank')\nprint('task args', sys.argv[r:])\n"
                      "sys.exit(7 if sys.argv[r + 1] == '1' else 0)\n")
    r = env.cli("run", "exec", "--host", "login", "--", PY, str(script), timeout=300)
    assert r.code == 1, (r.stdout, r.stderr)  # the job failed: one task did
    for i in range(3):
        assert f"[login:{i}] task args ['--rank', '{i}', '--world-size', '3']" in r.stdout
    job = env.cli("--json", "status", "--host", "login").json()["jobs"][-1]
    assert job["state"] == "failed" and job["exit_code"] == 7
    assert {t: (v["state"], v["exit_code"]) for t, v in job["tasks"].items()} == {
        "0": ("succeeded", 0), "1": ("failed", 7), "2": ("succeeded", 0)}


def test_stop_cancels_with_a_grace_signal_first(tmp_path, sshd, cluster):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"})
    script = tmp_path / "long.py"
    script.write_text("import signal, sys, time\n"
                      "signal.signal(signal.SIGTERM, lambda *a: (print('got SIGTERM, saving', flush=True), sys.exit(143)))\n"
                      "print('working', flush=True)\ntime.sleep(300)\n")
    r = env.cli("--json", "run", "exec", "--host", "login", "--detach", "--", PY, str(script))
    assert r.code == 0, r.stderr
    job_id = r.json()["id"]
    deadline = time.monotonic() + 60
    while "working" not in env.cli("logs", job_id).stdout:
        assert time.monotonic() < deadline
        time.sleep(0.5)
    stop = env.cli("stop", job_id, "--grace", "5")
    assert stop.code == 0, stop.stderr
    job = wait_state(env, job_id, {"stopped"})
    assert job["exit_code"] == 143  # our script saw TERM (grace), not a bare SIGKILL
    logs = env.cli("logs", job_id)
    assert logs.code == 4 and "got SIGTERM, saving" in logs.stdout
    assert cluster.run(["squeue", "-h", "-j", job["slurm_job_id"]]).stdout.strip() == ""


@pytest.mark.parametrize("slurm, needle", [
    ({"partition": "nosuch"}, "partition 'nosuch' not found (sinfo lists: debug)"),
    ({"partition": "debug", "gres": "gpu:8"}, "offers no gres gpu:8"),
    ({"partition": "debug", "nodes": 5}, "has 2 nodes, the job needs 5"),
])
def test_preflight_checks_sinfo_and_submits_nothing(tmp_path, sshd, cluster, slurm, needle):
    env = slurm_env(tmp_path, sshd, cluster, slurm)
    r = env.cli("run", "exec", "--host", "login", "--", "true")
    assert r.code == 1 and needle in r.stderr, r.stderr
    assert not list((tmp_path / "hostwork").glob("runs/*/slurm_job_id"))


def test_prepare_then_extraction_as_a_job_array(tmp_path, sshd, cluster):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug", "shards": 2}, pipeline=TINY_PIPELINE)
    r = env.cli("run", "prepare", "--host", "login", "--no-preflight", timeout=600)
    assert r.code == 0, (r.stdout[-2000:], r.stderr[-2000:])
    r = env.cli("run", "extract", "--host", "login", "--no-preflight", timeout=600)
    assert r.code == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "[login:0] [extract] rank 0/2" in r.stdout and "[login:1] [extract] rank 1/2" in r.stdout
    out = tmp_path / "hostwork" / "out"
    n = json.loads((out / "prepared" / "manifest.json").read_text())["count"]
    assert len(list((out / "hidden_states").glob("hs_*.safetensors"))) == n


def test_a_job_is_rendered_once_and_what_was_rendered_is_what_runs(tmp_path, sshd, cluster, monkeypatch):
    """`run` renders a job before connecting (bad input changes nothing) and submits exactly that, as a direct job
    does; the Slurm path rendered it a second time with the open session, so what was checked was not what ran."""
    from kimi_eagle.api import Controller
    from kimi_eagle.jobs import slurm

    renders = []
    real = slurm.job_files
    monkeypatch.setattr(slurm, "job_files", lambda *a, **k: renders.append(real(*a, **k)) or renders[-1])
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # the job index, shared with env.cli below
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug", "shards": 2})
    script = tmp_path / "task.py"
    script.write_text("import sys\nprint('task', sys.argv[sys.argv.index('--rank') + 1])\n")
    job_id = Controller(env.inventory).run("exec", host="login", extra=[PY, str(script)]).job.id
    assert len(renders) == 1
    for rel, text in renders[0].items():
        assert (env.workdir / rel).read_text() == text, rel
    assert wait_state(env, job_id, {"succeeded", "failed"})["state"] == "succeeded"
    logs = env.cli("logs", job_id).stdout  # each task's log, where the relative #SBATCH --output put it
    assert "[login:0] task 0" in logs and "[login:1] task 1" in logs, logs


def test_ctrl_c_during_a_submission_leaves_a_recorded_job_or_nothing(tmp_path, sshd, cluster):
    """A real SIGINT at moments spread over `run`'s start on a Slurm host: either the job is in jobs.json and was
    named, or nothing was queued and no job folder is left; never a Slurm job nobody was told about."""
    from test_start_interrupt import _job_dirs, fractions, interrupted_at, warm_start_seconds

    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"})
    index = env.home / ".cache" / "kimi-eagle" / "jobs.json"
    args = ["run", "exec", "--host", "login", "--detach", "--no-preflight", "--", "sleep", "60"]

    def queued() -> set[str]:
        return set(cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split())

    took = warm_start_seconds(env, lambda _: args,
                              lambda job: env.cli("stop", job, "--grace", "1").code)
    seen, outcomes = set(_job_dirs(env.workdir)), []
    for fraction in fractions(outcomes):
        before = queued()
        code, out, err = interrupted_at(env, args, took, fraction)
        new = {name: d for name, d in _job_dirs(env.workdir).items() if name not in seen}
        recorded = json.loads(index.read_text()) if index.exists() else {}
        submitted = {(d / "slurm_job_id").read_text().strip() for d in new.values() if (d / "slurm_job_id").exists()}
        for name, d in new.items():
            # A folder is a submitted job (never half-made) whose id was recorded here and shown to the user.
            assert (d / "slurm_job_id").is_file(), (fraction, name, sorted(p.name for p in d.iterdir()), err)
            assert (recorded.get(name) or {}).get("host") == "login" and name in out + err, (fraction, name, out, err)
            assert env.cli("stop", name, "--grace", "1").code == 0
        # every Slurm job queued since is one of those
        assert queued() - before <= submitted, (fraction, queued() - before, submitted)
        seen |= set(new)
        outcomes.append((code, bool(new)))
    assert (130, False) in outcomes and any(started for _, started in outcomes), outcomes


def test_a_ctrl_c_that_ends_sbatch_on_a_local_login_node_before_it_runs_leaves_nothing(tmp_path, cluster):
    """The controller on the login node itself (transport local): sbatch's shell is a child in the terminal's process
    group until setsid, so a Ctrl-C can end it before it runs. That is an interrupt with nothing queued and no folder
    left, not "sbatch refused the job". Here `sbatch` on the host's PATH is a wrapper that makes that moment happen
    every time: it sends the controller its SIGINT, then ends its shell and itself with theirs."""
    from test_start_interrupt import _job_dirs, start_cli

    wrappers = tmp_path / "bin"
    wrappers.mkdir()
    (wrappers / "sbatch").write_text("#!/usr/bin/env bash\n"
                                     'kill -INT "$(ps -o ppid= -p "$PPID" | tr -d " ")"; kill -INT "$PPID"; kill -INT $$\n')
    (wrappers / "sbatch").chmod(0o755)
    env = make_env(tmp_path, None)
    host_env = {"SLURM_CONF": str(cluster.conf), "PATH": f"{wrappers}:{os.environ['PATH']}"}
    env.inventory.write_text(env.inventory.read_text().replace(
        "    transport: local\n",
        f"    transport: local\n    scheduler: slurm\n    slurm: {json.dumps({'partition': 'debug'})}\n"
        f"    env: {json.dumps(host_env)}\n", 1))
    before = set(cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split())
    run = start_cli(env, "run", "exec", "--host", "local", "--detach", "--no-preflight", "--", "sleep", "60")
    out, err = run.communicate(timeout=120)
    assert run.returncode == 130 and "Traceback" not in err and "refused" not in err, (run.returncode, out, err)
    assert _job_dirs(tmp_path / "localwork") == {}
    assert set(cluster.run(["squeue", "-h", "-o", "%i"]).stdout.split()) <= before


# A train of TRAIN_STEPS slow steps (the loop's test delay), a checkpoint every SAVE_EVERY: long enough to be requeued
# mid-run, short enough for the suite.
TRAIN_STEPS, SAVE_EVERY = 200, 20
REQUEUE_PIPELINE = TINY_PIPELINE + f"""  draft_vocab_size: 256
  epochs: 20
  steps:
    train: {{max_steps: {TRAIN_STEPS}, save_every: {SAVE_EVERY}, log_every: 10}}
"""


def requeue(cluster, env, job_id: str) -> None:
    """`scontrol requeue`, as a preemption does, and the job eligible again at once (Slurm holds a requeued job
    back for its credential lifetime, two minutes); returns once Slurm has it queued again."""
    slurm_id = (env.workdir / "runs" / job_id / "slurm_job_id").read_text().strip()
    assert cluster.run(["scontrol", "requeue", slurm_id]).returncode == 0
    deadline = time.monotonic() + 60
    while cluster.run(["squeue", "-h", "-j", slurm_id, "-o", "%T"]).stdout.strip() != "PENDING":
        assert time.monotonic() < deadline, cluster.run(["scontrol", "show", "job", slurm_id]).stdout
        time.sleep(0.3)
    r = cluster.run(["scontrol", "update", f"JobId={slurm_id}", "StartTime=now"])
    assert r.returncode == 0, r.stderr


def test_a_job_requeued_and_cancelled_before_it_runs_again_is_not_its_last_runs_success(tmp_path, sshd, cluster):
    """The script's exit code is kept in the job's folder; a requeued job runs the script again, and until that run
    records its own the file says the earlier run's. A rerun cancelled while pending (an admin's scancel after a
    preemption) never ran: the job is stopped, not succeeded as its earlier run was."""
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"})
    r = env.cli("--json", "run", "exec", "--host", "login", "--detach", "--no-preflight", "--", "true")
    assert r.code == 0, r.stderr
    job_id = r.json()["id"]
    assert wait_state(env, job_id, {"succeeded", "failed", "lost"})["state"] == "succeeded"
    slurm_id = (env.workdir / "runs" / job_id / "slurm_job_id").read_text().strip()
    assert cluster.run(["scontrol", "requeue", slurm_id]).returncode == 0
    assert cluster.run(["scontrol", "hold", slurm_id]).returncode == 0   # it stays pending, whatever the machine's pace
    assert wait_state(env, job_id, {"pending", "succeeded"})["state"] == "pending"
    assert cluster.run(["scancel", slurm_id]).returncode == 0
    job = wait_state(env, job_id, {"succeeded", "failed", "stopped", "lost"})
    assert (job["state"], job["exit_code"]) == ("stopped", None), job
    status = env.cli("status", job_id)
    assert "succeeded" not in status.stdout and "stopped" in status.stdout, status.stdout


def slurm_said(cluster, env, job_id: str) -> str:
    """What Slurm says of the job (scontrol) and its controller's log lines on it: a failure's context."""
    slurm_id = (env.workdir / "runs" / job_id / "slurm_job_id").read_text().strip()
    log = (cluster.root / "log" / "slurmctld.log").read_text(errors="replace").splitlines()
    return cluster.run(["scontrol", "show", "job", slurm_id]).stdout + "\n".join(
        line for line in log if re.search(rf"JobId={slurm_id}\b", line))[-3000:]


def attempts(env, job_id: str) -> list[str]:
    """The job's log cut at each start of its batch script: one part per run of it."""
    log = (env.workdir / "runs" / job_id / "log").read_text()
    return ["==> kimi-eagle: slurm job" + part for part in log.split("==> kimi-eagle: slurm job")[1:]]


def train_result(part: str) -> dict:
    return json.loads(next(line for line in part.splitlines() if line.startswith("{") and '"total_steps"' in line))


def trained_steps(part: str) -> list[int]:
    """The steps the loop logged (`step 10/200 loss ...`)."""
    return [int(m) for m in re.findall(r"^step (\d+)/\d+ loss", part, re.M)]


def test_a_requeued_train_continues_from_its_checkpoint_and_a_finished_one_is_not_trained_again(tmp_path, sshd, cluster):
    env = slurm_env(tmp_path, sshd, cluster, {"partition": "debug"}, pipeline=REQUEUE_PIPELINE,
                    host_env={"KIMI_EAGLE_TEST_STEP_DELAY_S": "0.1"})
    for step in ("prepare", "extract", "vocab"):
        r = env.cli("run", step, "--host", "login", "--no-preflight", timeout=600)
        assert r.code == 0, (step, r.stdout[-2000:], r.stderr[-2000:])
    r = env.cli("--json", "run", "train", "--host", "login", "--no-preflight", "--detach")
    assert r.code == 0, r.stderr
    job_id = r.json()["id"]
    checkpoints = env.workdir / "out" / "draft" / "checkpoints"
    deadline = time.monotonic() + 300
    while not list(checkpoints.glob("step_*.pt")):
        assert time.monotonic() < deadline and wait_state(env, job_id, {"pending", "running", "failed"})["state"] != "failed"
        time.sleep(0.5)
    requeue(cluster, env, job_id)   # mid-run: the job is ended with SIGTERM (train saves its step) and run again
    job = wait_state(env, job_id, {"succeeded", "failed", "lost", "stopped"}, timeout=600)
    runs = attempts(env, job_id)
    assert len(runs) == 2, (job, slurm_said(cluster, env, job_id), runs[-1][-1500:])
    first, second = runs
    assert job["state"] == "succeeded", second[-3000:]
    stopped_at = train_result(first)["step"]
    assert 0 < stopped_at < TRAIN_STEPS and "exited with code 143" in first, first[-3000:]
    resumed = train_result(second)
    assert resumed["finished"] and resumed["resumed_from_step"] == stopped_at, second[-3000:]
    assert f"at step {stopped_at}/{TRAIN_STEPS}" in second and min(trained_steps(second)) > stopped_at, second[-3000:]
    assert "starting from step 0" not in second   # its checkpoints were continued, not cleared as an earlier run's
    export = env.workdir / "out" / "draft" / "export"
    info = json.loads((export / "training_info.json").read_text())
    # Requeued once finished (a preemption during a later step of `run all` runs the whole script again): train
    # exports again from its last checkpoint, without a step of training.
    requeue(cluster, env, job_id)
    job = wait_state(env, job_id, {"succeeded", "failed", "lost", "stopped"}, timeout=600)
    runs = attempts(env, job_id)
    assert len(runs) == 3, (job, slurm_said(cluster, env, job_id), runs[-1][-1500:])
    third = runs[2]
    assert job["state"] == "succeeded" and "exited with code 0" in third, third[-3000:]
    again = train_result(third)
    assert again["finished"] and again["resumed_from_step"] == TRAIN_STEPS and not again["history"], third[-3000:]
    assert f"at step {TRAIN_STEPS}/{TRAIN_STEPS}" in third and trained_steps(third) == [], third[-3000:]
    assert json.loads((export / "training_info.json").read_text())["final"] == info["final"] is not None
