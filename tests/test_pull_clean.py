"""pull and clean over the real sshd: a job's results come back verified and only what changed travels; the
bulky intermediates go only after their size was shown and never while a job using them runs."""

from __future__ import annotations

import hashlib
import json
import sys
import time

import pytest

from conftest import REPO, make_env

PY = sys.executable
PIPELINE = "pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n"


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _a_finished_run(e):
    """A real pipeline job (its record step runs, then vocab prints its help), then the files a training and an
    eval leave in its output folder."""
    r = e.cli("--json", "run", "vocab", "--host", "gpu", "--detach", "--no-preflight", "--", "--help")
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    assert e.cli("logs", job, "--follow").code == 0
    out = e.workdir / "out"
    (out / "draft" / "export").mkdir(parents=True)
    (out / "draft" / "export" / "config.json").write_text(json.dumps({"architectures": ["Eagle3DraftModel"]}))
    (out / "draft" / "export" / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (out / "draft" / "checkpoints").mkdir()
    (out / "draft" / "checkpoints" / "step_00000010.pt").write_bytes(b"\1" * 300_000)
    (out / "eval").mkdir()
    (out / "eval" / "report.json").write_text('{"mean_acceptance_length": 1.5}')
    (out / "hidden_states").mkdir()
    for i in range(3):
        (out / "hidden_states" / f"hs_{i}.safetensors").write_bytes(b"\2" * 1_000_000)
    return job, out


def test_pull_copies_the_results_verified_and_then_only_what_changed(tmp_path, sshd):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    dest = tmp_path / "here"
    r = e.cli("pull", job, "--to", str(dest))
    assert r.code == 0, (r.stdout, r.stderr)
    for rel in ("draft/export/config.json", "draft/export/model.safetensors", "eval/report.json",
                f"runs/{job}/recipe.yaml", f"runs/{job}/versions.json"):
        assert _sha(dest / rel) == _sha(out / rel), rel
    assert (dest / "logs" / job / "log").read_text() == (e.workdir / "runs" / job / "log").read_text()
    assert not (dest / "hidden_states").exists() and not (dest / "draft" / "checkpoints").exists()
    assert f"pulled {out} into {dest}" in r.stdout

    again = e.cli("--json", "pull", job, "--to", str(dest))
    assert again.code == 0 and again.json()["changed"] == [] and again.json()["bytes_received"] == 0
    # One file changed on the host, one damaged here (same size): those two travel, nothing else.
    (out / "eval" / "report.json").write_text('{"mean_acceptance_length": 1.7}')
    damaged = dest / "draft" / "export" / "model.safetensors"
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    third = e.cli("--json", "pull", job, "--to", str(dest)).json()
    assert sorted(third["changed"]) == ["draft/export/model.safetensors", "eval/report.json"], third
    assert _sha(damaged) == _sha(out / "draft" / "export" / "model.safetensors")
    assert not list(dest.rglob("*.part")), "a temporary file was left behind"

    # The same folder named directly, with every job that wrote there.
    by_dir = e.cli("--json", "pull", "--host", "gpu", "--run", "out", "--to", str(tmp_path / "byd"))
    assert by_dir.code == 0, by_dir.stderr
    assert f"logs/{job}/log" in by_dir.json()["changed"] and "eval/report.json" in by_dir.json()["changed"]


def test_pull_of_a_job_without_a_record_or_a_missing_folder_is_one_line(tmp_path, sshd):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    r = e.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", "true")
    job = r.json()["id"]
    assert e.cli("logs", job, "--follow").code == 0
    r = e.cli("pull", job)
    assert r.code == 2 and "no record of its output folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = e.cli("pull", "--host", "gpu", "--run", "nope")
    assert r.code == 2 and "nope: no such folder" in r.stderr


def test_clean_shows_the_bytes_asks_and_removes_only_the_bulky_parts(tmp_path, sshd):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    dry = e.cli("clean", job, "--dry-run")
    assert dry.code == 0, dry.stderr
    assert "would remove" in dry.stdout and "hidden_states: 2.9 MiB in 3 files" in dry.stdout, dry.stdout
    assert "3.1 MiB would be freed; nothing was removed" in dry.stdout
    assert (out / "hidden_states").is_dir() and (out / "draft" / "checkpoints").is_dir()

    unconfirmed = e.cli("clean", job)  # not a terminal, no --yes: the sizes, then a refusal
    assert unconfirmed.code == 2 and "confirm with --yes (nothing was removed)" in unconfirmed.stderr
    assert "hidden_states: 2.9 MiB" in unconfirmed.stdout and (out / "hidden_states").is_dir()

    done = e.cli("clean", job, "--yes")
    assert done.code == 0, done.stderr
    assert "removed hidden_states, draft/checkpoints" in done.stdout and "3.1 MiB freed" in done.stdout
    assert not (out / "hidden_states").exists() and not (out / "draft" / "checkpoints").exists()
    assert (out / "draft" / "export" / "model.safetensors").is_file() and (out / "eval" / "report.json").is_file()
    assert not [p for p in out.rglob("*") if ".removing-" in p.name]
    assert "nothing to remove" in e.cli("clean", job, "--yes").stdout


def test_clean_refuses_while_a_job_using_the_folder_runs(tmp_path, sshd):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    # A running job that recorded this output folder, as every pipeline job does first (ops/provenance.py).
    record = [PY, str(REPO / "remote_payloads" / "ops" / "provenance.py"), "--output-dir", "out", "--product-version",
              "test", "--settings", "x: 1"]
    r = e.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", "bash", "-c",
              " ".join(f"'{a}'" for a in record) + " && sleep 60")
    busy = r.json()["id"]
    deadline = time.monotonic() + 30
    while not (e.workdir / "runs" / busy / "output_dir").exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    try:
        r = e.cli("clean", job, "--yes")
        assert r.code == 1 and f"job {busy} (exec) is running on {out}; nothing was removed" in r.stderr, r.stderr
        assert (out / "hidden_states").is_dir()
    finally:
        assert e.cli("stop", busy, "--grace", "1").code == 0
    assert e.cli("clean", job, "--yes").code == 0 and not (out / "hidden_states").exists()
