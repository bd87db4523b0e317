"""Recipes: a run's settings in one file apart from the inventory, KEY=VALUE overrides on the command line, every
mistake one line naming the file (or the override) and the key, and the settings and versions a run used
written next to its outputs."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import yaml

from conftest import REPO, make_env, one_line_usage_error, write_fake_export

INVENTORY_PIPELINE = "pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n  epochs: 1\n"


def _train_line(e, tmp_path, *args) -> str:
    """train's command line as it runs: the job's line, with its section of the job's settings.json as flags."""
    from kimi_eagle_host.settings import section_to_argv

    out = tmp_path / "r"
    r = e.cli("render", "job", "train", "--host", "local", "--out", str(out), *args)
    assert r.code == 0, (r.stdout, r.stderr)
    line = next(ln for ln in next(out.rglob("job.sh")).read_text().splitlines() if "kimi_eagle_host.pipeline.train" in ln)
    assert "--settings runs/JOB-ID/settings.json" in line, line
    section = json.loads(next(out.rglob("settings.json")).read_text())["steps"]["train"]
    return line + " " + " ".join(section_to_argv("train", section)) + " "


def test_a_recipe_and_overrides_set_the_run_and_the_last_word_wins(tmp_path):
    e = make_env(tmp_path, None, extra=INVENTORY_PIPELINE)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("epochs: 4\nlr: 0.02\nsteps:\n  train: {warmup_steps: 5, resume: true}\n")
    assert "--epochs=1 " in _train_line(e, tmp_path)  # the inventory's pipeline section, as before
    line = _train_line(e, tmp_path, "-c", str(recipe))
    assert "--epochs=4 " in line and "--lr=0.02 " in line and "--warmup-steps=5 " in line and "--resume " in line, line
    line = _train_line(e, tmp_path, "--recipe", str(recipe), "epochs=7", "steps.train.warmup_steps=9", "report_to=none")
    assert "--epochs=7 " in line and "--warmup-steps=9" in line and "--report-to=none" in line, line
    # Overrides alone, without a recipe file, over the inventory's settings.
    assert "--epochs=3 " in _train_line(e, tmp_path, "epochs=3")


def test_a_recipe_wins_over_the_hosts_own_pipeline_settings(tmp_path):
    e = make_env(tmp_path, None)
    e.write_inventory(f"""
hosts:
  local:
    transport: local
    workdir: {tmp_path / 'w'}
    pipeline: {{model: /models/m, dataset: /d.jsonl, batch_size: 2, seq_len: 99}}
pipeline:
  batch_size: 1
""")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("batch_size: 16\n")
    line = _train_line(e, tmp_path, "-c", str(recipe))
    assert "--batch-size=16" in line and "--model=/models/m" in line, line


@pytest.mark.parametrize("given", [["-c", "RECIPE", "tiny_model=llama"], ["model_source=smollm2", "tiny_model=llama"]])
def test_an_override_picking_tiny_model_replaces_the_model_source_it_overrides(tmp_path, given):
    """Two ways to build `model`: the last one given wins, as a recipe does over the inventory's pipeline."""
    e = make_env(tmp_path, None, extra=INVENTORY_PIPELINE)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("model_source: smollm2\n")
    out = tmp_path / "out"
    r = e.cli("render", "job", "train", "--host", "local", "--out", str(out),
              *[str(recipe) if a == "RECIPE" else a for a in given])
    assert r.code == 0, (r.stdout, r.stderr)
    pipeline = json.loads(next(out.rglob("settings.json")).read_text())["pipeline"]
    assert pipeline["tiny_model"] == "llama" and pipeline["model_source"] is None, pipeline
    both = tmp_path / "both.yaml"
    both.write_text("model_source: smollm2\ntiny_model: llama\n")  # one file giving both is still a mistake
    line = one_line_usage_error(e.cli("render", "job", "train", "--host", "local", "--out", str(out), "-c", str(both)))
    assert f"{both}:" in line and "set only one" in line, line


def test_a_combination_the_schema_refuses_is_one_config_error_naming_the_recipe():
    from kimi_eagle.config import recipe
    from kimi_eagle.errors import ConfigError

    with pytest.raises(ConfigError) as e:
        recipe._validated({"tiny_model": "llama", "model_source": "smollm2"}, "r.yaml", ["epochs=2"])
    assert str(e.value).splitlines() == ["recipe r.yaml with overrides epochs=2: field model_source: tiny_model and "
                                         "model_source both build `model`: set only one"], str(e.value)


def test_without_a_batch_size_the_steps_own_defaults_apply(tmp_path):
    """No `batch_size` in the inventory or the recipe: neither train nor extract is handed --batch-size, so train
    sizes its tokens per step from the GPU's memory (and extract keeps its own default); set, both get it."""
    e = make_env(tmp_path, None, extra=INVENTORY_PIPELINE)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("epochs: 2\n")
    out = tmp_path / "all"
    r = e.cli("render", "job", "all", "--host", "local", "--out", str(out), "-c", str(recipe))
    assert r.code == 0, (r.stdout, r.stderr)
    sections = json.loads(next(out.rglob("settings.json")).read_text())["steps"]
    assert "epochs" in sections["train"] and "seq_len" in sections["extract"], sections
    assert "batch_size" not in sections["train"] and "batch_size" not in sections["extract"], sections
    assert "--batch-size=5 " in _train_line(e, tmp_path, "-c", str(recipe), "batch_size=5") + " "


MISTAKES = {
    "unknown key in the file": ("epochs: 2\nepcohs: 3\n", [], r"^error: \S*r\.yaml:2: field epcohs: unknown key \(did you mean epochs\?\)$"),
    "wrong type in the file": ("epochs: many\n", [], r"^error: \S*r\.yaml:1: field epochs: .*many"),
    "a step flag the step lacks": ("steps:\n  train: {epcohs: 3}\n", [], r"r\.yaml:2: field steps\.train\.epcohs: train has no such setting \(did you mean epochs\?\)"),
    "unknown key in an override": ("epochs: 2\n", ["epcohs=3"], r"^error: override epcohs=3: field epcohs: unknown key \(did you mean epochs\?\) \(recipe \S*r\.yaml\)$"),
    "wrong type in an override": ("", ["batch_size=big"], r"^error: override batch_size=big: field batch_size: .*big"),
    "not KEY=VALUE": ("", ["epochs"], r"^error: kimi-eagle run: unexpected argument 'epochs'"),
    "a pipeline: section": ("pipeline:\n  epochs: 2\n", [], r"r\.yaml:1: a recipe holds the pipeline settings themselves"),
    "hosts in a recipe": ("hosts: {}\n", [], r"r\.yaml:1: hosts belong in the inventory"),
    "bad YAML": ("epochs: [1\n", [], r"r\.yaml:\d+: YAML syntax error"),
    "tracker unknown": ("report_to: tensorbored\n", [], r"field report_to: 'tensorbored' is not a tracker"),
}


@pytest.mark.parametrize("case", sorted(MISTAKES))
def test_a_recipe_mistake_is_one_line_exit_2_and_nothing_reaches_the_host(tmp_path, sshd, case):
    text, overrides, pattern = MISTAKES[case]
    e = make_env(tmp_path, sshd, extra=INVENTORY_PIPELINE)
    recipe = tmp_path / "r.yaml"
    recipe.write_text(text)
    r = e.cli("run", "train", "--host", "gpu", "-c", str(recipe), *overrides)
    assert r.code == 2, (r.stdout, r.stderr)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(pattern, lines[0]), lines
    assert not e.workdir.exists(), "something reached the host"


def test_a_missing_recipe_file_is_named(tmp_path):
    r = make_env(tmp_path, None).cli("preflight", "--host", "local", "-c", str(tmp_path / "nope.yaml"))
    assert r.code == 2 and r.stderr.strip() == f"error: {tmp_path / 'nope.yaml'}: recipe file not found", r.stderr


RECIPES = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))


@pytest.mark.parametrize("name", RECIPES)
def test_the_shipped_recipes_render_with_the_example_inventory(tmp_path, name):
    """The recipes under recipes/ are valid, and render the whole chain for the example 8-GPU host."""
    e = make_env(tmp_path, None)
    e.write_inventory((REPO / "inventory.example.yaml").read_text())
    out = tmp_path / "r"
    r = e.cli("render", "job", "all", "--host", "blackwell-01", "--out", str(out), "-c", str(REPO / "recipes" / f"{name}.yaml"))
    assert r.code == 0, r.stderr
    script = next(out.rglob("job.sh")).read_text()
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    if name == "kimi-k2.5-8gpu":
        # online: no extract step; train runs the engine (vLLM at TP 8 on the recipe's layers) and then choose
        assert "kimi_eagle_host.pipeline.extract" not in script
        train = next(ln for ln in script.splitlines() if "kimi_eagle_host.pipeline.train" in ln)
        assert "--settings runs/JOB-ID/settings.json" in train, train
        assert "kimi_eagle_host.pipeline.choose" in script
        sections = json.loads(next(out.rglob("settings.json")).read_text())["steps"]
        want = {"hidden_states": "online", "engine": "vllm", "tp_size": 8, "layer_ids": [2, 30, 58, 61],
                "model": "/models/Kimi-K2.5", "choose_checkpoints": 3}
        assert {k: sections["train"].get(k) for k in want} == want, sections["train"]
        assert sections["vocab"]["draft_vocab_size"] == 32000
    else:
        assert "kimi_eagle_host.pipeline.regenerate" in script and "kimi_eagle_host.pipeline.eval" in script and "--source=smollm2" in script


# The recipes that carry the data plan at scale: ShareGPT plus prompts the target writes, >= 50k conversations.
AT_SCALE = {"kimi-k2.5-8gpu", "smollm2-quality-gpu"}


@pytest.mark.parametrize("name", RECIPES)
def test_the_shipped_recipes_name_their_data_by_source(tmp_path, name):
    """A shipped recipe trains on a dataset by name (data_sources.py: a package, recorded with its sha256) answered
    by the target, never on a bundled file of templated prompts, and evaluates on one by name; the GPU and Kimi
    recipes fill the set to >= 50k conversations with the target's own prompts, curated."""
    from kimi_eagle_host.data.data_sources import is_source_name

    recipe = yaml.safe_load((REPO / "recipes" / f"{name}.yaml").read_text())
    assert is_source_name(recipe["dataset"]) and recipe.get("regenerate") is True, recipe
    assert recipe.get("eval_prompts") is None or is_source_name(recipe["eval_prompts"]), recipe
    assert "sample_data" not in json.dumps(recipe)
    e = make_env(tmp_path, None)
    e.write_inventory((REPO / "inventory.example.yaml").read_text())
    out = tmp_path / "r"
    r = e.cli("render", "job", "all", "--host", "blackwell-01", "--out", str(out), "-c", str(REPO / "recipes" / f"{name}.yaml"))
    assert r.code == 0, r.stderr
    sections = json.loads(next(out.rglob("settings.json")).read_text())["steps"]
    regen = sections["regenerate"]
    assert regen["dataset"] == "sharegpt" and regen["dedupe"] == "near", regen
    assert sections["prepare"]["dataset"].endswith("/regenerated/chat.jsonl")  # prepare reads the target's answers
    if name in AT_SCALE:
        assert regen["self_prompts"] >= 50000 and regen.get("max_turns", 0) == 0, regen
    else:
        assert not regen.get("self_prompts")


def test_self_written_prompts_without_regenerate_are_refused_in_one_line(tmp_path):
    e = make_env(tmp_path, None, extra=INVENTORY_PIPELINE)
    r = e.cli("render", "job", "all", "--host", "local", "--out", str(tmp_path / "r"), "self_prompts=1000")
    assert r.code == 2 and r.stderr.strip().splitlines() == [
        "error: self_prompts: 1000 needs regenerate: true (the target writes the prompts in regenerate, then "
        "answers them)"], r.stderr
    assert not (tmp_path / "r").exists()


BROKEN_LINKS = {
    "regenerated elsewhere": (["regenerate=true", "steps.regenerate.out=/data/regen"], "steps.regenerate.out"),
    "prepared elsewhere": (["steps.prepare.out=/data/prepared"], "steps.prepare.out"),
    "extracted elsewhere": (["steps.extract.out=/data/hs"], "steps.extract.out"),
    "vocabulary elsewhere": (["steps.vocab.out=/data/vocab"], "steps.vocab.out"),
    "train stopped early": (["steps.train.stop_at_step=5"], "steps.train.stop_at_step"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_LINKS))
def test_run_all_refuses_settings_that_leave_its_later_steps_an_earlier_runs_outputs(tmp_path, case):
    """The later steps of `run all` read each step's output from its folder under output_dir and serve train's
    export: a step written elsewhere, or a train that stops before its export, would have them read what an
    earlier run left there (and end as succeeded). Alone, each setting is the user's to use."""
    overrides, named = BROKEN_LINKS[case]
    e = make_env(tmp_path, None, extra=INVENTORY_PIPELINE)
    r = e.cli("render", "job", "all", "--host", "local", "--out", str(tmp_path / "r"), *overrides)
    lines = r.stderr.strip().splitlines()
    assert r.code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {named}: "), r.stderr
    assert not (tmp_path / "r").exists()
    step = named.split(".")[1]
    alone = e.cli("render", "job", step, "--host", "local", "--out", str(tmp_path / "alone"), *overrides)
    assert alone.code == 0, alone.stderr


def test_online_hidden_states_with_speculators_trainer_are_refused_before_anything_starts(tmp_path):
    """speculators' trainer reads hidden-state files and online streams them without files: train would refuse
    only when it starts, after `run all`'s prepare and vocab ran. Refused at render, in one line; offline, the
    trainer is the user's to choose."""
    e = make_env(tmp_path, None, extra=INVENTORY_PIPELINE)
    for step in ("all", "train"):
        r = e.cli("render", "job", step, "--host", "local", "--out", str(tmp_path / step), "hidden_states=online",
                  "steps.train.trainer=speculators")
        assert r.code == 2 and r.stderr.strip().splitlines() == [
            "error: steps.train.trainer: speculators reads the hidden states as files, and hidden_states: online "
            "streams them to the trainer without files: set steps.train.trainer=ours, or hidden_states=offline"], \
            r.stderr
        assert not (tmp_path / step).exists()
    r = e.cli("render", "job", "all", "--host", "local", "--out", str(tmp_path / "offline"),
              "steps.train.trainer=speculators")
    assert r.code == 0, r.stderr


def test_a_run_records_its_settings_and_versions_next_to_its_outputs(tmp_path, sshd):
    """A real job over sshd: <output_dir>/runs/<job-id>/recipe.yaml (the resolved settings, overrides included,
    readable as YAML), versions.json (ours and the host's), and the job's pointer to its outputs."""
    from kimi_eagle import __version__

    e = make_env(tmp_path, sshd, extra=INVENTORY_PIPELINE)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("description: a test\nepochs: 4\n")
    # The vocab step prints its help and exits 0: the record is what runs first.
    r = e.cli("--json", "run", "vocab", "--host", "gpu", "--detach", "--no-preflight", "-c", str(recipe),
              "draft_vocab_size=77", "--", "--help")
    assert r.code == 0, (r.stdout, r.stderr)
    job = r.json()["id"]
    assert e.cli("logs", job, "--follow").code == 0
    record = e.workdir / "out" / "runs" / job
    settings = yaml.safe_load((record / "recipe.yaml").read_text())
    assert settings["epochs"] == 4 and settings["draft_vocab_size"] == 77 and settings["model"] == "/models/m"
    assert f"# recipe: {recipe} draft_vocab_size=77" in (record / "recipe.yaml").read_text()
    versions = json.loads((record / "versions.json").read_text())
    import torch

    assert versions["kimi-eagle"] == __version__ and versions["packages"]["torch"] == torch.__version__
    assert (e.workdir / "runs" / job / "output_dir").read_text().strip() == str(e.workdir / "out")


def test_the_serve_hint_uses_the_runs_k_also_when_followed_later(tmp_path, sshd):
    """`num_speculative_tokens` of the run (an override here) is the k of the printed `vllm serve` command, at
    the end of `run` and in a later `logs --follow` that knows nothing of the override (the run's record)."""
    e = make_env(tmp_path, sshd, extra=INVENTORY_PIPELINE)
    write_fake_export(e, "/models/m")
    r = e.cli("run", "train", "--host", "gpu", "--no-preflight", "num_speculative_tokens=5", "--", "--help")
    assert r.code == 0, (r.stdout, r.stderr)
    hint = r.stdout.strip().splitlines()[-1]
    assert "vllm serve /models/m --speculative-config" in hint and '"num_speculative_tokens": 5' in hint, hint
    job = re.search(r"started job (\S+) ", r.stderr).group(1)
    later = e.cli("logs", job, "--follow")
    assert '"num_speculative_tokens": 5' in later.stdout.strip().splitlines()[-1], later.stdout


def test_the_gpu_campaign_trains_what_the_gpu_recipe_renders(tmp_path, monkeypatch):
    """bench/gpu's judged run (scale_data, scale_train, scale_ab's base) reads recipes/smollm2-quality-gpu.yaml, so
    the H200 figure is the recipe's: every setting it gives train is the one the controller renders for a user of
    that recipe, and its vocab has the recipe's size."""
    import importlib.util

    from kimi_eagle_host.settings import section_to_argv

    for knob in ("KE_TINY", "KE_SCALE_EXTRA", "KE_SCALE_EPOCHS", "KE_SCALE_LR", "KE_SCALE_TTT", "KE_SCALE_VOCAB",
                 "KE_SCALE_BUFFER_GB", "KE_SCALE_CACHE_GB", "KE_SCALE_CANDIDATES", "KE_SCALE_ENGINE_BATCH"):
        monkeypatch.delenv(knob, raising=False)
    monkeypatch.setenv("KE_WORK", str(tmp_path / "work"))
    spec = importlib.util.spec_from_file_location("side_by_side_bench", REPO / "bench" / "gpu" / "side_by_side.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    ours = {**bench.scale_online(), **bench.scale_settings()}

    e = make_env(tmp_path, None)
    e.write_inventory((REPO / "inventory.example.yaml").read_text())
    out = tmp_path / "r"
    r = e.cli("render", "job", "all", "--host", "blackwell-01", "--out", str(out),
              "-c", str(REPO / "recipes" / "smollm2-quality-gpu.yaml"))
    assert r.code == 0, r.stderr
    sections = json.loads(next(out.rglob("settings.json")).read_text())["steps"]
    argv = section_to_argv("train", sections["train"])
    rendered = {a[2:].replace("-", "_"): b for a, b in zip(argv, argv[1:] + [""]) if a.startswith("--")}

    def same(a: str, b: str) -> bool:
        try:
            return float(a) == float(b)
        except ValueError:
            return a == b

    shared = ("epochs", "lr", "ttt_steps", "optimizer", "warmup_steps", "online_buffer_gb", "online_cache_gb",
              "choose_checkpoints", "batch_size", "engine_batch_size", "hidden_states")
    for key in shared:
        assert key in ours, key
        assert same(ours[key], rendered.get(key, str(sections["train"].get(key)))), (key, ours[key], rendered.get(key))
    assert int(ours["draft_vocab_size"]) == sections["vocab"]["draft_vocab_size"]
    assert bench.ab_base()["optimizer"] == ours["optimizer"] and bench.ab_base()["epochs"] == "1"
    # an A/B's knob still moves one setting off the recipe
    monkeypatch.setenv("KE_SCALE_EXTRA", "draft_layers=2,optimizer=adamw")
    assert bench.scale_settings()["draft_layers"] == "2" and bench.scale_settings()["optimizer"] == "adamw"
    sys.modules.pop("side_by_side_bench", None)
