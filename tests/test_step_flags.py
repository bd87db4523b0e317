"""Step flags are known on the controller: the declared table equals each step's own argparse, and a typo or a
value of the wrong type is one line naming the flag and the step, exit 2, before anything reaches the host."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO, make_env

# Runs each step's main() with argparse's parse_args replaced by a grab of the parser: the real parsers, read
# without running a step.
_READ_PARSERS = r"""
import argparse, importlib, json, sys
class Got(BaseException):
    pass
def grab(self, args=None, namespace=None):
    raise Got(self)
argparse.ArgumentParser.parse_args = grab
out = {}
for step in sys.argv[1:]:
    try:
        importlib.import_module(f"kimi_eagle_host.pipeline.{step}").main([])
    except Got as g:
        parser = g.args[0]
    flags = {}
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction) or a.dest == "settings":
            continue
        default = a.default if isinstance(a.default, (int, float, str, bool, type(None))) else repr(a.default)
        if isinstance(a, argparse.BooleanOptionalAction):
            kind, opts = ["toggle", []], [o for o in a.option_strings if not o.startswith("--no-")]
        elif isinstance(a, argparse._StoreTrueAction):
            kind, opts = ["switch", []], a.option_strings
        elif a.choices is not None:
            kind, opts = ["choice", [str(c) for c in a.choices]], a.option_strings
        else:
            kind = [{int: "int", float: "float"}.get(a.type, "text"), []]
            opts = a.option_strings
        for o in opts:
            flags[o] = kind + [default]
    out[step] = flags
print(json.dumps(out))
"""
# How the schema's kinds reach argparse: what is not a number, a choice or a switch is text the step parses.
_AS_ARGPARSE = {"int": "int", "float": "float", "choice": "choice", "switch": "switch", "toggle": "toggle"}


def _declared(step: str) -> dict:
    """{flag: [kind, choices, default]} of `step` in kimi_eagle_host/settings.py."""
    from kimi_eagle_host.settings import ALIASES, BY_STEP

    flags = {}
    for key, s in BY_STEP[step].items():
        # a list of names (`scripts`) is text the step checks itself: argparse knows no choices for it
        kind = [_AS_ARGPARSE.get(s.kind, "text"), [str(c) for c in s.choices] if s.kind != "names" else []]
        for flag in [s.flag(step), *[a for a, f in ALIASES.get(step, {}).items() if f == s.flag(step)]]:
            flags[flag] = kind + [s.default]
    return flags


def test_the_schema_is_each_steps_own_argparse():
    """Every flag of every step is in the settings schema with the step's type, choices and default (a setting
    left unset by default lets the step decide): a flag added to a step without the schema fails here."""
    from kimi_eagle_host.settings import STEPS

    res = subprocess.run([sys.executable, "-c", _READ_PARSERS, *STEPS],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    actual = json.loads(res.stdout.strip().splitlines()[-1])
    for step in STEPS:
        declared = _declared(step)
        missing = sorted(set(actual[step]) - set(declared))
        extra = sorted(set(declared) - set(actual[step]))
        assert not missing and not extra, f"{step}: kimi_eagle_host/settings.py lacks {missing}, has unknown {extra}"
        for f, (kind, choices, default) in actual[step].items():
            want_kind, want_choices, want_default = declared[f]
            assert [want_kind, want_choices] == [kind, choices], f"{step} {f}: schema {declared[f]}, step {kind} {choices}"
            if want_default is not None and want_kind != "text":
                assert want_default == default, f"{step} {f}: schema default {want_default!r}, the step's {default!r}"


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
