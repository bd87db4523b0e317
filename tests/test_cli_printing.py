"""What the CLI prints, as a person in a narrow terminal or a script reading a pipe sees it: identifiers whole,
JSON that parses, no raw terminal control from a job's log."""

from __future__ import annotations

import json
import os
import sys

from conftest import REPO
from test_jobs import start, wait_state
from test_progress import _in_a_terminal

NARROW = {"COLUMNS": "80"}


def _narrow_terminal(env, *args) -> str:
    e = {**os.environ, "HOME": str(env.home), "NO_COLOR": "1", "PYTHONPATH": str(REPO), "COLUMNS": "80",
         "LINES": "40", "TERM": "xterm"}
    return _in_a_terminal([sys.executable, "-m", "kimi_eagle", "--inventory", str(env.inventory), *args], e, timeout=60)


def test_status_keeps_job_ids_whole_at_80_columns_piped_and_in_a_terminal(env):
    job = start(env, sys.executable, "-c", "print('hi')")
    wait_state(env, job["id"], {"succeeded"})
    piped = env.cli("status", "--host", "gpu", env=NARROW)
    assert piped.code == 0, piped.stderr
    assert job["id"] in piped.stdout, piped.stdout
    shown = _narrow_terminal(env, "status", "--host", "gpu")
    assert job["id"] in shown, shown
    assert "…" not in piped.stdout + shown


def test_hosts_keeps_address_port_and_workdir_whole_at_80_columns(env):
    whole = [f"127.0.0.1:{env.sshd.port}", str(env.workdir), str(env.root / "localwork")]
    piped = env.cli("hosts", env=NARROW)
    assert piped.code == 0, piped.stderr
    shown = _narrow_terminal(env, "hosts")
    for text in (piped.stdout, shown):
        flat = text.replace("\r", "")
        assert all(w in flat for w in whole), flat
        assert "…" not in flat


def test_a_piped_run_prints_its_log_path_whole_on_one_line(env):
    r = env.cli("run", "exec", "--host", "gpu", "--no-gpu", "--", "true", env=NARROW)
    assert r.code == 0, r.stderr
    (started,) = [ln for ln in r.stderr.splitlines() if " started job " in ln]
    log = started.rsplit(" log ", 1)[1]
    assert log.startswith(str(env.workdir)) and (env.workdir / log[len(str(env.workdir)) + 1:]).is_file(), r.stderr


def _json_lines(text: str) -> list[dict]:
    records = [json.loads(ln) for ln in text.splitlines()]  # every line is one JSON object, the last one too
    assert records and all(isinstance(r, dict) for r in records), text
    return records


def _job_output(records: list[dict]) -> list[str]:
    return [x["line"] for x in records if "line" in x and not x["line"].startswith("==> kimi-eagle")]


def test_json_run_and_logs_are_json_lines_ending_with_the_result(env):
    r = env.cli("--json", "run", "exec", "--host", "gpu", "--no-gpu", "--", sys.executable, "-c",
                "print('first'); print('second')")
    assert r.code == 0, r.stderr
    records = _json_lines(r.stdout)
    job_id = records[0]["started"]["id"]
    assert _job_output(records) == ["first", "second"]
    assert records[-1]["job"]["id"] == job_id and records[-1]["job"]["state"] == "succeeded"
    logs = env.cli("--json", "logs", job_id, "--host", "gpu")
    assert logs.code == 0, logs.stderr
    records = _json_lines(logs.stdout)
    assert _job_output(records) == ["first", "second"]
    assert records[-1]["job"]["state"] == "succeeded"


HOSTILE = ("import sys; sys.stdout.write('\\x1b]0;owned\\x07\\x1b[31mred\\x1b[0m line\\n'); "
           "sys.stdout.write('last words without a newline')")


def test_a_jobs_control_sequences_never_reach_the_user_and_its_last_line_stands_alone(env):
    job = start(env, sys.executable, "-c", HOSTILE)
    wait_state(env, job["id"], {"succeeded"})
    piped = env.cli("logs", job["id"], "--host", "gpu")
    shown = _narrow_terminal(env, "logs", job["id"], "--host", "gpu")
    for text in (piped.stdout, shown):
        assert "\x1b" not in text and "\x07" not in text, repr(text)
        lines = text.replace("\r", "").splitlines()
        assert "[gpu] red line" in lines, lines
        assert "[gpu] last words without a newline" in lines, lines
        assert any(ln.startswith("[gpu] ==> kimi-eagle: job ") for ln in lines), lines
    # The log on the host keeps what the job wrote.
    log = (env.workdir / "runs" / job["id"] / "log").read_bytes()
    assert b"\x1b]0;owned\x07" in log
