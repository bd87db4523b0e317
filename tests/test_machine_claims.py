"""A job's claims on a folder and on the GPUs belong to the machine (ops/machine_claims.py): two inventory entries
with their own workdirs on one machine (the real sshd) see each other's jobs, in `run --gpu` and in `clean`; a
stop cut short by a real Ctrl-C leaves the job running, and stoppable, for as long as its processes live."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, add_workdir_host, host_cmd, make_env, one_line_usage_error

PY = sys.executable
PIPELINE = "pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n"


def two_entries(tmp_path, sshd):
    """`gpu` and `gpu2`: one machine, one user, two workdirs."""
    return add_workdir_host(make_env(tmp_path, sshd, extra=PIPELINE), "gpu2", tmp_path / "hostwork2")


def start(env, host, *cmd, gpu=False):
    r = env.cli("--json", "run", "exec", "--host", host, "--detach", "--gpu" if gpu else "--no-gpu", "--", *cmd)
    assert r.code == 0, (r.stdout, r.stderr)
    return r.json()


def wait_state(env, job_id, host, states, timeout=60):
    deadline = time.monotonic() + timeout
    while True:
        job = env.cli("--json", "status", job_id, "--host", host).json()["jobs"][0]
        if job["state"] in states or time.monotonic() > deadline:
            return job
        time.sleep(0.2)


def test_a_gpu_job_of_one_entry_holds_the_gpus_for_the_other_entry(tmp_path, sshd):
    env = two_entries(tmp_path, sshd)
    first = start(env, "gpu", "sleep", "60", gpu=True)
    try:
        r = env.cli("run", "exec", "--host", "gpu2", "--detach", "--gpu", "--", "true")
        assert r.code == 1 and f"GPU job {first['id']} (exec" in r.stderr, (r.code, r.stderr)
        assert str(env.workdir) in r.stderr  # which workdir's job holds them: the other entry's
        assert not (tmp_path / "hostwork2" / "runs").exists() or not [
            p for p in (tmp_path / "hostwork2" / "runs").iterdir() if p.is_dir()]  # nothing half-made
        # --reset-gpus consults the same lock, and stops nothing of the other entry's job.
        r = env.cli("run", "exec", "--host", "gpu2", "--detach", "--reset-gpus", "--gpu", "--", "true")
        assert r.code == 1 and first["id"] in r.stderr, r.stderr
        assert wait_state(env, first["id"], "gpu", {"running"})["state"] == "running"
        cpu = start(env, "gpu2", "true")  # a CPU job is not held back
        assert wait_state(env, cpu["id"], "gpu2", {"succeeded"})["state"] == "succeeded"
    finally:
        assert env.cli("stop", first["id"], "--host", "gpu", "--grace", "1").code == 0
    # The claim ends with the processes: the other entry's GPU job now starts.
    second = start(env, "gpu2", "true", gpu=True)
    assert wait_state(env, second["id"], "gpu2", {"succeeded"})["state"] == "succeeded"


@pytest.mark.parametrize("state", ["running", "ending"])
def test_clean_from_another_entry_refuses_the_folder_a_running_job_writes(tmp_path, sshd, state):
    """`ending`: the job's shell has exited, but a process it left (still writing there) holds the folder's claim."""
    env = two_entries(tmp_path, sshd)
    out = env.workdir / "out"
    (out / "hidden_states").mkdir(parents=True)
    (out / "hidden_states" / "hs_0.safetensors").write_bytes(b"\2" * 100_000)
    # gpu's job records `out` as its output folder (as every pipeline job does first, ops/provenance.py) and runs on.
    record = host_cmd("ops.provenance", "--output-dir", out, "--product-version", "test", "--settings", "x: 1")
    rest = " && sleep 60" if state == "running" else " && { sleep 60 & }"
    busy = start(env, "gpu", "bash", "-c", " ".join(f"'{a}'" for a in record) + rest)["id"]
    deadline = time.monotonic() + 30
    while not (env.workdir / "runs" / busy / "output_dir").exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert wait_state(env, busy, "gpu", {state})["state"] == state
    try:
        r = env.cli("clean", "--host", "gpu2", "--run", str(out), "--yes")
        assert r.code == 1 and f"job {busy} (exec)" in r.stderr and "nothing was removed" in r.stderr, r.stderr
        assert str(env.workdir) in r.stderr  # the job is the other entry's: its workdir is named
        assert (out / "hidden_states" / "hs_0.safetensors").is_file()
    finally:
        assert env.cli("stop", busy, "--host", "gpu", "--grace", "1").code == 0
    r = env.cli("clean", "--host", "gpu2", "--run", str(out), "--yes")
    assert r.code == 0 and not (out / "hidden_states").exists(), r.stderr


# ops.jobs as another machine runs it: its own boot id (the registry is keyed by it), the same home folder
ON_ANOTHER_MACHINE = """
import sys
from kimi_eagle_host import procfs
from kimi_eagle_host.ops import jobs
procfs.boot_id = jobs.boot_id = lambda: "boot-id-of-another-machine"
sys.exit(jobs.main(sys.argv[1:]))
"""


def test_a_gpu_start_on_another_machine_sharing_the_home_leaves_this_machines_claims_alone(tmp_path, sshd):
    """Two GPU nodes with one NFS home: a GPU start on the other node neither waits for this node's GPU job nor
    removes its claim, so this node's GPUs stay held for the other workdir's GPU start."""
    env = two_entries(tmp_path, sshd)
    first = start(env, "gpu", "sleep", "60", gpu=True)
    try:
        work_b = tmp_path / "node-b"
        (work_b / "runs" / "job-b").mkdir(parents=True)
        (work_b / "runs" / "job-b" / "job.sh").write_text("true\n")
        r = subprocess.run([PY, "-c", ON_ANOTHER_MACHINE, "--runs-dir", str(work_b / "runs"), "start", "--job-id",
                            "job-b", "--step", "exec", "--host", "b", "--workdir", str(work_b), "--gpu"],
                           env={**os.environ, "KIMI_EAGLE_MACHINE_DIR": str(sshd.root / "machine"),
                                "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["started"], (r.stdout, r.stderr)  # that node's GPUs
        r = env.cli("run", "exec", "--host", "gpu2", "--detach", "--gpu", "--", "true")
        assert r.code == 1 and f"GPU job {first['id']} (exec" in r.stderr, (r.code, r.stderr)
    finally:
        assert env.cli("stop", first["id"], "--host", "gpu", "--grace", "1").code == 0


def test_claims_left_by_an_older_version_count_for_this_machine_only(tmp_path):
    """Before the per-machine folders every machine sharing the home wrote claims/ directly under the registry: a
    GPU job an older version started during this boot still holds the GPUs, and another machine's claim there is
    neither counted nor removed."""
    from conftest import host_cmd
    from kimi_eagle_host import procfs
    from kimi_eagle_host.ops.jobs import start_ticks

    machine, runs = tmp_path / "machine", tmp_path / "work" / "runs"
    (machine / "claims").mkdir(parents=True)
    (runs / "job-new").mkdir(parents=True)
    (runs / "job-new" / "job.sh").write_text("true\n")
    holder = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        for name, boot in (("old-here", procfs.boot_id()), ("old-elsewhere", "boot-id-of-another-machine")):
            (machine / "claims" / f"{name}.json").write_text(json.dumps({
                "job_id": name, "step": "train", "gpu": True, "started_at": time.time(), "boot_id": boot,
                "run_dir": str(tmp_path / name / "runs" / name), "workdir": str(tmp_path / name), "output_dir": None,
                "pid": holder.pid, "pgid": holder.pid, "start_ticks": start_ticks(holder.pid)}))
        r = subprocess.run(host_cmd("ops.jobs", "--runs-dir", runs, "start", "--job-id", "job-new", "--step", "exec",
                                    "--host", "h", "--workdir", tmp_path / "work", "--gpu"),
                           env={**os.environ, "KIMI_EAGLE_MACHINE_DIR": str(machine), "PYTHONPATH": str(REPO)},
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 3 and json.loads(r.stdout)["held_by"]["job_id"] == "old-here", (r.stdout, r.stderr)
    finally:
        holder.kill()
        holder.wait()
    assert (machine / "claims" / "old-elsewhere.json").is_file()


IGNORES_TERM = "trap '' TERM; echo ready; while :; do sleep 0.2; done"


def _group_alive(pgid: int) -> bool:
    """A live process in the group. Zombies do not count: killed processes whose parent is an init that does not
    reap (PID 1 of some containers) stay in the group as zombies, dead all the same."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:  # state, then ppid, then pgrp
            return True
    return False


def test_a_stop_cut_short_by_ctrl_c_leaves_the_job_running_and_a_second_stop_ends_it(tmp_path, sshd):
    """A job that ignores SIGTERM; `stop --grace 30` gets a real SIGINT (the terminal's Ctrl-C: to its whole
    process group) at several moments of the grace period. Each time the job still runs, so `status` says running,
    it still holds the GPUs, and a second stop ends it."""
    env = make_env(tmp_path, sshd)
    cli_env = {**os.environ, "HOME": str(env.home), "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    for host in ("local", "gpu"):
        for delay in (1.5, 3.0):
            job = start(env, host, "bash", "-c", IGNORES_TERM, gpu=True)
            assert wait_state(env, job["id"], host, {"running"})["state"] == "running"
            # "running" is the job's process; SIGTERM is ignored only once its trap is set ("ready" in its log):
            # on a loaded box a stop could come in between and end it (seen once under a parallel test load)
            deadline = time.monotonic() + 60
            while "ready" not in env.cli("logs", job["id"], "--host", host).stdout:
                assert time.monotonic() < deadline, "the job never said ready"
                time.sleep(0.2)
            stop = subprocess.Popen([PY, "-m", "kimi_eagle", "--inventory", str(env.inventory), "stop", job["id"],
                                     "--host", host, "--grace", "30"], env=cli_env, start_new_session=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            time.sleep(delay)
            os.killpg(stop.pid, signal.SIGINT)
            stop.communicate(timeout=60)
            assert _group_alive(job["pgid"])  # the job ignored SIGTERM, and no SIGKILL came
            got = wait_state(env, job["id"], host, {"stopped"}, timeout=1)
            assert got["state"] == "running", (host, delay, got)
            r = env.cli("run", "exec", "--host", host, "--detach", "--gpu", "--", "true")
            assert r.code == 1 and job["id"] in r.stderr, (host, delay, r.stderr)  # still holds the GPUs
            r = env.cli("--json", "stop", job["id"], "--host", host, "--grace", "0.5")
            assert r.code == 0 and "nothing to stop" not in r.stderr, (r.stdout, r.stderr)
            assert wait_state(env, job["id"], host, {"stopped"})["state"] == "stopped"
            assert not _group_alive(job["pgid"])


def test_stop_grace_must_be_finite_seconds_within_an_hour(tmp_path, sshd):
    env = make_env(tmp_path, sshd)
    job = start(env, "gpu", "sleep", "60")
    try:
        for bad in ("1e308", "nan", "inf", "7200"):
            line = one_line_usage_error(env.cli("stop", job["id"], "--host", "gpu", "--grace", bad))
            assert "--grace" in line, line
        assert wait_state(env, job["id"], "gpu", {"running"})["state"] == "running"
    finally:
        assert env.cli("stop", job["id"], "--host", "gpu", "--grace", "1").code == 0


def test_one_unreadable_job_record_hides_no_other_job(tmp_path, sshd):
    env = make_env(tmp_path, sshd)
    good = start(env, "gpu", "true")
    assert wait_state(env, good["id"], "gpu", {"succeeded"})["state"] == "succeeded"
    for name, raw in (("20260101-000000-exec-bad1", b"{not json"), ("20260101-000000-exec-bad2", b"\xff\xfe\x00")):
        (env.workdir / "runs" / name).mkdir()
        (env.workdir / "runs" / name / "meta.json").write_bytes(raw)
    r = env.cli("--json", "status", "--host", "gpu")
    assert r.code == 0 and "Traceback" not in r.stderr, r.stderr
    states = {j["id"]: j["state"] for j in json.loads(r.stdout)["jobs"]}
    assert states[good["id"]] == "succeeded"
    assert states["20260101-000000-exec-bad1"] == states["20260101-000000-exec-bad2"] == "unreadable"
    r = env.cli("status", "20260101-000000-exec-bad1", "--host", "gpu")
    assert "Traceback" not in r.stderr and "unreadable" in r.stdout + r.stderr, (r.stdout, r.stderr)


def test_flags_that_move_a_steps_outputs_are_refused_after_the_double_dash(tmp_path, sshd):
    """The job records its output folder (clean and pull rely on it): a flag that would send the outputs elsewhere,
    unrecorded, is one line and nothing reaches the host."""
    env = make_env(tmp_path, sshd, extra=PIPELINE)
    for flags in (["--output-dir", str(tmp_path / "out2")], [f"--output-dir={tmp_path / 'out2'}"],
                  ["--out", str(tmp_path / "hs")], ["--output", str(tmp_path / "out2")]):
        line = one_line_usage_error(env.cli("run", "prepare", "--host", "gpu", "--no-preflight", "--", *flags))
        assert flags[0] in line and "output_dir" in line, line
    assert not (env.workdir / "runs").exists()


def test_logs_tail_past_what_the_host_counts_means_every_line(tmp_path, sshd):
    env = make_env(tmp_path, sshd)
    job = start(env, "gpu", "bash", "-c", "echo one; echo two")
    assert wait_state(env, job["id"], "gpu", {"succeeded"})["state"] == "succeeded"
    r = env.cli("logs", job["id"], "--host", "gpu", "--tail", "99999999999999999999999")
    assert r.code == 0 and "one" in r.stdout and "two" in r.stdout and "Traceback" not in r.stderr, (r.stdout, r.stderr)


def test_a_job_started_through_another_inventory_file_is_found_by_this_one(tmp_path, sshd):
    """Two inventory files name the same machine and workdir differently (`gpu` here, `blackwell` there): a job
    started through the other is this machine's job, found without --host, by logs and clean alike."""
    env = make_env(tmp_path, sshd, extra=PIPELINE)
    other = tmp_path / "other-inventory.yaml"
    other.write_text(env.inventory.read_text().replace("\n  gpu:\n", "\n  blackwell:\n", 1))
    cli_env = {**os.environ, "HOME": str(env.home), "NO_COLOR": "1", "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    p = subprocess.run([PY, "-m", "kimi_eagle", "--inventory", str(other), "--json", "run", "vocab", "--host",
                        "blackwell", "--detach", "--no-preflight", "--no-gpu", "--", "--help"],
                       env=cli_env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    job = json.loads(p.stdout)["id"]
    r = env.cli("logs", job, "--follow")
    assert r.code == 0 and "not started from this machine" not in r.stderr, r.stderr
    r = env.cli("clean", job, "--dry-run")
    assert r.code == 0 and "not started from this machine" not in r.stderr, (r.stdout, r.stderr)


def test_jobs_started_from_several_terminals_at_once_all_stay_recorded(tmp_path):
    """Real concurrent processes recording jobs in this machine's index (jobs.json): none is lost."""
    code = ("import sys\nfrom kimi_eagle.jobs import local_index\n"
            "for i in range(25):\n    local_index.remember(f'{sys.argv[1]}-{i}', 'gpu')\n")
    cli_env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([PY, "-c", code, f"t{n}"], env=cli_env) for n in range(6)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    index = json.loads((tmp_path / "kimi-eagle" / "jobs.json").read_text())
    missing = [f"t{n}-{i}" for n in range(6) for i in range(25) if f"t{n}-{i}" not in index]
    assert not missing, missing


def test_the_inventorys_machine_dir_is_where_starts_keep_their_claims(tmp_path, sshd):
    """KIMI_EAGLE_MACHINE_DIR set in the host's `env:` (a node-local folder instead of an NFS home) reached preflight
    but not the start, which kept its claims under the login's default: the two disagreed about what the machine
    holds. Both now use the inventory's folder."""
    from kimi_eagle_host import procfs

    machine = tmp_path / "node-local"
    env = make_env(tmp_path, sshd, extra=PIPELINE, host_env={"KIMI_EAGLE_MACHINE_DIR": str(machine)})
    job = start(env, "gpu", "sleep", "60", gpu=True)
    try:
        claims = machine / procfs.boot_id() / "claims"
        held = [json.loads(p.read_text())["job_id"] for p in claims.glob("*.json")] if claims.is_dir() else []
        assert held == [job["id"]], list(machine.rglob("*"))
        r = env.cli("run", "exec", "--host", "gpu", "--detach", "--gpu", "--", "true")
        assert r.code == 1 and f"GPU job {job['id']} (exec" in r.stderr, (r.code, r.stderr)
    finally:
        assert env.cli("stop", job["id"], "--host", "gpu", "--grace", "1").code == 0
