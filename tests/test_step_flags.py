"""Step flags are declared once, in kimi_eagle_host/settings.py: each step's argparse is built from it, a step run
by hand refuses what the controller refuses in the same words, and a typo or a value of the wrong type given to
the controller is one line naming the flag and the step, exit 2, before anything reaches the host."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, make_env

# Runs each step's main() with argparse's parse_args replaced by a grab of the parser: the real parsers, read
# without running a step, beside the one the settings schema builds for it.
_READ_PARSERS = r"""
import argparse, importlib, json, sys
from kimi_eagle_host import settings
class Got(BaseException):
    pass
def grab(self, args=None, namespace=None):
    raise Got(self)
def described(parser):
    return [[a.option_strings, a.dest, repr(a.default), a.required, a.help, getattr(a.type, "__name__", None),
             type(a).__name__] for a in parser._actions]
real_parse_args = argparse.ArgumentParser.parse_args
out = {}
for step in sys.argv[1:]:
    module = importlib.import_module(f"kimi_eagle_host.pipeline.{step}")
    argparse.ArgumentParser.parse_args = grab
    try:
        module.main([])
    except Got as g:
        parser = g.args[0]
    argparse.ArgumentParser.parse_args = real_parse_args
    out[step] = {"step": described(parser), "schema": described(settings.build_parser(step, module.__doc__))}
print(json.dumps(out))
"""


def test_every_step_parser_is_the_one_the_schema_builds():
    """Each step parses its command line with the parser built from kimi_eagle_host/settings.py: the same flags,
    help texts, defaults, requirements and value checks; a step has no argparse of its own to drift."""
    from kimi_eagle_host.settings import STEPS

    res = subprocess.run([sys.executable, "-c", _READ_PARSERS, *STEPS], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    parsers = json.loads(res.stdout.strip().splitlines()[-1])
    for step in STEPS:
        assert parsers[step]["step"] == parsers[step]["schema"], f"{step}: its parser is not the schema's"


# A value the controller refuses is refused by the step run by hand, in the same words, before it reads anything.
REFUSED = {
    "ttt_steps out of range": ("train", ["--ttt-steps", "9"], "--ttt-steps: expected an integer from 1 to 7 (got 9)"),
    "duplicate layer ids": ("extract", ["--layer-ids", "2,2,30"], "layer 2 is listed twice"),
    "batch size 0": ("extract", ["--batch-size", "0"], "--batch-size: expected an integer greater than 0 (got 0)"),
    "unknown tracker": ("eval", ["--report-to", "tensorbored"], "'tensorbored' is not a tracker"),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_step_run_by_hand_refuses_what_the_controller_refuses(tmp_path, case):
    from conftest import host_cmd

    step, flags, words = REFUSED[case]
    out = tmp_path / "out"
    r = subprocess.run(host_cmd(f"pipeline.{step}", "--model", tmp_path / "no-model", "--output-dir", out, *flags),
                       capture_output=True, text=True, timeout=300, env=_host_env())
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert words in r.stderr and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert not out.exists(), "the step wrote before refusing"


def test_a_settings_file_value_is_checked_as_a_flag_is(tmp_path):
    """A job's settings.json is read through the same checks: ttt_steps 9 there is refused naming the file."""
    from conftest import host_cmd

    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"pipeline": {}, "steps": {"train": {
        "model": str(tmp_path / "m"), "output_dir": str(tmp_path / "out"), "ttt_steps": 9}}}))
    r = subprocess.run(host_cmd("pipeline.train", "--settings", settings), capture_output=True, text=True,
                       timeout=300, env=_host_env())
    assert r.returncode == 2, (r.stdout, r.stderr[-2000:])
    assert f"--settings {settings}: ttt_steps: expected an integer from 1 to 7 (got 9)" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def _host_env() -> dict:
    """This checkout's host package first on the path, as a host's PYTHONPATH names its payloads."""
    import os

    return {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


TYPOS = {
    "unknown flag after --": (["run", "train", "--host", "gpu", "--", "--epcohs", "3"], ["--epcohs", "train", "--epochs"]),
    "wrong type": (["run", "extract", "--host", "gpu", "--", "--batch-size", "many"], ["--batch-size", "extract", "integer"]),
    "bad choice": (["run", "train", "--host", "gpu", "--", "--parallel", "zero"], ["--parallel", "train", "fsdp"]),
    "missing value": (["run", "vocab", "--host", "gpu", "--", "--draft-vocab-size"], ["--draft-vocab-size", "vocab"]),
    "unknown option before --": (["run", "train", "--hots", "gpu"], ["--hots", "run"]),
    "run all: a step flag in an override": (["run", "all", "--host", "gpu", "steps.train.epcohs=3"], ["steps.train.epcohs", "did you mean epochs"]),
    "run all: flags after --": (["run", "all", "--host", "gpu", "--", "--epochs", "3"], ["run all", "steps.train"]),
    "render job": (["render", "job", "train", "--host", "gpu", "--out", "RENDERED", "--", "--epcohs", "3"], ["--epcohs", "train"]),
}


@pytest.mark.parametrize("case", sorted(TYPOS))
def test_a_typo_is_one_line_exit_2_and_nothing_reaches_the_host(tmp_path, sshd, case):
    argv, needles = TYPOS[case]
    e = make_env(tmp_path, sshd, extra="pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n")
    argv = [str(tmp_path / "rendered") if a == "RENDERED" else a for a in argv]
    r = e.cli(*argv)
    assert r.code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    assert not e.workdir.exists(), "something reached the host"
    assert not (tmp_path / "rendered").exists(), "render wrote files"


def test_flags_and_settings_that_are_right_pass(tmp_path):
    """The same command without the typo renders, with the step flags in the step's command line."""
    e = make_env(tmp_path, None, extra="pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n")
    out = tmp_path / "r"
    r = e.cli("render", "job", "train", "--host", "local", "--out", str(out), "--", "--epochs=3", "--resume",
              "--no-export-embed-tokens", "--lr", "1e-3")
    assert r.code == 0, r.stderr
    line = next(ln for ln in next(out.rglob("job.sh")).read_text().splitlines() if "kimi_eagle_host.pipeline.train" in ln)
    assert line.rstrip().endswith("--epochs=3 --resume --no-export-embed-tokens --lr 1e-3"), line


@pytest.mark.parametrize("flag", ["--engine", "--backend"])
def test_extract_and_preflight_call_the_engine_engine(tmp_path, flag):
    """The extraction engine is `--engine` in extract and preflight, as the setting `engine` is; the old `--backend`
    still works and says, in one line, what it is called now. Preflight's report names it `engine`."""
    from conftest import host_cmd

    r = subprocess.run(host_cmd("ops.preflight", "--step", "vocab", flag, "vllm", "--output-dir", tmp_path,
                                "--min-free-disk-gib", "0.001"), capture_output=True, text=True, timeout=300,
                       env=_host_env())
    report = json.loads(r.stdout)
    assert report["engine"] == "vllm" and "backend" not in report, report
    notes = [ln for ln in r.stderr.splitlines() if "--backend" in ln]
    assert notes == ([] if flag == "--engine" else
                     ["python -m kimi_eagle_host.ops.preflight: --backend is now --engine (the old name still works)"]), r.stderr
    from kimi_eagle_host.settings import build_parser

    assert build_parser("extract").parse_args(["--model", "m", flag, "vllm"]).engine == "vllm"


def test_a_job_rendered_before_the_rename_keeps_its_engine(tmp_path, capsys):
    """A job's settings.json written before `backend` became `engine` (a resume after the upgrade): extract still
    reads the engine from it, with one line naming the new key."""
    from kimi_eagle_host.step_runtime import parse_step_args

    old = tmp_path / "settings.json"
    old.write_text(json.dumps({"pipeline": {}, "steps": {"extract": {"backend": "vllm", "model": "/m"}}}))
    args = parse_step_args("extract", ["--settings", str(old)])
    assert (args.engine, args.model) == ("vllm", "/m")
    assert f"--settings {old}: backend is now engine" in capsys.readouterr().err


def test_a_path_setting_that_starts_with_a_dash_is_a_path_on_the_host(tmp_path, sshd):
    """`output_dir: "-o"` passed the checks, the job started, then its first step refused it: `--output-dir -o`
    reads as two options to argparse. Values travel as `--flag=value`, so the step reads the path as given."""
    from conftest import TINY_PIPELINE

    e = make_env(tmp_path, sshd, extra=TINY_PIPELINE + '  output_dir: "-o"\n')
    r = e.cli("run", "prepare", "--host", "gpu", timeout=600)
    assert r.code == 0, (r.stdout[-3000:], r.stderr[-2000:])
    assert (e.workdir / "-o" / "prepared").is_dir() and list((e.workdir / "-o" / "runs").iterdir())
