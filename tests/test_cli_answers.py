"""What the job commands answer for a user's small mistakes and requests."""

from __future__ import annotations

import sys

from test_jobs import start, wait_state


def test_status_of_an_unknown_job_is_exit_2_like_logs_and_stop(env):
    for argv in (["status", "nosuchjob"], ["logs", "nosuchjob"], ["stop", "nosuchjob"]):
        r = env.cli(*argv, "--host", "gpu")
        assert r.code == 2, (argv, r.stdout, r.stderr)
        assert "nosuchjob" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_logs_tail_prints_exactly_n_lines(env):
    job = start(env, sys.executable, "-c", "for i in range(50): print(f'line {i}')")
    wait_state(env, job["id"], {"succeeded"})
    for n in (1, 3, 10):
        r = env.cli("logs", job["id"], "--host", "gpu", "--tail", str(n))
        assert r.code == 0, r.stderr
        lines = r.stdout.splitlines()
        assert len(lines) == n, r.stdout
    r = env.cli("logs", job["id"], "--host", "gpu", "--tail", "3")
    assert "line 49" in r.stdout.splitlines()[0] or "line 49" in r.stdout  # the end of the log, not its start


def test_logs_tail_then_follow_keeps_a_character_split_where_they_meet(env, tmp_path):
    """`logs --tail N --follow` reads the last lines up to the log's size, then follows from that byte: a log whose
    size falls inside a character (a job mid-write) must print the character once, whole, not replacement marks."""
    import os
    import subprocess
    import time
    from pathlib import Path

    from conftest import REPO

    release = tmp_path / "release"
    script = tmp_path / "split.py"
    script.write_text(f"""
import os, sys, time
out = sys.stdout.buffer
out.write("first\\n".encode() + "日".encode()[:2]); out.flush()
deadline = time.time() + 120
while not os.path.exists({str(release)!r}) and time.time() < deadline:
    time.sleep(0.05)
out.write("日".encode()[2:] + "本\\n".encode()); out.flush()
""")
    job = start(env, sys.executable, str(script))
    log = Path(job["log"])
    deadline = time.monotonic() + 60
    while not (log.exists() and log.read_bytes().endswith("日".encode()[:2])):
        assert time.monotonic() < deadline, "the job never wrote its first bytes"
        time.sleep(0.05)
    e = {**os.environ, "HOME": str(env.home), "PYTHONPATH": str(REPO), "NO_COLOR": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "kimi_eagle", "--inventory", str(env.inventory), "logs", job["id"],
                             "--host", "gpu", "--tail", "5", "--follow"], env=e, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        seen = [proc.stdout.readline() for _ in range(1)]   # printed from the tail read: the follow starts after it
        while not seen[-1].rstrip().endswith(b"first"):
            assert seen[-1] and len(seen) < 10, seen
            seen.append(proc.stdout.readline())
        release.touch()
        rest, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert "日本" in rest.decode() and "\ufffd" not in rest.decode(), (rest, err)
