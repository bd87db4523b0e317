"""The best checkpoint, chosen by serving it (choose_checkpoints, pipeline/choose.py).

Through the real steps on tiny real targets: train exports N checkpoints spread over the run, offline and online
alike, with the held-out documents they were never trained on; `run all` serves them (choose) before eval, so eval
measures the chosen export; the choose step, with a real vLLM 0.32 serving drafts whose acceptance is known by
construction (tests/drafts.py: one proposes the target's own tokens, one never a token the target takes), exports
the one that serves best even when it is not the last, with figures at every k that follow from vLLM's per-position
counts; a host that cannot serve is a failed step, never a silent pass.
"""
from __future__ import annotations

import hashlib
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import SAMPLE_CHAT, STEP_ENV, host_cmd, make_env, one_line_usage_error
from kimi_eagle_host.pipeline import tiny_model

SAMPLE, ENV = SAMPLE_CHAT, STEP_ENV
LAYERS = "1,2,4"
SEQ_LEN = 64
# 16 documents, a quarter held out: 12 trained, 2 rows a step, 6 steps; 3 candidates at steps 2, 4 and 6.
TRAIN = ("--epochs", "1", "--batch-size", "2", "--lr-schedule", "constant", "--holdout-fraction", "0.25",
         "--report-to", "none", "--save-every", "100", "--choose-checkpoints", "3")


def run(step, *args, python=None, timeout=600):
    p = subprocess.run(host_cmd(f"pipeline.{step}", *map(str, args), python=python), capture_output=True, text=True,
                       env=ENV, timeout=timeout)
    try:
        doc = json.loads(p.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        doc = None
    return p.returncode, doc, p.stderr


def digest(folder: Path) -> dict:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir())
            if f.name in ("config.json", "model.safetensors")}


# ---------------------------------------------------------------------------------------------- the plan

def test_run_all_chooses_after_train_and_evaluates_the_chosen_export(tmp_path):
    """choose_checkpoints adds the choose step between train and eval (offline and online), with its settings."""
    for online, want in ((False, ["prepare", "extract", "vocab", "train", "choose", "eval"]),
                         (True, ["prepare", "vocab", "train", "choose", "eval"])):
        out = tmp_path / f"r{online}"
        e = make_env(tmp_path / f"e{online}", None, extra=f"""pipeline:
  model: /m/t
  dataset: /d/chat.jsonl
  output_dir: /o
  hidden_states: {'online' if online else 'offline'}
  choose_checkpoints: 4
  eval_prompts: mt-bench
""")
        r = e.cli("render", "job", "all", "--host", "local", "--out", str(out), "steps.choose.prompts=8",
                  "steps.choose.batch_size=4")
        assert r.code == 0, r.stderr
        job = "\n".join(p.read_text() for p in out.rglob("*.sh"))
        steps = [s for s in re.findall(r"kimi_eagle_host\.pipeline\.(\w+)", job) if s != "launch"]
        assert steps == want, steps
        sections = json.loads(next(out.rglob("settings.json")).read_text())["steps"]
        assert sections["train"]["choose_checkpoints"] == 4
        assert sections["choose"] == {"model": "/m/t", "output_dir": "/o", "tp_size": 1, "prompts": 8, "batch_size": 4}
        assert "draft" not in sections["eval"]   # eval reads draft/export: the chosen checkpoint


@pytest.mark.parametrize("setting, words", [("choose_checkpoints=-1", "choose_checkpoints: "),
                                            ("steps.choose.max_k=0", "steps.choose.max_k: "),
                                            ("steps.choose.prompts=many", "steps.choose.prompts: ")])
def test_bad_choose_settings_are_one_line_exit_2(tmp_path, setting, words):
    e = make_env(tmp_path, None, extra="pipeline:\n  model: /m/t\n  dataset: /d/chat.jsonl\n")
    r = e.cli("render", "job", "all", "--host", "local", "--out", str(tmp_path / "r"), setting)
    assert r.code == 2, r.stderr
    assert one_line_usage_error(r).startswith(words) or words in one_line_usage_error(r), r.stderr


def test_the_step_refuses_its_own_bad_flags_in_one_line(tmp_path):
    code, doc, err = run("choose", "--model", tmp_path, "--output-dir", tmp_path, "--max-k", "0")
    assert code == 2 and "argument --max-k: expected an integer greater than 0" in err.strip().splitlines()[-1], err
    code, doc, err = run("choose", "--model", tmp_path, "--output-dir", tmp_path)
    assert code == 2 and "candidates.json: missing" in doc["error"], (doc, err)


# ---------------------------------------------------------------------------------------------- train's candidates

@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny Llama target, its prepared data and vocabulary; `offline/` extracted and trained, `online/` trained
    from the engine's stream, both exporting 3 candidates."""
    root = tmp_path_factory.mktemp("choose")
    model = tiny_model.build(str(root / "model"), kind="llama", layers=4, seed=0)["out_dir"]
    off, on = root / "offline", root / "online"
    for step, *args in (("prepare", "--dataset", SAMPLE, "--seq-len", SEQ_LEN, "--max-samples", 16),
                        ("vocab", "--draft-vocab-size", 100),
                        ("extract", "--seq-len", SEQ_LEN, "--batch-size", 1, "--layer-ids", LAYERS)):
        code, _, err = run(step, "--model", model, "--output-dir", off, *args)
        assert code == 0, err
    code, doc_off, err = run("train", "--model", model, "--output-dir", off, *TRAIN)
    assert code == 0, err
    for part in ("prepared", "vocab"):
        shutil.copytree(off / part, on / part)
    spool = root / "spool"
    spool.mkdir()
    code, doc_on, err = run("train", "--model", model, "--output-dir", on, *TRAIN, "--hidden-states", "online",
                            "--layer-ids", LAYERS, "--seq-len", SEQ_LEN, "--engine-batch-size", 1,
                            "--online-spool-dir", spool)
    assert code == 0, err
    return {"model": model, "offline": (off, doc_off), "online": (on, doc_on)}


@pytest.mark.parametrize("mode", ["offline", "online"])
def test_train_exports_candidates_spread_over_the_run_with_its_held_out_documents(trained, mode):
    out, doc = trained[mode]
    assert doc["finished"] and doc["step"] == 6, doc
    rec = json.loads((out / "draft" / "candidates" / "candidates.json").read_text())
    assert [c["step"] for c in rec["candidates"]] == [2, 4, 6]
    assert len(rec["heldout_documents"]) == 4 and rec["total_steps"] == 6
    assert rec["prepared_sha256"] == hashlib.sha256((out / "prepared" / "manifest.json").read_bytes()).hexdigest()
    # the last candidate is the last step's export; the earlier ones differ from it (trained further since)
    cands = out / "draft" / "candidates"
    assert digest(cands / "step_00000006")["model.safetensors"] == digest(out / "draft" / "export")["model.safetensors"]
    assert digest(cands / "step_00000002")["model.safetensors"] != digest(cands / "step_00000006")["model.safetensors"]


def test_online_candidates_are_the_offline_ones(trained):
    """The same held-out documents and the same weights at each step, whether the hidden states came as files or
    from the engine's stream."""
    (off, _), (on, _) = trained["offline"], trained["online"]
    a, b = (json.loads((o / "draft" / "candidates" / "candidates.json").read_text()) for o in (off, on))
    assert a["heldout_documents"] == b["heldout_documents"] and a["candidates"] == b["candidates"]
    for c in a["candidates"]:
        assert digest(off / "draft" / "candidates" / c["dir"]) == digest(on / "draft" / "candidates" / c["dir"])


def test_two_fsdp_ranks_export_the_same_candidates(trained, tmp_path):
    """Under torchrun with FSDP every rank takes part in gathering a candidate's weights; rank 0 writes the same
    candidates (to float tolerance) as one process does."""
    import sys

    import torch
    from safetensors.torch import load_file

    off, _ = trained["offline"]
    out = tmp_path / "fsdp"
    shutil.copytree(off, out, ignore=shutil.ignore_patterns("draft"))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
                        "kimi_eagle_host.pipeline.train", "--model", trained["model"], "--output-dir", str(out), *TRAIN,
                        "--parallel", "fsdp"], capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    a, b = (json.loads((o / "draft" / "candidates" / "candidates.json").read_text()) for o in (off, out))
    assert a["candidates"] == b["candidates"] and a["heldout_documents"] == b["heldout_documents"]
    for c in a["candidates"]:
        ours = load_file(str(out / "draft" / "candidates" / c["dir"] / "model.safetensors"))
        ref = load_file(str(off / "draft" / "candidates" / c["dir"] / "model.safetensors"))
        assert ours.keys() == ref.keys()
        for k in ref:
            assert torch.allclose(ours[k].float(), ref[k].float(), atol=1e-4), (c, k)


def test_no_prompt_choose_serves_opens_a_conversation_training_saw(trained, tmp_path):
    """Conversations that share their first user turn and go on differently all survive curation; holding out one
    and training on its twin would have choose serve a prompt the draft was trained on. The split keeps each
    opening on one side: none of the held-out prompts choose serves is a training document's prompt."""
    from kimi_eagle_host.data.prepared_data import PreparedDataset
    from kimi_eagle_host.pipeline.choose import heldout_prompts

    data = tmp_path / "twins.jsonl"
    openings = ["What is the capital of France?", "Name a prime number.", "How do bees make honey?",
                "Why is the sky blue?", "What is two plus two?", "Who wrote Hamlet?", "What is water made of?",
                "How far is the moon?"]
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": q},
                                                      {"role": "assistant", "content": f"Answer {i}: it depends."}]})
                            + "\n" for q in openings for i in range(2)))
    out = tmp_path / "out"
    for step, *args in (("prepare", "--dataset", data, "--seq-len", SEQ_LEN),
                        ("vocab", "--draft-vocab-size", 100),
                        ("extract", "--seq-len", SEQ_LEN, "--batch-size", 4, "--layer-ids", LAYERS)):
        code, _, err = run(step, "--model", trained["model"], "--output-dir", out, *args)
        assert code == 0, err
    code, _, err = run("train", "--model", trained["model"], "--output-dir", out, *TRAIN)
    assert code == 0, err
    rec = json.loads((out / "draft" / "candidates" / "candidates.json").read_text())
    held = rec["heldout_documents"]
    assert len(held) == 4, rec                     # a quarter of 16: two openings, both of their conversations
    served = {tuple(p) for p in heldout_prompts(str(out), rec, len(held))}
    ds = PreparedDataset(str(out / "prepared"))
    trained_on = {tuple(int(t) for t in ds[d][0][:int(ds[d][1].argmax())]) for d in range(len(ds)) if d not in held}
    assert len(served) == 2 and not served & trained_on, (held, len(served & trained_on))


def test_a_host_that_cannot_serve_fails_the_step_and_keeps_the_export(trained):
    """This Python has no vLLM: nothing can be served, so nothing is chosen: exit 1 in one line, export untouched."""
    out, _ = trained["offline"]
    before = digest(out / "draft" / "export")
    code, doc, err = run("choose", "--model", trained["model"], "--output-dir", out, "--prompts", 2)
    assert code == 1 and doc["ok"] is False, (doc, err)
    assert "vLLM is not importable" in doc["error"] and "choose_checkpoints=0" in doc["error"], doc
    assert digest(out / "draft" / "export") == before
    assert not (out / "choose" / "report.json").exists()


def test_candidates_without_a_held_out_document_are_refused_before_training(trained, tmp_path):
    """choose_checkpoints with a holdout fraction that holds no document out would fail only in choose, after the
    whole training: train refuses it first, in one line naming both settings, and writes no draft."""
    off, _ = trained["offline"]
    out = tmp_path / "o"
    for part in ("prepared", "vocab", "hidden_states"):
        shutil.copytree(off / part, out / part)
    code, doc, err = run("train", "--model", trained["model"], "--output-dir", out,
                         *[a if a != "0.25" else "0.02" for a in TRAIN])
    assert code == 2, err[-2000:]
    assert "--choose-checkpoints 3" in doc["error"] and "--holdout-fraction 0.02 of 16 documents holds none out" \
        in doc["error"], doc
    assert not (out / "draft").exists()


def test_no_held_out_document_or_other_prepared_data_is_bad_input(trained, tmp_path):
    """Nothing to serve that training never saw, or candidates of other prepared data: exit 2 before any engine."""
    off, _ = trained["offline"]
    out = tmp_path / "o"
    for part in ("prepared", "vocab", "draft"):
        shutil.copytree(off / part, out / part)
    rec_path = out / "draft" / "candidates" / "candidates.json"
    rec = json.loads(rec_path.read_text())
    rec_path.write_text(json.dumps({**rec, "heldout_documents": []}))
    code, doc, err = run("choose", "--model", trained["model"], "--output-dir", out)
    assert code == 2 and "no held-out documents" in doc["error"] and "holdout_fraction" in doc["error"], (doc, err)
    rec_path.write_text(json.dumps({**rec, "prepared_sha256": "0" * 64}))
    code, doc, err = run("choose", "--model", trained["model"], "--output-dir", out)
    assert code == 2 and "not the prepared data the candidates were trained on" in doc["error"], (doc, err)


def test_eval_names_what_the_draft_was_trained_on_and_the_chosen_checkpoint(trained, tmp_path):
    """eval's record says how many conversations trained the draft and which checkpoint it is: the last step's
    export, then the candidate the choose step installed (its own install, as after serving), which keeps the
    prompts train recorded beside the export (eval's seen_in_training reads them instead of the prepared data)."""
    from kimi_eagle_host.pipeline.choose import install

    off, _ = trained["offline"]
    out = tmp_path / "o"
    for part in ("prepared", "vocab", "draft"):
        shutil.copytree(off / part, out / part)
    ev = ("eval", "--model", trained["model"], "--output-dir", out, "--prompts", SAMPLE, "--num-prompts", 1,
          "--max-tokens", 4, "--engine", "hf", "--batch-sizes", 1, "--timing-prompts", 1, "--report-to", "none")
    code, doc, err = run(*ev)
    assert code == 0, err[-2000:]
    assert doc["draft_training"] == {"conversations": 12, "held_out_conversations": 4, "steps": 6,
                                     "chosen_step": None, "chosen_why": None, "candidates_served": None}
    assert "12 training conversations, the last of 6 steps" in doc["card"], doc["card"]
    assert doc["seen_in_training"]["seen"] == 1   # its prompt is the first training conversation
    keys = (out / "draft" / "export" / "training_prompts.keys").read_bytes()
    install(str(out / "draft" / "candidates" / "step_00000002"), str(out / "draft" / "export"),
            {"chosen_step": 2, "why": "highest acceptance length", "checkpoints": [{}, {}, {}]})
    assert (out / "draft" / "export" / "training_prompts.keys").read_bytes() == keys
    shutil.rmtree(out / "prepared")   # read from the record now: the warning stays
    code, doc, err = run(*ev, "--no-reuse-baseline")
    assert code == 0, err[-2000:]
    assert doc["seen_in_training"]["seen"] == 1 and "eval: warning: 1 of 1 prompts" in err
    assert doc["draft_training"]["chosen_step"] == 2 and doc["draft_training"]["candidates_served"] == 3
    assert doc["draft_training"]["conversations"] == 12
    assert "checkpoint of step 2 chosen by serving" in doc["card"], doc["card"]


# ---------------------------------------------------------------------------------------------- choosing, unit

def test_the_choice_is_the_best_served_and_none_accepted_is_a_failure():
    from kimi_eagle_host.pipeline.choose import choose
    from kimi_eagle_host.step_runtime import Refused

    recs = [{"step": 2, "acceptance_length": 2.5, "accepted_tokens": 9}, {"step": 4, "acceptance_length": 1.5,
                                                                         "accepted_tokens": 3},
            {"step": 6, "acceptance_length": 2.5, "accepted_tokens": 9}]
    best, why = choose(recs, 5)
    assert best["step"] == 6 and "step 2: 2.50" in why   # a tie goes to the later step
    best, _ = choose(recs[:2], 5)
    assert best["step"] == 2
    with pytest.raises(Refused, match="none of the 2 served checkpoints"):
        choose([{"step": 1, "acceptance_length": 1.0, "accepted_tokens": 0}] * 2, 5)


def test_the_served_prompts_are_spread_over_the_held_out_documents_not_the_first_ones():
    """The held-out list is sorted by index, and a dataset holds its sources in blocks (ShareGPT, then the prompts the
    target wrote): the prompts choose serves come from the whole list, each document once, the same every time."""
    from kimi_eagle_host.pipeline.choose import serving_order

    held = list(range(0, 2000, 2))              # 1,000 documents: 0..998 one source, 1000..1998 the other
    order = serving_order(held, 32)
    first = order[:32]
    assert sorted(order) == held and len(set(order)) == len(held)
    assert sum(d < 1000 for d in first) == 16 and first[0] == 0 and max(first) > 1900
    assert serving_order(held, 32) == order
    assert serving_order(held[:5], 32) == held[:5]   # fewer documents than prompts: all of them, in order


def test_acceptance_at_every_k_from_one_run_and_tokens_per_s_through_both_measurements():
    from kimi_eagle_host.evaluation.served import acceptance_by_k, tokens_per_s_by_k

    # 10 drafts: position 1 accepted in 8, positions 1-2 in 6, 1-3 in 3
    assert acceptance_by_k([8, 6, 3], 10) == [1.8, 2.4, 2.7]
    # the target alone 100 tok/s (10 ms a token); at k=3 2.7 tokens a step at 135 tok/s: 20 ms a step, 10/3 ms a draft
    by = tokens_per_s_by_k(100.0, 135.0, [1.8, 2.4, 2.7])
    assert by[-1] == 135.0 and by == [round(1.8 / (0.01 + 0.01 / 3), 2), round(2.4 / (0.01 + 0.02 / 3), 2), 135.0]
    # A step with the draft timed faster than one without (noise; seen in vLLM at batch 1: 67 against 305 tok/s at
    # 4 tokens a step): the draft is free, every k' takes the step measured at k, and k keeps its measured figure.
    by = tokens_per_s_by_k(67.4, 305.31, [2.0, 3.0, 4.0])
    assert by == [round(2.0 / (4.0 / 305.31), 2), round(3.0 / (4.0 / 305.31), 2), 305.31]


def test_each_batch_size_is_timed_several_times_and_a_one_off_pass_does_not_pick_k():
    """One timing pass is a second or two of decoding; an H200 read 3,622 tokens/s in one pass for a checkpoint whose
    neighbour read 5,027. The figure kept is the median of the passes, and every pass is in the record."""
    from kimi_eagle_host.pipeline import choose

    class Passes:   # an engine whose timed passes read as listed (what vLLM's clock gave), counters of one draft
        def __init__(self, readings):
            self.readings = {b: list(r) for b, r in readings.items()}

        def __call__(self, prompts):
            return 4 * len(prompts), {"drafts": len(prompts), "accepted": len(prompts), "per_pos": [len(prompts)]}

        def timed(self, prompts, batch_size):
            return self.readings[batch_size].pop(0)

    readings = {1: [500.0, 120.0, 510.0], 16: [3000.0, 3100.0, 9000.0]}
    engine = Passes(readings)
    served = choose.serve(engine, 1, [[1]] * 4, [[1]] * 40, [1, 16])
    assert engine.readings == {1: [], 16: []}   # every pass taken
    assert served["tokens_per_s"] == {1: 500.0, 16: 3100.0}
    assert served["timed_runs"] == readings
    rec = choose.figures(5, "d", served, {1: 400.0, 16: 3000.0}, 1, [1, 16], 4)
    assert rec["tokens_per_s"]["16"]["with_draft_k1"] == 3100.0
    assert rec["tokens_per_s"]["16"]["with_draft_k1_runs"] == [3000.0, 3100.0, 9000.0]


# ---------------------------------------------------------------------------------------------- served, real vLLM

@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_only_a_checkpoint_with_the_same_tensors_is_swapped_in(tmp_path):
    """A swap takes only a checkpoint whose config and tensors (names and shapes) are the first's: vLLM's reload
    puts back the old values of whatever it is not given, so a missing tensor would serve the old draft's."""
    from safetensors.torch import load_file, save_file

    from drafts import stub_draft
    from kimi_eagle_host.evaluation.draft_swap import same_shape

    first = stub_draft(tmp_path / "a", 64, 256)
    assert same_shape(first, stub_draft(tmp_path / "b", 64, 256))
    assert not same_shape(first, stub_draft(tmp_path / "c", 64, 256, draft_vocab=64))   # config and shapes
    lacking = stub_draft(tmp_path / "d", 64, 256)
    tensors = load_file(str(lacking / "model.safetensors"))
    del tensors["fc.weight"]
    save_file(tensors, str(lacking / "model.safetensors"))
    assert not same_shape(first, lacking)


def test_a_checkpoint_that_cannot_be_swapped_in_gets_a_new_engine(monkeypatch):
    """The candidates' engine: the first checkpoint starts it, later ones are swapped in; where a swap fails (another
    shape, an older vLLM) that engine is closed and a new one serves the checkpoint, and the log says so."""
    from kimi_eagle_host.pipeline import choose

    events = []

    class Stand(list):   # stands for a vLLM engine: what happened to it, in order
        def __init__(self, args, draft, k, memory, swappable=False):
            super().__init__([draft])
            events.append(("start", draft, swappable))

        def swap(self, draft):
            if draft == "other-shape":
                raise RuntimeError("its config.json is not the first's")
            self.append(draft)

        def close(self):
            events.append(("close", self[-1]))

    said = []
    monkeypatch.setattr(choose, "Engine", Stand)
    monkeypatch.setattr(choose, "log", said.append)
    import argparse

    engines = choose.CandidateEngines(argparse.Namespace(swap_drafts=True), 3, {})
    served_by = [engines.serving(d, step)[1] for step, d in enumerate(["a", "b", "other-shape", "c"], 1)]
    engines.close()
    assert served_by == ["a new engine", "swapped into the running engine", "a new engine",
                         "swapped into the running engine"]
    assert events == [("start", "a", True), ("close", "b"), ("start", "other-shape", True), ("close", "c")]
    assert engines.started == 2 and any("step 3's draft could not be swapped" in line for line in said), said
    # swap_drafts off: an engine each, none asked to swap
    events.clear()
    engines = choose.CandidateEngines(argparse.Namespace(swap_drafts=False), 3, {})
    assert {engines.serving(d, step)[1] for step, d in enumerate(["a", "b"], 1)} == {"a new engine"}
    engines.close()
    assert events == [("start", "a", False), ("close", "a"), ("start", "b", False), ("close", "b")]


CLOSE_WHILE_REFERRED = """
import argparse, json, sys, psutil
from kimi_eagle_host.evaluation.served import ServedEngine
from kimi_eagle_host.vllm_compat import size_engine
args = argparse.Namespace(model=sys.argv[1], vllm_dtype="bfloat16", max_model_len=128, enforce_eager=True, tp_size=1,
                          max_tokens=4)
# the engine core in its own process, as on a GPU
eng = ServedEngine(args, None, 0, size_engine("choose", args.model, 1, 128, 1, in_process_on_cpu=False))
names = {p.pid: " ".join(p.cmdline())[:300] for p in psutil.Process().children(recursive=True)}
# multiprocessing's resource tracker serves this process to its end, whatever engine runs
cores = [psutil.Process(pid) for pid, line in names.items() if "resource_tracker" not in line]
kept = eng.llm   # what the traceback of a failed swap keeps
eng.close()
gone, alive = psutil.wait_procs(cores, timeout=30)
print(json.dumps({"engine_processes": len(cores), "alive_after_close": [names[p.pid] for p in alive]}))
"""


def test_a_closed_engine_stops_while_a_failed_calls_traceback_still_refers_to_it(tmp_path):
    """The engine started after a failed swap found 3.7 of 79 GiB free on an H100: the half-loaded engine, closed
    inside the handler, lived on through the exception's traceback. close() stops the engine core by name: its
    processes are gone at once even while something still refers to the engine (real vLLM 0.32, multiprocess)."""
    from drafts import cycle_target
    from vllm_envs import SUITE_VLLM, env_python

    p = subprocess.run([str(env_python(SUITE_VLLM)), "-c", CLOSE_WHILE_REFERRED, cycle_target(tmp_path)],
                       capture_output=True, text=True, env=ENV, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    doc = json.loads(p.stdout.strip().splitlines()[-1])
    assert doc["engine_processes"] >= 1 and doc["alive_after_close"] == [], doc


def test_the_swap_finds_the_draft_in_either_of_vllms_model_runners():
    """vLLM's first GPU runner (and the CPU runner built on it) holds the draft as drafter.model; the second, which
    0.25.1 runs on CUDA, as speculator.model (the H100 met it: "'GPUModelRunner' object has no attribute
    'drafter'"). No CUDA here, so the runners are stood for by their attributes; a runner with neither is named."""
    from types import SimpleNamespace

    from kimi_eagle_host.evaluation.draft_swap import draft_model

    draft = object()
    assert draft_model(SimpleNamespace(drafter=SimpleNamespace(model=draft))) is draft
    assert draft_model(SimpleNamespace(speculator=SimpleNamespace(model=draft))) is draft
    with pytest.raises(RuntimeError, match="SimpleNamespace serves no draft model"):
        draft_model(SimpleNamespace(speculator=None))


def test_choose_exports_the_checkpoint_that_serves_best_not_the_last(tmp_path):
    """Three candidates of the cycle target: steps 1 and 3 run a token ahead (never accepted), step 2 proposes the
    target's own tokens (accepted at every position). vLLM 0.32 serves them next to the target on held-out prepared
    documents, the later two swapped into the engine started for the first (one target load for all): step 2 is
    exported, its figures at k = 1..3 follow from the per-position counts (k + 1 here), steps 1 and 3 are exactly
    1.00 (a swap that kept the old draft, or a prefix cache holding its keys, would show), and the report names a
    k per batch size."""
    from drafts import cycle_target, known_draft
    from kimi_eagle_host.draft import candidates
    from vllm_envs import SUITE_VLLM, env_python

    py = env_python(SUITE_VLLM)
    target = cycle_target(tmp_path)
    out = tmp_path / "out"
    code, _, err = run("prepare", "--model", target, "--dataset", SAMPLE, "--output-dir", out, "--max-samples", 6)
    assert code == 0, err
    for step, lead in ((1, 2), (2, 1), (3, 2)):
        known_draft(target, candidates.folder(str(out), step), lead=lead)
    sha = hashlib.sha256((out / "prepared" / "manifest.json").read_bytes()).hexdigest()
    candidates.record(str(out), [1, 3, 5], sha, 3)
    code, doc, err = run("choose", "--model", target, "--output-dir", out, "--prompts", 3, "--max-tokens", 16,
                         "--max-k", 3, "--batch-size", 2, python=py, timeout=850)
    assert code == 0, err[-3000:]
    rep = json.loads((out / "choose" / "report.json").read_text())
    assert rep["chosen_step"] == 2 and rep["last_step"] == 3 and "not the last" in doc["headline"], doc["headline"]
    assert rep["prompts"] == 3 and "step 1: 1.00" in rep["why"] and "step 3: 1.00" in rep["why"], rep["why"]
    before, good, after = rep["checkpoints"]
    assert [r["served_by"] for r in rep["checkpoints"]] == ["a new engine"] + ["swapped into the running engine"] * 2
    assert rep["engines_started"] == 2   # the target alone's and the one every candidate was served by
    for r in (before, good, after):   # acceptance length at k' = 1 + accepted through position k' / drafts
        assert r["drafts"] > 0
        want = [round(1 + sum(r["accepted_per_position"][:i + 1]) / r["drafts"], 4) for i in range(3)]
        assert list(r["acceptance_length_by_k"].values()) == want
    assert list(good["acceptance_length_by_k"].values()) == pytest.approx([2, 3, 4], abs=0.1)   # the last round of an answer cut at max_tokens
    for bad in (before, after):
        assert bad["acceptance_length"] == 1.0 and bad["accepted_tokens"] == 0
    assert set(rep["chosen_k"]) == {"1", "2"} and all(1 <= k <= 3 for k in rep["chosen_k"].values())
    for b in ("1", "2"):
        t = good["tokens_per_s"][b]
        assert t["without_draft"] > 0 and t["by_k"]["3"] == t["with_draft_k3"] > 0
        assert t["without_draft"] == rep["without_draft"]["tokens_per_s"][b]
        runs = t["with_draft_k3_runs"]   # the figure is the median of its timed passes
        assert len(runs) == 3 and t["with_draft_k3"] == sorted(runs)[1]
    # the target alone served the same prompts before it was timed, as each candidate did (both sides equally warm,
    # their timed prompts in vLLM's prefix cache): the same greedy answers, token for token in count
    assert rep["without_draft"]["output_tokens"] == good["output_tokens"] == before["output_tokens"] > 3
    # the export is the chosen candidate, whole, with the record of the choice
    export = out / "draft" / "export"
    assert digest(export) == digest(Path(candidates.folder(str(out), 2)))
    assert json.loads((export / "selection.json").read_text())["chosen_step"] == 2
