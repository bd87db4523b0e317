"""Train/serve parity (kimi_eagle_host/draft/parity.py): each mismatch that would cost acceptance silently when
vLLM serves the draft is refused in one line naming it, before training (the real train step on the tiny target of
tests/test_train.py) and on the exported folder (the check as a host runs it, and eval before it loads an engine).
"""
from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from conftest import host_cmd
from safetensors.numpy import load_file, save_file

from test_train import LAYER_IDS, make_pipeline, run_train

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def export_copy(trained, tmp_path):
    """A copy of the shared trained run (target stays shared, read-only): out/ with draft/export and vocab/."""
    p, result = trained
    assert result["ok"], result
    out = tmp_path / "out"
    shutil.copytree(p["out"] / "draft" / "export", out / "draft" / "export")
    shutil.copytree(p["out"] / "vocab", out / "vocab")
    return p["target"], out


def check(target, out, *extra):
    """The export check as a host runs it: (exit code, stderr lines)."""
    r = subprocess.run(host_cmd("draft.parity", "--model", target, "--output-dir", out, *extra),
                       capture_output=True, text=True, timeout=120)
    return r.returncode, [line for line in r.stderr.splitlines() if line.strip()]


def edit_config(out, change):
    path = out / "draft" / "export" / "config.json"
    cfg = json.loads(path.read_text())
    change(cfg)
    path.write_text(json.dumps(cfg))


def test_trained_export_passes(export_copy):
    target, out = export_copy
    rc, lines = check(target, out)
    assert rc == 0, lines


def test_aux_layer_ids_vllm_would_default_refused(export_copy):
    """Without the field vLLM captures its default (2, N//2, N-3) = layers [1, 2] here, not the extracted [1, 2, 3]."""
    target, out = export_copy
    edit_config(out, lambda c: c.pop("eagle_aux_hidden_state_layer_ids"))
    rc, lines = check(target, out)
    assert rc == 2 and len(lines) == 1, lines
    assert "aux layer ids" in lines[0] and "[1, 2]" in lines[0] and str(LAYER_IDS[:-1]) in lines[0]


def test_aux_layer_ids_differing_refused(export_copy):
    target, out = export_copy
    edit_config(out, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[0, 1, 2]))
    rc, lines = check(target, out)
    assert rc == 2 and len(lines) == 1 and "aux layer ids" in lines[0] and "[0, 1, 2]" in lines[0], lines


def test_max_position_embeddings_below_serving_context_refused(export_copy):
    target, out = export_copy
    edit_config(out, lambda c: c["transformer_layer_config"].update(max_position_embeddings=128))
    rc, lines = check(target, out)          # serving context: the target's 256
    assert rc == 2 and len(lines) == 1 and "max_position_embeddings" in lines[0] and "256" in lines[0], lines
    rc, lines = check(target, out, "--max-model-len", "128")
    assert rc == 0, lines                   # served at 128 tokens it fits


def test_rope_not_the_targets_refused(export_copy):
    target, out = export_copy

    def drop_theta(c):
        tl = c["transformer_layer_config"]
        tl["rope_theta"] = 500000.0
        tl["rope_parameters"]["rope_theta"] = 500000.0
    edit_config(out, drop_theta)
    rc, lines = check(target, out)
    assert rc == 2 and len(lines) == 1 and "rope" in lines[0] and "500000" in lines[0], lines


def test_rope_scaling_not_trained_with_refused(export_copy):
    target, out = export_copy
    edit_config(out, lambda c: c["transformer_layer_config"]["rope_parameters"].update(rope_type="linear", factor=4.0))
    rc, lines = check(target, out)
    assert rc == 2 and len(lines) == 1 and "rope" in lines[0] and "linear" in lines[0], lines


def test_rope_scaling_that_only_transformers_4_reads_refused(export_copy):
    """rope_parameters says plain RoPE, as trained, but a rope_scaling field says YaRN: a vLLM <= 0.16 host
    (transformers 4) reads rope_scaling and would serve the draft with positions it was never trained on."""
    target, out = export_copy
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}
    edit_config(out, lambda c: c["transformer_layer_config"].update(rope_scaling=yarn))
    rc, lines = check(target, out)
    assert rc == 2 and len(lines) == 1 and "rope_scaling" in lines[0] and "yarn" in lines[0], lines


def test_broken_vocabulary_map_in_export_refused(export_copy):
    target, out = export_copy
    st = out / "draft" / "export" / "model.safetensors"
    tensors = load_file(str(st))
    tensors["d2t"] = tensors["d2t"].copy()
    tensors["d2t"][1] = tensors["d2t"][0] - 1      # draft token 1 -> the target id of draft token 0
    save_file(tensors, str(st), metadata={"format": "pt"})
    rc, lines = check(target, out)
    assert rc == 2 and len(lines) == 1 and "vocabulary" in lines[0] and "d2t maps 2 draft tokens" in lines[0], lines


def test_export_maps_differing_from_vocab_step_refused(export_copy):
    """Maps consistent with each other but not those training used (rebuilt on a warm start)."""
    target, out = export_copy
    t2d = np.load(out / "vocab" / "t2d.npy")
    ids = np.sort(np.append(np.nonzero(t2d)[0][:-1], np.nonzero(~t2d)[0][0]))   # one draft token swapped
    t2d2 = np.zeros_like(t2d)
    t2d2[ids] = True
    np.save(out / "vocab" / "t2d.npy", t2d2)
    np.save(out / "vocab" / "d2t.npy", (ids - np.arange(len(ids))).astype(np.int64))
    assert not np.array_equal(t2d2, t2d)
    rc, lines = check(target, out)
    assert rc == 2 and len(lines) == 1 and "differs from the vocab step's" in lines[0], lines


def test_train_refuses_d2t_outside_target_vocabulary(tmp_path):
    """Through the real train step: before the check this indexed past t2d (an IndexError traceback, exit 1)."""
    p = make_pipeline(tmp_path)
    d2t = p["d2t"].copy()
    d2t[-1] += 1000
    np.save(p["out"] / "vocab" / "d2t.npy", d2t)
    rc, doc = run_train(p, "--epochs", "1")
    assert rc == 2, doc
    assert "vocabulary" in doc["error"] and "outside the target's" in doc["error"] and "\n" not in doc["error"]
    assert not (p["out"] / "draft").exists()


def test_train_refuses_t2d_not_mapping_back(tmp_path):
    p = make_pipeline(tmp_path)
    t2d = p["t2d"].copy()
    t2d[np.nonzero(t2d)[0][3]] = False
    t2d[np.nonzero(~t2d)[0][0]] = True           # same count, one draft token without its way back
    np.save(p["out"] / "vocab" / "t2d.npy", t2d)
    rc, doc = run_train(p, "--epochs", "1")
    assert rc == 2 and "does not map back" in doc["error"], doc


def test_train_refuses_maps_that_do_not_index_the_targets_lm_head(tmp_path):
    """A target whose lm_head has more rows than its vocab_size (a padded head): t2d does not index it. Before the
    check this was an IndexError traceback (exit 1) after the target's tensors were loaded."""
    from safetensors.torch import load_file as load_pt, save_file as save_pt
    import torch

    p = make_pipeline(tmp_path)
    weights = p["target"] / "model.safetensors"
    sd = load_pt(str(weights))
    sd["lm_head.weight"] = torch.cat([sd["lm_head.weight"], torch.zeros(8, sd["lm_head.weight"].shape[1])])
    save_pt(sd, str(weights), metadata={"format": "pt"})
    rc, doc = run_train(p, "--epochs", "1")
    assert rc == 2, doc
    assert doc["error"].startswith("train/serve parity: vocabulary: the target's lm_head has 72 rows but t2d has 64")
    assert "\n" not in doc["error"] and not (p["out"] / "draft").exists()


def test_lm_head_round_trip_names_the_first_draft_token_whose_row_differs():
    """d2t consistent with t2d as sets but in another order: draft token 0 would start from one row and serve as
    another token."""
    import torch

    from kimi_eagle_host.draft.parity import lm_head_problem

    head = torch.randn(10, 4)
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[2, 5, 7]] = True
    in_order = torch.tensor([2, 5, 7]) - torch.arange(3)
    assert lm_head_problem(head, in_order, t2d, "v") is None
    swapped = torch.tensor([5, 2, 7]) - torch.arange(3)
    assert lm_head_problem(head, swapped, t2d, "v") == ("vocabulary: draft token 0 would start from the target's "
                                                        "lm_head row 2 (t2d) but serve as target id 5 (d2t) (v)")


def test_eval_refuses_unservable_export_before_loading(export_copy, tmp_path):
    target, out = export_copy
    edit_config(out, lambda c: c["transformer_layer_config"].update(max_position_embeddings=128))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    r = subprocess.run(host_cmd("pipeline.eval", "--model", target, "--output-dir", out, "--prompts", prompts,
                                "--engine", "hf", "--device", "cpu", "--report-to", "none"),
                       capture_output=True, text=True, timeout=120)
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "max_position_embeddings" in lines[0], r.stderr[-2000:]
    assert not (out / "eval").exists()


# ------------------------------------------------------------------------------------------ served smoke test

def test_smoke_refuses_an_export_vllm_accepts_nothing_of():
    from kimi_eagle_host.pipeline.eval import smoke_verdict
    from kimi_eagle_host.step_runtime import Refused

    with pytest.raises(Refused, match=r"accepted none of its 12 drafted tokens") as e:
        smoke_verdict({"drafts": 12, "accepted": 0}, "vLLM 0.32.0")
    assert "\n" not in str(e.value)
    assert smoke_verdict({"drafts": 12, "accepted": 5}, "vLLM 0.32.0")["served_smoke"] == "passed"


def test_smoke_without_a_serving_vllm_is_recorded_as_skipped(export_copy):
    """This interpreter has no vLLM: the smoke test cannot run, and says so instead of passing."""
    pytest.importorskip("torch")
    try:
        import vllm  # noqa: F401
        pytest.skip("this interpreter has vLLM")
    except ImportError:
        pass
    target, out = export_copy
    r = subprocess.run(host_cmd("pipeline.eval", "--model", target, "--output-dir", out, "--smoke"),
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["served_smoke"].startswith("skipped (vLLM is not importable"), doc
    assert json.loads((out / "eval" / "smoke.json").read_text())["served_smoke"] == doc["served_smoke"]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_smoke_on_real_vllm_serves_the_export_and_counts_accepted_tokens(tmp_path):
    """vLLM 0.32 (CPU) loads a target and an export of ours and accepts draft tokens. The acceptance is known by
    construction (tests/drafts.py): the target walks a cycle of tokens and the draft proposes its next ones."""
    from drafts import cycle_target, known_draft
    from vllm_envs import SUITE_VLLM, env_python

    py = env_python(SUITE_VLLM)
    target = cycle_target(tmp_path)
    draft = known_draft(target, tmp_path / "draft", lead=1)
    r = subprocess.run(host_cmd("pipeline.eval", "--model", target, "--draft", draft, "--output-dir", tmp_path / "o",
                                "--smoke", "--max-tokens", 16, "--max-model-len", 256, python=py),
                       capture_output=True, text=True, timeout=800)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc["served_smoke"] == "passed" and doc["smoke_prompts"] == 4, doc
    assert doc["smoke_accepted"] >= 0.95 * 3 * doc["smoke_drafts"] > 0, doc    # k = 3, nearly all accepted
