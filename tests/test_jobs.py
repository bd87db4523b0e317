"""Detached jobs on the real sshd: survival, exit codes, log resume, stop, GPU lock, lost state."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, make_env

PY = sys.executable


def start(env, *cmd, host="gpu", gpu=False):
    r = env.cli("--json", "run", "exec", "--host", host, "--detach", "--gpu" if gpu else "--no-gpu", "--", *cmd)
    assert r.code == 0, (r.stdout, r.stderr)
    return r.json()


def wait_state(env, job_id, states, host="gpu", timeout=60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = env.cli("--json", "status", job_id, "--host", host)
        job = r.json()["jobs"][0]
        if job["state"] in states:
            return job
        time.sleep(0.2)
    raise AssertionError(f"job {job_id} never reached {states}: {job}")


def write_script(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


def held_script(path: Path, release: Path, first: str, then: str, exit_code: int = 0) -> str:
    """A job that prints `first`, holds until the file `release` exists (at most 300 s), prints `then` and exits
    `exit_code`: the test decides when it goes on."""
    return write_script(path, f"""
import os, sys, time
print({first!r}, flush=True)
deadline = time.monotonic() + 300
while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
    time.sleep(0.02)
print({then!r}, flush=True)
sys.exit({exit_code})
""")


def cli_process(env, *args, **popen) -> subprocess.Popen:
    """The controller's CLI running in the background (a follower to read line by line, to signal or to kill), text
    pipes for its stdout and stderr."""
    e = {**os.environ, "HOME": str(env.home), "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    return subprocess.Popen([PY, "-m", "kimi_eagle", "--inventory", str(env.inventory), *args], env=e,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def lines_script(tmp_path, n, delay, seed=7, hold_at=None, release=None):
    """A job that prints n deterministic lines with multi-byte characters, slowly. With hold_at, it stops after that
    many lines until the file `release` exists (at most 300 s): the test decides when the rest comes."""
    return write_script(tmp_path / "lines.py", f"""
import os, random, sys, time
rng = random.Random({seed})
alphabet = "aé日本語✓🙂ßж"
for i in range({n}):
    if i == {hold_at!r}:
        deadline = time.monotonic() + 300
        while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
            time.sleep(0.02)
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40)))
    sys.stdout.write(f"line {{i}} {{text}}\\n")
    sys.stdout.flush()
    time.sleep({delay})
""")


def to_the_end(follower: subprocess.Popen, first: str) -> tuple[str, str]:
    """A follower's stdout and stderr once it ended, its `first` line already read: read through the same buffered
    stream (communicate() would skip what readline() already buffered)."""
    out = first + follower.stdout.read()
    err = follower.stderr.read()
    follower.wait(timeout=120)
    return out, err


def expected_lines(n, seed=7):
    rng = random.Random(seed)
    alphabet = "aé日本語✓🙂ßж"
    return [f"line {i} " + "".join(rng.choice(alphabet) for _ in range(rng.randint(1, 40))) for i in range(n)]


@pytest.mark.parametrize("host", ["gpu", "local"])
def test_exit_codes_are_recorded_for_success_failure_and_signal(env, host):
    ok = start(env, PY, "-c", "print('hello from the job')", host=host)
    fail = start(env, PY, "-c", "import sys; sys.exit(3)", host=host)
    killed = start(env, PY, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)", host=host)
    assert wait_state(env, ok["id"], {"succeeded"}, host)["exit_code"] == 0
    assert wait_state(env, fail["id"], {"failed"}, host)["exit_code"] == 3
    assert wait_state(env, killed["id"], {"failed"}, host)["exit_code"] == 128 + signal.SIGKILL
    logs = env.cli("logs", ok["id"], "--host", host)
    assert logs.code == 0 and f"[{host}] hello from the job" in logs.stdout
    assert env.cli("logs", fail["id"]).code == 1  # the host is remembered locally; exit 1 for a failed job
    # The exit code file is written by the job itself on the host.
    assert (Path(ok["run_dir"]) / "exit_code").read_text().strip() == "0"


def test_job_survives_the_controller_being_killed(env, tmp_path):
    script = lines_script(tmp_path, 40, 0.05)
    proc = cli_process(env, "run", "exec", "--host", "gpu", "--", PY, script)
    # Wait until the follower printed something, then kill the controller hard.
    first = proc.stdout.readline()
    assert first.startswith("[gpu] ")
    proc.kill()
    proc.wait()
    job_id = json.loads(env.cli("--json", "status", "--host", "gpu").stdout)["jobs"][-1]["id"]
    r = env.cli("logs", job_id, "--follow")
    assert r.code == 0, r.stderr
    got = [ln[len("[gpu] "):] for ln in r.stdout.splitlines() if ln.startswith("[gpu] line ")]
    assert got == expected_lines(40)


def test_job_survives_sshd_restart_and_follow_resumes_exactly_once(env, sshd, tmp_path):
    # The job holds after its first half until the test has dropped the connection: the drop always lands while it
    # still runs, and the second half is written while the follower reconnects (however slow the box).
    n, release = 600, tmp_path / "release"
    script = lines_script(tmp_path, n, 0, hold_at=n // 2, release=release)
    job = start(env, PY, script)
    follower = cli_process(env, "logs", job["id"], "--follow")
    # Once the follower streams, drop every SSH connection and restart the server.
    first = follower.stdout.readline()
    assert first.startswith("[gpu] ")
    sshd.restart()
    assert wait_state(env, job["id"], {"running", "succeeded", "failed"})["state"] == "running"
    release.touch()
    out, err = to_the_end(follower, first)
    assert follower.returncode == 0, err
    assert "reconnecting" in err  # the drop really happened mid-stream
    assert wait_state(env, job["id"], {"succeeded"})["exit_code"] == 0
    got = [ln[len("[gpu] "):] for ln in out.splitlines() if ln.startswith("[gpu] line ")]
    assert got == expected_lines(n)  # every line exactly once, multi-byte characters intact


def test_a_json_follow_counts_an_outage_once_however_many_tries_it_took(env, sshd, tmp_path):
    """The host's sshd down for seconds mid-stream: the follower tries again and again (each try refused) until it is
    back. The user was told of one outage (one "reconnecting" line) and --json's `reconnects` says 1 as well, where
    it counted every try; `reconnect_attempts` keeps that raw count."""
    n, release = 20, tmp_path / "release"
    job = start(env, PY, lines_script(tmp_path, n, 0, hold_at=n // 2, release=release))
    follower = cli_process(env, "--json", "logs", job["id"], "--follow")
    first = follower.stdout.readline()
    assert first.startswith("{"), first
    sshd.stop()
    time.sleep(2.5)   # the tries 0.5 s and 1.5 s after the drop find the port closed; the one at 3.5 s gets through
    sshd.start()
    release.touch()
    out, err = to_the_end(follower, first)
    assert follower.returncode == 0, err
    result = json.loads(out.splitlines()[-1])
    assert err.count("reconnecting") == 1, err
    assert result["reconnects"] == 1 and result["reconnect_attempts"] >= 3, result
    assert result["job"]["state"] == "succeeded"


def test_stop_kills_a_three_level_process_tree(env, tmp_path):
    pids = tmp_path / "pids"
    script = write_script(tmp_path / "tree.py", f"""
import os, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", '''
import os, subprocess, sys, time, signal
signal.signal(signal.SIGTERM, signal.SIG_IGN)   # the middle level ignores SIGTERM
g = subprocess.Popen(["sleep", "300"])
open({str(pids)!r}, "w").write(f"{{os.getppid()}} {{os.getpid()}} {{g.pid}}")
time.sleep(300)
'''])
time.sleep(300)
""")
    job = start(env, PY, script)
    deadline = time.monotonic() + 20
    while not pids.exists() or len(pids.read_text().split()) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    tree = [int(p) for p in pids.read_text().split()]
    r = env.cli("--json", "stop", job["id"], "--host", "gpu", "--grace", "1")
    assert r.code == 0, r.stderr
    data = r.json()
    assert data["stopped"] and data["remaining"] == [] and data["sent"]["KILL"] >= 1
    for pid in tree:
        assert not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    assert wait_state(env, job["id"], {"stopped"})["state"] == "stopped"
    assert env.cli("status", job["id"], "--host", "gpu").code == 4


def gone(pid: int) -> bool:
    return not Path(f"/proc/{pid}").exists() or Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


@pytest.mark.parametrize("code", [0, 1])
def test_a_job_whose_shell_exited_leaving_a_process_is_ending_and_keeps_its_claims_until_stop(env, tmp_path, code):
    """A step that exits and leaves a child behind (an engine's worker, `cmd &`): while the child lives the job is
    `ending` with its shell's exit code (which `status` exits with), its GPU claim holds and `stop` ends the child;
    then the job is its shell's verdict, not `stopped`, and the next GPU job starts."""
    pidfile = tmp_path / "child"
    job = start(env, "bash", "-c", f"sleep 60 & echo $! > {pidfile}; exit {code}", gpu=True)
    got = wait_state(env, job["id"], {"ending", "succeeded", "failed"})
    child = int(pidfile.read_text())
    assert got["state"] == "ending" and got["exit_code"] == code and got["left"] == [child], got
    st = env.cli("status", job["id"], "--host", "gpu")
    assert st.code == code and "ending" in st.stdout, st.stdout
    assert f"processes it left still run (pids {child})" in st.stdout and f"kimi-eagle stop {job['id']}" in st.stdout
    assert f"processes it started still run (pids {child})" in env.cli("logs", job["id"], "--host", "gpu").stdout
    second = env.cli("run", "exec", "--host", "gpu", "--detach", "--gpu", "--", "true")
    assert second.code == 1 and f"GPU job {job['id']}" in second.stderr, second.stderr
    assert "has exited, but processes it left hold the GPUs" in second.stderr
    assert f"kimi-eagle stop {job['id']}" in second.stderr
    after_state = "succeeded" if code == 0 else "failed"
    r = env.cli("stop", job["id"], "--host", "gpu", "--grace", "1")
    assert r.code == 0 and f"had exited with code {code} ({after_state}); stopped the 1 processes it left" in r.stdout, r.stdout
    assert gone(child)
    after = env.cli("--json", "status", job["id"], "--host", "gpu").json()["jobs"][0]
    assert (after["state"], after["exit_code"], after["left"]) == (after_state, code, [])
    nxt = start(env, "true", gpu=True)  # the claim ended with the processes
    assert wait_state(env, nxt["id"], {"succeeded", "failed"})["state"] == "succeeded"


def test_a_job_leaving_a_child_is_never_seen_finished_while_its_shell_exits(env, tmp_path):
    """The shell records its code in its exit trap and lives on for a moment after: a status in between must not
    call the job finished (and free its claims) while what it left runs. Read as fast as the host can while the
    shell exits (it waits for the test to be reading), 3 rounds."""
    from kimi_eagle_host.ops.jobs import job_state

    for round_ in range(3):
        release = tmp_path / f"release{round_}"
        job = start(env, "bash", "-c", f"sleep 60 & while [ ! -e {release} ]; do sleep 0.02; done", gpu=True)
        seen = job_state(job["run_dir"])
        release.touch()
        deadline = time.monotonic() + 60
        while seen["state"] == "running" and time.monotonic() < deadline:
            seen = job_state(job["run_dir"])
        assert seen["state"] == "ending" and seen["exit_code"] == 0 and seen["left"], seen
        assert env.cli("stop", job["id"], "--host", "gpu", "--grace", "1").code == 0


def test_run_ends_with_its_shell_and_names_what_it_left(env, tmp_path):
    """`run` (and `logs --follow`) ends when the job's shell has exited, with its code: a child on its way out is
    waited for a few seconds; one that stays is named (the job is `ending`), never waited for without end."""
    brief = env.cli("run", "exec", "--host", "gpu", "--no-gpu", "--", "bash", "-c", "sleep 1 & exit 0")
    assert brief.code == 0 and "succeeded (exit code 0)" in brief.stderr and "ending" not in brief.stderr, brief.stderr
    for code in (0, 1):
        pidfile = tmp_path / f"child{code}"
        t0 = time.monotonic()
        r = env.cli("run", "exec", "--host", "gpu", "--no-gpu", "--", "bash", "-c",
                    f"sleep 120 & echo $! > {pidfile}; exit {code}", timeout=100)
        child = int(pidfile.read_text())
        assert r.code == code and time.monotonic() - t0 < 100, (r.code, r.stderr)
        assert f"ending (exit code {code})" in r.stderr and f"processes it left still run (pids {child})" in r.stderr
        job_id = r.stderr.split("started job ")[1].split()[0]
        assert env.cli("stop", job_id, "--host", "gpu", "--grace", "1").code == 0 and gone(child)


def test_status_of_many_jobs_reads_proc_once(tmp_path, monkeypatch, capsys):
    """Every finished job is checked for processes it left, and the machine's claims for the GPU holder: one read of
    /proc for the whole `status` call, however many jobs (the host's ops.jobs, on real jobs here)."""
    from kimi_eagle_host.ops import jobs

    monkeypatch.setenv("KIMI_EAGLE_MACHINE_DIR", str(tmp_path / "machine"))
    runs = tmp_path / "runs"
    steps = {f"job{i:02d}": "exit 0" for i in range(12)} | {"leaver": "sleep 60 & exit 0", "gpu": "sleep 60"}
    for job_id, body in steps.items():
        (runs / job_id).mkdir(parents=True)
        (runs / job_id / "job.sh").write_text(f"trap 'echo $? > {runs / job_id}/exit_code' EXIT\n"
                                              f"export KIMI_EAGLE_JOB_ID={job_id}\n{body}\n")
        argv = ["--runs-dir", str(runs), "start", "--job-id", job_id, "--step", "exec", "--host", "h",
                "--workdir", str(tmp_path)] + (["--gpu"] if job_id == "gpu" else [])
        assert jobs.main(argv) == 0
    deadline = time.monotonic() + 30
    while len(list(runs.glob("*/exit_code"))) < 13:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    listdir, scans = os.listdir, []
    monkeypatch.setattr(os, "listdir", lambda p=".": (scans.append(p) if p == "/proc" else None) or listdir(p))
    capsys.readouterr()
    try:
        assert jobs.main(["--runs-dir", str(runs), "status"]) == 0
        doc = json.loads(capsys.readouterr().out)
        assert scans == ["/proc"]
        states = {j["id"]: j["state"] for j in doc["jobs"]}
        assert states == {**{f"job{i:02d}": "succeeded" for i in range(12)}, "leaver": "ending", "gpu": "running"}
        assert doc["lock"]["job_id"] == "gpu"
    finally:
        monkeypatch.setattr(os, "listdir", listdir)
        for job_id in ("leaver", "gpu"):
            jobs.main(["--runs-dir", str(runs), "stop", "--job", job_id, "--grace", "1"])


def test_gpu_lock_refuses_a_second_gpu_job(env):
    first = start(env, "sleep", "60", gpu=True)
    r = env.cli("run", "exec", "--host", "gpu", "--detach", "--gpu", "--", "true")
    assert r.code == 1
    assert first["id"] in r.stderr and "exec" in r.stderr and "started" in r.stderr
    assert f"kimi-eagle stop {first['id']}" in r.stderr
    # A CPU job is not blocked by the lock.
    cpu = start(env, "true")
    assert wait_state(env, cpu["id"], {"succeeded"})
    assert env.cli("stop", first["id"], "--host", "gpu", "--grace", "1").code == 0
    second = start(env, "true", gpu=True)
    assert wait_state(env, second["id"], {"succeeded"})


def test_status_reports_lost_for_a_reused_pid(env):
    job = start(env, "sleep", "60")
    run_dir = Path(job["run_dir"])
    other = subprocess.Popen(["sleep", "60"])
    try:
        # The job shell dies without its trap (SIGKILL) and its pid now names another process.
        os.killpg(job["pgid"], signal.SIGKILL)
        (run_dir / "pid").write_text(f"{other.pid}\n")
        got = wait_state(env, job["id"], {"lost", "failed", "succeeded"})
        assert got["state"] == "lost" and got["exit_code"] is None
    finally:
        other.kill()


@pytest.mark.parametrize("record", ["with-start-time", "older-record"])
def test_a_dead_jobs_group_number_given_to_another_group_is_not_the_jobs(env, record):
    """A job killed whole (no exit code), whose number the kernel later gives to a process that leads a group of
    its own (an sshd session, another user's job): the job is lost, `stop` signals nothing of that group, and
    gpu-reset counts that group's GPU holders as foreign. A record from before start times were kept is told
    apart by the job script in its shell's command line."""
    from kimi_eagle_host.ops.gpu_reset import classify, load_job_pgids

    job = start(env, "sleep", "60")
    run_dir = Path(job["run_dir"])
    stranger = subprocess.Popen(["sleep", "60"], start_new_session=True)  # its own session and group
    try:
        os.killpg(job["pgid"], signal.SIGKILL)
        # The records now name the stranger's number, as they would once the kernel reused it.
        meta = json.loads((run_dir / "meta.json").read_text())
        assert meta["start_ticks"] > 0
        meta["pgid"] = stranger.pid
        if record == "older-record":
            del meta["start_ticks"]
        (run_dir / "meta.json").write_text(json.dumps(meta))
        for name in ("pid", "pgid"):
            (run_dir / name).write_text(f"{stranger.pid}\n")
        got = wait_state(env, job["id"], {"lost", "running", "failed", "succeeded"})
        assert got["state"] == "lost" and got["pgid"] is None
        assert env.cli("logs", job["id"], "--host", "gpu").code == 4
        r = env.cli("--json", "stop", job["id"], "--host", "gpu", "--grace", "1")
        assert r.code == 0 and r.json()["stopped"] is False, r.stdout
        time.sleep(0.5)
        assert stranger.poll() is None, "stop signalled the group that now has the job's number"
        pgids = load_job_pgids(str(run_dir.parent))
        assert stranger.pid not in pgids
        assert classify(stranger.pid, stranger.pid, stranger.pid, pgids, str(run_dir.parent))[0] == "foreign"
    finally:
        stranger.kill()
        stranger.wait()


def test_a_start_under_an_id_the_host_holds_leaves_that_job_alone(env, monkeypatch):
    """Two terminals drawing the same job id (the same step in the same second, and the same random part): the host
    refuses the second start, and the first job stays recorded, in its folder, and is what `stop` ends."""
    from kimi_eagle.config import inventory
    from kimi_eagle.errors import CommandError
    from kimi_eagle.hosts.session import HostSession
    from kimi_eagle.jobs import direct

    monkeypatch.setenv("HOME", str(env.home))
    job_id = "20261207-030000-exec-0a1b2c3d"
    host = inventory.load(env.inventory).hosts["gpu"]
    with HostSession(host) as session:
        first = direct.start(session, "exec", ["sleep", "60"], gpu=False, job_id=job_id)
        with pytest.raises(CommandError, match=f"job id {job_id} is in use"):
            direct.start(session, "exec", ["sleep", "61"], gpu=False, job_id=job_id)
    run_dir = Path(first.run_dir)
    assert run_dir.is_dir() and json.loads((run_dir / "meta.json").read_text())["started_at"] == first.started_at
    assert wait_state(env, job_id, {"running"})["pid"] == first.pid
    r = env.cli("--json", "stop", job_id, "--host", "gpu", "--grace", "1")
    assert r.code == 0 and r.json()["stopped"] and first.pid in r.json()["signalled"], r.stdout
    assert not Path(f"/proc/{first.pid}").exists() or Path(f"/proc/{first.pid}/stat").read_text().split()[2] == "Z"


def test_bad_step_and_missing_command_are_usage_errors(env):
    r = env.cli("run", "bogus", "--host", "gpu")
    assert r.code == 2 and "unknown step 'bogus'" in r.stderr
    r = env.cli("run", "exec", "--host", "gpu")
    assert r.code == 2 and "needs a command" in r.stderr
    assert not (env.workdir / "runs").exists()  # nothing half-done on the host


def test_ctrl_c_detaches_and_the_job_keeps_running(env, tmp_path):
    # The job waits after its first line until the test has seen the detach, then ends on its own.
    release = tmp_path / "release"
    script = held_script(tmp_path / "waits.py", release, "line 0", "line 1")
    # Ctrl-C reaches the CLI as it reaches a terminal user's: a suite started in the background of a script (`cmd &`
    # without job control) passes SIGINT on ignored, and a Python started so never turns it into KeyboardInterrupt.
    proc = cli_process(env, "run", "exec", "--host", "gpu", "--", PY, script,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert proc.stdout.readline().startswith("[gpu] ")
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    job_id = json.loads(env.cli("--json", "status", "--host", "gpu").stdout)["jobs"][-1]["id"]
    assert "detached" in err and f"kimi-eagle logs {job_id} --follow" in err and f"kimi-eagle stop {job_id}" in err
    assert wait_state(env, job_id, {"running"})["state"] == "running"
    release.touch()   # the detached job goes on to its end on its own
    assert wait_state(env, job_id, {"succeeded", "failed"})["state"] == "succeeded"
    assert "line 1" in env.cli("logs", job_id, "--host", "gpu").stdout


def test_a_follow_survives_a_second_drop_long_after_the_first(env, sshd, tmp_path):
    """Two real drops (the sshd restarted, every connection cut) farther apart than the follower's give-up time, with
    good streaming in between (longer than a connection must last to count as working): each drop is retried from a
    fresh clock and the first backoff, and every line comes.
    The clock of the first drop ran on, so the second drop gave up at once ("connection lost for ...")."""
    import threading

    from kimi_eagle.config import inventory
    from kimi_eagle.jobs import log_stream

    r1, r2 = tmp_path / "r1", tmp_path / "r2"
    script = write_script(tmp_path / "stages.py", f"""
import os, time
def wait(p):
    deadline = time.monotonic() + 300
    while not os.path.exists(p) and time.monotonic() < deadline:
        time.sleep(0.02)
print("stage 1", flush=True)
wait({str(r1)!r})
print("stage 2", flush=True)
wait({str(r2)!r})
print("stage 3", flush=True)
""")
    job = start(env, PY, script)
    host = inventory.load(env.inventory).hosts["gpu"]
    lines, waits, ended = [], [], {}

    def follow():
        try:
            ended["result"] = log_stream.follow(host, job["id"], lambda kind, text: lines.append(text), give_up_after=2.0,
                                                stable_after=2.0, on_reconnect=lambda n, wait: waits.append(wait))
        except Exception as e:  # noqa: BLE001 - the test reports it
            ended["error"] = e

    def until(cond, what):
        deadline = time.monotonic() + 60
        while not cond():
            assert time.monotonic() < deadline and "error" not in ended, (what, lines, waits, ended)
            time.sleep(0.05)

    t = threading.Thread(target=follow, daemon=True)
    t.start()
    until(lambda: "stage 1" in lines, "the first line")
    sshd.restart()                           # drop 1
    r1.touch()
    until(lambda: "stage 2" in lines, "a line streamed after reconnecting")
    after_first = len(waits)
    assert after_first >= 1, waits           # the drop really happened
    time.sleep(3.0)                          # longer than give_up_after, streaming fine all along
    sshd.restart()                           # drop 2
    until(lambda: len(waits) > after_first, "a retry of the second drop")
    r2.touch()
    t.join(60)
    assert "error" not in ended, ended
    got = [ln for ln in lines if ln.startswith("stage ")]
    assert ended["result"].job.state == "succeeded" and got == ["stage 1", "stage 2", "stage 3"], (ended, lines)
    assert waits[after_first] == waits[0] == 0.5, waits  # the backoff starts afresh too


def cutting_python(tmp_path, sshd, when: str, command: str = "start", armed: Path | None = None) -> str:
    """The host's `python:`: the real one, except that `ops.jobs COMMAND` loses its connection (the sshd processes
    it runs under are killed, tests/sshd.py cutter) before it runs, or after it ran and before its answer went back.
    With `armed`, only the first such call once that file exists (it is taken away)."""
    cutter = sshd.cutter(tmp_path / "cut-connection")
    wrapper = tmp_path / "cutting-python"
    wrapper.write_text(f"""#!{PY}
import os, subprocess, sys
args = sys.argv[1:]

def armed():
    if {str(armed) if armed else None!r} is None:
        return True
    try:
        os.rename({str(armed)!r}, {str(armed)!r} + ".taken")   # one caller wins
        return True
    except OSError:
        return False

if "kimi_eagle_host.ops.jobs" in args and {command!r} in args and armed():
    if {when!r} == "after":
        subprocess.run([{PY!r}, *args], stdout=subprocess.DEVNULL)  # the job starts; its answer never goes back
    subprocess.run([{str(cutter)!r}])
    sys.exit(0)
os.execv({PY!r}, [{PY!r}, *args])
""")
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.parametrize("cut", ["after", "before"])
def test_a_connection_lost_during_the_start_names_the_job_and_keeps_it_recorded(tmp_path, sshd, cut):
    """A real drop while the host runs the start: the job is in this machine's index before the host is asked, the
    error names it, its host and what shows whether it began; `status JOB` (no --host) then finds it running, or
    says it never began. The job ran on unnamed and unrecorded (exit 5, "connection lost while running a command")."""
    env = make_env(tmp_path, sshd, python=cutting_python(tmp_path, sshd, cut))
    r = env.cli("run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", "sleep", "60")
    assert r.code == 5, (r.stdout, r.stderr)
    (job,) = [p.name for p in (env.workdir / "runs").iterdir() if p.is_dir()]
    assert f"job {job} may have started on gpu" in r.stderr and f"kimi-eagle status {job}" in r.stderr, r.stderr
    st = env.cli("--json", "status", job)
    if cut == "after":
        assert st.code == 3 and st.json()["jobs"][0]["state"] == "running", (st.stdout, st.stderr)
        assert env.cli("stop", job, "--grace", "1").code == 0
    else:
        assert st.code == 2 and f"no job {job} on this host" in st.stderr and "it did not start" in st.stderr, st.stderr


def test_a_follower_whose_first_call_loses_its_connection_reconnects(tmp_path, sshd):
    """The drop lands in `logs --follow`'s first call, after the host let it in and before its first answer (a
    slow box, a link that drops early): the link worked, so it is retried like any later drop, and every line
    comes once. It used to end at once with exit 5 ("connection lost while running a command"), as for a host that
    never answered (tests/test_follow_fail_fast.py), while the job went on."""
    armed = tmp_path / "cut-the-next-status"
    env = make_env(tmp_path, sshd, python=cutting_python(tmp_path, sshd, "before", "status", armed))
    n, release = 200, tmp_path / "release"
    job = start(env, PY, lines_script(tmp_path, n, 0, hold_at=n // 2, release=release))
    armed.touch()
    follower = cli_process(env, "logs", job["id"], "--follow")
    deadline = time.monotonic() + 60
    while armed.exists() and follower.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    release.touch()
    out, err = to_the_end(follower, "")
    assert not armed.exists() and follower.returncode == 0, (follower.returncode, err)
    assert "reconnecting" in err, err
    got = [ln[len("[gpu] "):] for ln in out.splitlines() if ln.startswith("[gpu] line ")]
    assert got == expected_lines(n)


def test_a_flapping_link_is_retried_ever_less_often_and_told_once(env, sshd, tmp_path):
    """A link that comes up and drops again at once (each connection is cut as soon as its `tail` runs): `logs
    --follow` retries with waits that double instead of every half second forever, says one line for the outage,
    and still ends with the job's exit code once the link holds. It once printed a line per attempt and retried
    every 0.5 s: every connection reached the host, which reset the backoff."""
    import threading

    release = tmp_path / "release"
    script = held_script(tmp_path / "held.py", release, "before", "after", exit_code=3)
    job = start(env, PY, script)
    follower = cli_process(env, "logs", job["id"], "--follow")
    cuts, stop = [], threading.Event()

    def flap():   # the link: every follow connection dies as soon as it streams
        while not stop.is_set() and len(cuts) < 5:
            if sshd.drop_connections_running("tail"):
                cuts.append(time.monotonic())
            time.sleep(0.02)

    flapper = threading.Thread(target=flap, daemon=True)
    try:
        flapper.start()
        flapper.join(90)
    finally:
        stop.set()
    release.touch()                       # the link holds from now on
    out, err = follower.communicate(timeout=120)
    gaps = [b - a for a, b in zip(cuts, cuts[1:])]
    assert len(cuts) == 5, (cuts, err)
    # Each wait twice the last: 0.5, 1, 2, 4 s between attempts (plus the time to connect), not 0.5 s each time. The
    # last gap against the first (4 s against 0.5); the ones between differ by less than a loaded box's connect
    # times do (2026-12-07, four workers: 4.6, 3.6, 4.5, 10.5 s).
    assert gaps[-1] - gaps[0] > 2.5 and gaps[-1] == max(gaps), gaps
    assert err.count("connection lost") == 1, err
    assert follower.returncode == 1, (out, err)   # the job's failure, after every line
    assert "[gpu] before" in out and "[gpu] after" in out, out
