"""kimi_eagle.api used from Python against the real sshd: the CLI's operations, returning result objects."""

from __future__ import annotations

import sys
import time

import pytest

from kimi_eagle.api import Controller, JobList, Started, Stopped
from kimi_eagle.errors import ConfigError


@pytest.fixture
def ke(env, monkeypatch):
    # The API reads ~/.ssh and ~/.cache like the CLI; this test's home, not the user's.
    monkeypatch.setenv("HOME", str(env.home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    return Controller(str(env.inventory))


def test_check_reports_what_the_host_has(ke):
    [o] = ke.check("gpu")
    assert o.ok and o.host == "gpu", o.error
    assert o.value["python"] == ".".join(map(str, sys.version_info[:3]))
    assert o.value["packages"]["torch"]  # this interpreter has torch; a missing one is None


def test_upload_sends_changed_files_only(ke, env, tmp_path):
    src = tmp_path / "data"
    src.mkdir()
    (src / "a.txt").write_text("first")
    [o] = ke.upload([src], "in", host="gpu")
    assert o.ok, o.error
    assert o.value.changed == ["data/a.txt"] and (env.workdir / "in" / "data" / "a.txt").read_text() == "first"
    [again] = ke.upload([src], "in", host="gpu")
    assert again.value.changed == [] and again.value.unchanged == ["data/a.txt"] and again.value.bytes_sent == 0


def test_a_job_runs_is_listed_followed_and_stopped(ke, env, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import time\nprint('hello from the api', flush=True)\ntime.sleep(120)\n")
    started = ke.run("exec", host="gpu", extra=[sys.executable, str(script)], gpu=False)
    assert isinstance(started, Started) and started.host == "gpu" and started.session is None

    lines = []
    deadline = time.monotonic() + 30
    while "hello from the api" not in lines and time.monotonic() < deadline:
        lines.clear()
        followed = ke.follow(started.job.id, lambda label: lambda kind, text: lines.append(text), follow=False)
        time.sleep(0.3)
    assert "hello from the api" in lines and followed.job.state == "running"

    listed = ke.status(started.job.id)
    assert isinstance(listed, JobList) and [j.id for j in listed.jobs] == [started.job.id]
    assert listed.jobs[0].state == "running" and listed.errors == {}
    assert started.job.id in [j.id for j in ke.status().jobs]  # every host's jobs; `local` has none

    stopped = ke.stop(started.job.id, grace=2)
    assert isinstance(stopped, Stopped) and stopped.summary().startswith(f"job {started.job.id} stopped")
    assert ke.status(started.job.id).jobs[0].state == "stopped"
    assert "not running" in ke.stop(started.job.id).summary()


def test_bad_input_is_refused_before_any_host_is_contacted(ke):
    with pytest.raises(ConfigError, match="no-such-host"):
        ke.run("prepare", host="no-such-host")
    with pytest.raises(ConfigError, match="unknown step 'bogus'"):
        ke.preflight("bogus", host="gpu")
    with pytest.raises(ConfigError, match="job id"):
        ke.stop("../other", host="gpu")


def test_render_returns_the_files_without_writing(ke, tmp_path):
    rendered = ke.render("job", "exec", host="gpu", extra=["echo", "hi"])
    assert rendered.written == [] and len(rendered.files) == 1
    [(path, text)] = rendered.files.items()
    assert path.startswith("runs/") and "echo hi" in text
    written = ke.render("probe", host="gpu", out=tmp_path / "out").written
    assert written and all(p.is_file() for p in written)
