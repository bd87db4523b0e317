"""Group jobs that never report what did not happen (two real sshd "hosts" on 127.0.0.1, separate workdirs).

A resume after the settings changed runs every shard again and says why; two identical resumes at once start a
missing shard once and keep its record; a torchrun group with a host that refuses to start starts nowhere.
"""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

from test_group_jobs import DDP, PY, done_ranks, gid_of, group_env, servers, shard_script, wait_group  # noqa: F401


def shards_cmd(tmp_path, out, sleep=0.0):
    return ["run", "exec", "--group", "pair", "--mode", "shards", "--", PY, shard_script(tmp_path, sleep), str(out)]


def test_a_resume_after_the_settings_changed_runs_every_shard_again(tmp_path, servers):
    env = group_env(tmp_path, servers)
    out = tmp_path / "shards"
    out.mkdir()
    (out / "fail-1").touch()
    cmd = shards_cmd(tmp_path, out)
    assert env.cli(*cmd).code == 1
    (out / "fail-1").unlink()
    # The inventory changes host a's environment: a's shard was made with other settings.
    env.inventory.write_text(env.inventory.read_text().replace('OMP_NUM_THREADS: "1"', 'OMP_NUM_THREADS: "2"', 1))
    r = env.cli(*cmd)
    assert r.code == 0, (r.stdout, r.stderr)
    assert "succeeded before" not in r.stderr
    assert "[a] shard 0 of 2" in r.stdout and "[b] shard 1 of 2" in r.stdout
    assert re.search(r"not resuming g-\S+: a's job script .* changed since", r.stderr), r.stderr
    assert done_ranks(out) == [0, 0, 1]  # a's shard ran again
    # Nothing changed since: a real resume, nothing to do.
    again = env.cli(*cmd)
    assert again.code == 0 and again.stderr.count("succeeded before") == 2, again.stderr


def test_two_identical_resumes_at_once_start_the_missing_shard_once(tmp_path, servers):
    env = group_env(tmp_path, servers)
    for round_ in range(3):
        out = tmp_path / f"shards-{round_}"
        out.mkdir()
        (out / "fail-1").touch()
        cmd = shards_cmd(tmp_path, out, sleep=3.0)
        first = env.cli(*cmd)
        assert first.code == 1, first.stderr
        gid = gid_of(first.stderr)
        (out / "fail-1").unlink()
        with ThreadPoolExecutor(2) as pool:
            runs = list(pool.map(lambda _: env.cli(*cmd[:2], "--detach", *cmd[2:]), range(2)))
        assert all(r.code == 0 for r in runs), [(r.stdout, r.stderr) for r in runs]
        started = [line for r in runs for line in r.stderr.splitlines() if line.startswith("[b] started job")]
        assert len(started) == 1, [r.stderr for r in runs]
        b_job = started[0].split()[3].rstrip(":")
        st = wait_group(env, gid)
        assert st["state"] == "succeeded", st
        assert {m["host"]: m["job"]["id"] for m in st["members"]}["b"] == b_job  # the started job is the recorded one
        assert done_ranks(out) == [0, 1]
        third = env.cli(*cmd[:2], "--detach", *cmd[2:])
        assert third.code == 0 and third.stderr.count("succeeded before") == 2, third.stderr


def _running_jobs(env, host):
    r = env.cli("--json", "status", "--host", host)
    return [j for j in r.json()["jobs"] if j["state"] == "running"]


def test_a_torchrun_group_starts_on_every_node_or_on_none(tmp_path, servers):
    env = group_env(tmp_path, servers)
    # b's GPU is taken by a running job of its own: nothing of the group may start, and `run` must not hang.
    hold = env.cli("--json", "run", "exec", "--host", "b", "--gpu", "--detach", "--", PY, "-c", "import time; time.sleep(300)")
    assert hold.code == 0, hold.stderr
    try:
        r = env.cli("run", "exec", "--group", "pair", "--mode", "torchrun", "--gpu", "--", DDP, timeout=240)
        assert r.code == 1, (r.stdout, r.stderr)
        assert "b: GPU job" in r.stderr and "is running" in r.stderr
        assert _running_jobs(env, "a") == []
    finally:
        env.cli("stop", hold.json()["id"], "--host", "b", "--grace", "1")
    # b cannot take the job at all (its runs folder is a file): a, started first, is stopped again.
    (tmp_path / "work-b").mkdir(exist_ok=True)
    (tmp_path / "work-b" / "runs").rename(tmp_path / "runs-b-was")
    (tmp_path / "work-b" / "runs").write_text("not a folder\n")
    r = env.cli("run", "exec", "--group", "pair", "--mode", "torchrun", "--", DDP, timeout=240)
    assert r.code == 1, (r.stdout, r.stderr)
    assert "stopped again: b did not start" in r.stderr, r.stderr
    assert _running_jobs(env, "a") == []
    gid = gid_of(r.stderr)
    st = env.cli("--json", "status", gid).json()
    assert st["state"] != "running" and {m["host"]: m["state"] for m in st["members"]}["a"] == "stopped", st
