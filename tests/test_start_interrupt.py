"""Ctrl-C during `run`'s start (a real SIGINT to the whole process group, as a terminal sends it, at moments spread
over the start): from the user's side the start is whole or nothing. Either the job's id is in jobs.json and was
printed, or no job ran and no job folder is left; never a job running untracked, holding the GPUs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import REPO, make_env

PY = sys.executable


def _run(env, host):
    cli_env = {**os.environ, "HOME": str(env.home), "NO_COLOR": "1", "COLUMNS": "200", "PYTHONPATH": str(REPO)}
    cli_env.pop("KIMI_EAGLE_INVENTORY", None)
    return subprocess.Popen([PY, "-m", "kimi_eagle", "--inventory", str(env.inventory), "run", "exec", "--host", host,
                             "--detach", "--gpu", "--no-preflight", "--", "sleep", "60"],
                            env=cli_env, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def _job_dirs(workdir):
    runs = workdir / "runs"
    return {p.name: p for p in runs.iterdir() if p.is_dir()} if runs.is_dir() else {}


@pytest.mark.parametrize("host", ["local", "gpu"])
def test_ctrl_c_during_the_start_leaves_a_recorded_job_or_nothing(tmp_path, sshd, host):
    env = make_env(tmp_path, sshd)
    workdir = env.workdir if host == "gpu" else tmp_path / "localwork"
    index = env.home / ".cache" / "kimi-eagle" / "jobs.json"
    t0 = time.monotonic()
    first = _run(env, host)
    out, err = first.communicate(timeout=120)
    took = time.monotonic() - t0
    assert first.returncode == 0, err
    assert env.cli("stop", out.strip(), "--host", host, "--grace", "1").code == 0
    seen = set(_job_dirs(workdir))
    outcomes = []
    for fraction in (0.45, 0.55, 0.65, 0.72, 0.78, 0.84, 0.88, 0.92, 0.96, 1.0):
        run = _run(env, host)
        time.sleep(took * fraction)
        os.killpg(run.pid, signal.SIGINT)
        out, err = run.communicate(timeout=120)
        assert "Traceback" not in err, err
        # 0: done before the signal; 130: interrupted; -2: the signal came as Python was exiting, all shown
        assert run.returncode in (0, 130, -2), (fraction, run.returncode, err)
        new = {name: d for name, d in _job_dirs(workdir).items() if name not in seen}
        recorded = json.loads(index.read_text()) if index.exists() else {}
        for name, d in new.items():
            # A folder is a started job (never half-made) whose id was recorded here and shown to the user.
            assert (d / "meta.json").is_file(), (fraction, name, sorted(p.name for p in d.iterdir()), err)
            assert (recorded.get(name) or {}).get("host") == host and name in out + err, (fraction, name, out, err)
            assert env.cli("stop", name, "--host", host, "--grace", "1").code == 0
        seen |= set(new)
        outcomes.append((run.returncode, bool(new)))
    # Both ends of the start were hit: some runs were cut off before the job existed, some after.
    assert (130, False) in outcomes, outcomes
