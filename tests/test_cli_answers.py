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
