"""`render` writes what `run` would, flags after `--` included."""

from __future__ import annotations

import subprocess

from conftest import make_env, write_fake_export


def _job_script(tmp_path, step, *extra):
    e = make_env(tmp_path, None, extra="pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n")
    out = tmp_path / "r"
    r = e.cli("render", "job", step, "--host", "local", "--out", str(out), "--", *extra)
    assert r.code == 0, (r.stdout, r.stderr)
    (script,) = out.rglob("job.sh")
    return script.read_text()


def test_render_job_exec_with_a_command(tmp_path):
    text = _job_script(tmp_path, "exec", "python3", "-c", "print('hi there')", "--flag")
    assert "python3 -c 'print('\"'\"'hi there'\"'\"')' --flag" in text, text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_render_a_step_with_extra_flags(tmp_path):
    text = _job_script(tmp_path, "extract", "--validate", "--batch-size", "3")
    line = next(ln for ln in text.splitlines() if "kimi_eagle_host.pipeline.extract" in ln)
    assert line.rstrip().endswith("--validate --batch-size 3"), line


def test_render_refuses_flags_a_thing_does_not_take(tmp_path):
    r = make_env(tmp_path, None).cli("render", "patch", "--host", "local", "--out", str(tmp_path / "r"), "--", "--x")
    assert r.code == 2 and "takes no" in r.stderr and "--x" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_finished_training_ends_with_where_what_and_next(tmp_path, sshd):
    """The last lines of `run train|all`: the absolute export path, what it holds, and the command to use it."""
    e = make_env(tmp_path, sshd, extra="pipeline:\n  model: /models/tiny-kimi\n  dataset: /data/d.jsonl\n")
    export = write_fake_export(e, "/models/tiny-kimi", size=4096)
    # A real `train` job that exits at once (--help), so the ending is what the user sees after training.
    r = e.cli("run", "train", "--host", "gpu", "--no-preflight", "--", "--help")
    assert r.code == 0, (r.stdout, r.stderr)
    last = r.stdout.strip().splitlines()[-3:]
    assert last[0] == f"[gpu] draft exported to {export}", last
    assert "config.json + model.safetensors" in last[1] and "draft vocabulary 256" in last[1], last
    assert "vllm serve /models/tiny-kimi --speculative-config" in last[2] and str(export) in last[2] and "eagle3" in last[2]
