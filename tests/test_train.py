"""kimi_eagle_host/pipeline/train.py on CPU: learning, resume determinism, speculators-format export.

Inputs are generated here in the exact formats extract/vocab write (hs_{i}.safetensors +
data_config.json, d2t.npy/t2d.npy) from a tiny random Llama target, with a learnable rule:
tokens follow a fixed permutation f, and the target's final hidden state at position t is built so
that lm_head(norm(h_N[t])) peaks at f(x_t) = x_{t+1}. The draft can learn "next = f(token)" from the
token it is fed, at every TTT depth.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import host_cmd
import torch

REPO = Path(__file__).resolve().parents[1]
TRAIN = host_cmd("pipeline.train")  # as a host runs it
WHEEL_CACHE = Path("/tmp/specwheels")

V, H, N, K = 64, 32, 4, 24          # target vocab, hidden, layers, draft vocab
LAYER_IDS = [1, 2, 3, N]            # vLLM convention; the last is N (final hidden state, pre-norm)
SEQ, SAMPLES = 24, 16


from kimi_eagle_host.pipeline import train as tr
from kimi_eagle_host.draft import draft_model as dm  # noqa: E402  (the model and export; train.py holds the loop)
from kimi_eagle_host.data.hs_manifest import write_manifest  # noqa: E402
# The models here are tiny: extra intra-op threads only add overhead (and contention with other suites).
torch.set_num_threads(1)


def make_target(path: Path, wrapper: bool) -> dict[str, torch.Tensor]:
    """A tiny Llama target. wrapper=True re-saves it like a multimodal wrapper (Kimi-K2.5): nested
    text_config, unknown model_type, 'language_model.' prefixes, two shards + index, and a vision tower
    tensor whose name also ends in 'model.norm.weight'."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=64, num_hidden_layers=N,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 1)          # a peaked target distribution (see module doc)
        model.model.norm.weight.uniform_(0.5, 1.5)  # non-trivial final norm: must really be loaded
    sd = {k: v.contiguous() for k, v in model.state_dict().items()}
    if not wrapper:
        model.save_pretrained(path)
        return sd
    path.mkdir(parents=True)
    pref = {k: ("language_model." + k) for k in sd}
    names = sorted(pref.values())
    shard1 = {pref[k]: v for k, v in sd.items() if pref[k] in names[: len(names) // 2]}
    shard2 = {pref[k]: v for k, v in sd.items() if pref[k] not in shard1}
    shard2["vision_tower.model.norm.weight"] = torch.zeros(H)
    save_file(shard1, str(path / "model-00001-of-00002.safetensors"))
    save_file(shard2, str(path / "model-00002-of-00002.safetensors"))
    wmap = {k: "model-00001-of-00002.safetensors" for k in shard1}
    wmap.update({k: "model-00002-of-00002.safetensors" for k in shard2})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["FakeVLForConditionalGeneration"], "model_type": "fake_vl_for_tests",
        "text_config": cfg.to_dict()}))
    return sd


def make_pipeline(root: Path, wrapper: bool = False) -> dict:
    """Target + hidden_states/ + vocab/ under root; returns the pieces the tests check against."""
    from safetensors.torch import save_file

    sd = make_target(root / "target", wrapper)
    W = sd["lm_head.weight"]
    rng = np.random.default_rng(1)
    draft_ids = np.sort(rng.choice(V, size=K, replace=False))
    t2d = np.zeros(V, dtype=bool)
    t2d[draft_ids] = True
    d2t = (draft_ids - np.arange(K)).astype(np.int64)
    (root / "out" / "vocab").mkdir(parents=True)
    np.save(root / "out" / "vocab" / "d2t.npy", d2t)
    np.save(root / "out" / "vocab" / "t2d.npy", t2d)

    used = rng.permutation(draft_ids)[:16]               # tokens of the synthetic language
    f = dict(zip(used.tolist(), rng.permutation(used).tolist()))
    g = torch.Generator().manual_seed(2)
    aux_tables = torch.randn(len(LAYER_IDS) - 1, V, H, generator=g)   # aux features encode x_t
    hs_dir = root / "out" / "hidden_states"
    hs_dir.mkdir(parents=True)
    for i in range(SAMPLES):
        x = [int(rng.choice(used))]
        for _ in range(SEQ - 1):
            x.append(f[x[-1]])
        ids = torch.tensor(x)
        nxt = torch.tensor([f[t] for t in x])
        hs = torch.empty(SEQ, len(LAYER_IDS), H)
        for li in range(len(LAYER_IDS) - 1):
            hs[:, li] = aux_tables[li][ids] + 0.1 * torch.randn(SEQ, H, generator=g)
        hs[:, -1] = 3.0 * W[nxt]                          # target predicts f(x_t) at position t
        lm = torch.ones(SEQ, dtype=torch.int64)
        lm[:3] = 0
        save_file({"token_ids": ids, "hidden_states": hs.to(torch.bfloat16), "loss_mask": lm},
                  str(hs_dir / f"hs_{i}.safetensors"))
    (hs_dir / "data_config.json").write_text(json.dumps({
        "model": str(root / "target"), "layer_ids": LAYER_IDS, "num_layers": N, "hidden_size": H,
        "layer_convention": "vllm: id i = input of layer i; id N = last layer output before final norm"}))
    write_manifest(str(hs_dir), SAMPLES)   # what extract writes last: train reads exactly these samples
    return {"target": root / "target", "out": root / "out", "d2t": d2t, "t2d": t2d, "sd": sd}


def run_train(p, *extra) -> tuple[int, dict]:
    """Run train.main in-process (saves a torch import per run); stdout carries the JSON result."""
    argv = ["--model", str(p["target"]), "--output-dir", str(p["out"]), "--device", "cpu",
            "--batch-size", "4", "--ttt-steps", "3", "--lr", "3e-3", "--seed", "7", "--log-every", "10",
            *extra]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = tr.main(argv)
    return rc, json.loads(buf.getvalue())


def read_export(out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    exp = out / "draft" / "export"
    return json.loads((exp / "config.json").read_text()), load_file(str(exp / "model.safetensors"))


def train_once(tmp_path_factory):
    """One full training run on the plain target, shared by the learning/export tests (the session fixture
    `trained`, tests/conftest.py)."""
    root = tmp_path_factory.mktemp("trained")
    p = make_pipeline(root)
    rc, doc = run_train(p, "--epochs", "25", "--save-every", "40")
    assert rc == 0, doc
    return p, doc


def test_learns(trained):
    p, doc = trained
    hist = doc["history"]
    first, last = hist[0], hist[-1]
    assert first["step"] == 1 and last["step"] == doc["total_steps"] == 100 and doc["finished"]
    assert last["loss"] < 0.5 * first["loss"], (first, last)
    for k in range(3):  # the acceptance proxy rises at every TTT depth
        assert last["acc"][k] > first["acc"][k] + 0.3, (k, first["acc"], last["acc"])
    assert last["acc"][0] > 0.8


def test_export_format(trained):
    p, doc = trained
    cfg, tensors = read_export(p["out"])
    assert cfg["speculators_model_type"] == "eagle3"
    assert cfg["architectures"] == ["Eagle3DraftModel"]
    assert cfg["draft_vocab_size"] == K
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS[:-1]   # the final id N is not an aux layer
    assert cfg["norm_before_residual"] is True
    tl = cfg["transformer_layer_config"]
    assert tl["model_type"] == "llama" and tl["hidden_size"] == H and tl["vocab_size"] == V
    assert tl["num_hidden_layers"] == 1
    sc = cfg["speculators_config"]
    assert sc["algorithm"] == "eagle3" and sc["default_proposal_method"] == "greedy"
    assert sc["proposal_methods"][0]["speculative_tokens"] == 3
    assert sc["verifier"] == {"name_or_path": str(p["target"]), "architectures": ["LlamaForCausalLM"]}

    hd = H // 4
    expected = {
        "fc.weight": (H, 3 * H),
        "layers.0.hidden_norm.weight": (H,), "layers.0.input_layernorm.weight": (H,),
        "layers.0.post_attention_layernorm.weight": (H,),
        "layers.0.self_attn.q_proj.weight": (4 * hd, 2 * H), "layers.0.self_attn.k_proj.weight": (2 * hd, 2 * H),
        "layers.0.self_attn.v_proj.weight": (2 * hd, 2 * H), "layers.0.self_attn.o_proj.weight": (H, 4 * hd),
        "layers.0.mlp.gate_proj.weight": (64, H), "layers.0.mlp.up_proj.weight": (64, H),
        "layers.0.mlp.down_proj.weight": (H, 64),
        "norm.weight": (H,), "lm_head.weight": (K, H), "d2t": (K,), "t2d": (V,),
        "embed_tokens.weight": (V, H),
    }
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert np.array_equal(tensors["d2t"].numpy(), p["d2t"])
    assert np.array_equal(tensors["t2d"].numpy(), p["t2d"])
    # d2t/t2d round-trip: draft id i -> target id i + d2t[i] is exactly the set t2d marks.
    tgt = np.arange(K) + tensors["d2t"].numpy()
    assert np.array_equal(np.nonzero(tensors["t2d"].numpy())[0], tgt)
    assert torch.equal(tensors["embed_tokens.weight"], p["sd"]["model.embed_tokens.weight"])
    # lm_head is the target's rows for the draft vocabulary (frozen by default, as in speculators).
    assert torch.equal(tensors["lm_head.weight"], p["sd"]["lm_head.weight"][torch.from_numpy(p["t2d"])])
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.json", "model.safetensors"):   # readable like a normal file, not mkstemp's 0600
        assert os.stat(p["out"] / "draft" / "export" / name).st_mode & 0o777 == 0o666 & ~umask
    ck = doc["checkpoint"]
    assert ck.endswith("step_00000100.pt") and os.path.isfile(ck)
    assert not [n for n in os.listdir(os.path.dirname(ck)) if n.endswith(".tmp")]


def test_resume_matches_uninterrupted(tmp_path):
    base = make_pipeline(tmp_path / "a")
    common = ("--epochs", "5", "--save-every", "3", "--lr-schedule", "cosine", "--warmup-steps", "2")
    rc, full = run_train(base, *common)
    assert rc == 0 and full["total_steps"] == 20
    other = make_pipeline(tmp_path / "b")
    rc, part = run_train(other, *common, "--stop-at-step", "7")
    assert rc == 0 and not part["finished"] and part["step"] == 7
    assert not (other["out"] / "draft" / "export").exists()
    rc, rest = run_train(other, *common, "--resume")
    assert rc == 0 and rest["resumed_from_step"] == 7 and rest["finished"]
    _, a = read_export(base["out"])
    _, b = read_export(other["out"])
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert full["final_loss"] == rest["final_loss"]
    # a resume with different settings is refused (exit 2) instead of silently mixing runs
    rc, bad = run_train(other, "--epochs", "9", "--resume")
    assert rc == 2 and "different settings" in bad["error"]


@pytest.mark.parametrize("log_every,save_every", [(1, 5), (4, 1)], ids=["at-a-logging-step", "at-a-save-step"])
def test_diverged_loss_stops_without_saving_or_exporting(tmp_path, log_every, save_every):
    """A learning rate that blows the weights up (the loss is NaN from step 2) must not end as a success with a
    NaN draft exported: the step fails naming the step and what to change, and writes no checkpoint of it,
    whether a logging step or a save step sees it first."""
    p = make_pipeline(tmp_path)
    rc, doc = run_train(p, "--epochs", "2", "--log-every", str(log_every), "--save-every", str(save_every),
                        "--lr", "1e30")
    assert rc == 1 and not doc["ok"] and not doc["finished"], doc
    assert "not finite" in doc["error"] and "at step 2" in doc["error"] and "--lr" in doc["error"], doc["error"]
    assert not (p["out"] / "draft" / "export").exists()
    ckpts = sorted(x.name for x in (p["out"] / "draft" / "checkpoints").glob("step_*.pt"))
    assert ckpts == (["step_00000001.pt"] if save_every == 1 else []), ckpts
    assert doc["history"][-1]["step"] <= 2
    if log_every == 1:   # the NaN step's figures are in the history as null: the answer stays strict JSON
        assert doc["history"][-1]["loss"] is None and doc["final_loss"] is None
    assert "NaN" not in json.dumps(doc) and "Infinity" not in json.dumps(doc)


def test_target_tops_found_once_train_exactly_like_every_step(tmp_path):
    """On CPU, a run that sees the data more than once finds the target's top tokens once, before the first
    step; its first epoch must be the same training as a run that finds them in every step."""
    every = make_pipeline(tmp_path / "a")
    common = ("--lr-schedule", "constant", "--log-every", "1", "--holdout-fraction", "0.25")
    rc, one_epoch = run_train(every, "--epochs", "1", *common)
    assert rc == 0 and one_epoch["target_tops"] == "every step"
    once = make_pipeline(tmp_path / "b")
    rc, first_of_two = run_train(once, "--epochs", "2", "--stop-at-step", str(one_epoch["total_steps"]), *common)
    assert rc == 0 and first_of_two["target_tops"] == "once" and first_of_two["step"] == one_epoch["total_steps"]
    for a, b in zip(one_epoch["history"], first_of_two["history"], strict=True):
        assert (a["loss"], a["acc"], a["cond_acc"]) == (b["loss"], b["acc"], b["cond_acc"]), (a, b)
    assert one_epoch["heldout"] == first_of_two["heldout"]


def test_wrapper_weight_names(tmp_path):
    p = make_pipeline(tmp_path, wrapper=True)
    rc, doc = run_train(p, "--max-steps", "3", "--no-export-embed-tokens")
    assert rc == 0, doc
    cfg, tensors = read_export(p["out"])
    assert "embed_tokens.weight" not in tensors
    assert cfg["speculators_config"]["verifier"]["architectures"] == ["FakeVLForConditionalGeneration"]
    assert torch.equal(tensors["lm_head.weight"], p["sd"]["lm_head.weight"][torch.from_numpy(p["t2d"])])
    names = ["language_model.lm_head.weight", "vision_tower.model.norm.weight", "language_model.model.norm.weight"]
    assert dm.resolve_weight_name(names, "model.norm.weight", "norm", "m") == "language_model.model.norm.weight"
    assert dm.resolve_weight_name(names, "embed_tokens.weight", "embed", "m") is None
    with pytest.raises(dm.BadInput, match="several tensors"):
        dm.resolve_weight_name(["a.model.norm.weight", "b.model.norm.weight"], "model.norm.weight", "norm", "m")


def test_bad_input_exit_2(tmp_path):
    p = make_pipeline(tmp_path)
    dc = p["out"] / "hidden_states" / "data_config.json"
    d = json.loads(dc.read_text())
    d["layer_ids"] = [1, 2, 3]            # final id N missing
    dc.write_text(json.dumps(d))
    rc, doc = run_train(p)
    assert rc == 2 and "layer_ids" in doc["error"]
    assert not (p["out"] / "draft").exists()


def test_foreign_layer_convention_refused(tmp_path):
    p = make_pipeline(tmp_path)
    dc = p["out"] / "hidden_states" / "data_config.json"
    dc.write_text(json.dumps({**json.loads(dc.read_text()), "layer_convention": "hf: output of layer i"}))
    rc, doc = run_train(p)
    assert rc == 2 and "layer_convention" in doc["error"]


def test_export_serving_fields(trained):
    """What vLLM reads besides the weights: rope_theta beside rope_parameters (transformers 4 hosts read only
    rope_theta) and the aux-layer count (vLLM >= 0.25 sizes the fc from it)."""
    p, _ = trained
    cfg, _ = read_export(p["out"])
    tl = cfg["transformer_layer_config"]
    assert tl["rope_theta"] == tl["rope_parameters"]["rope_theta"]
    assert cfg["num_aux_hidden_states"] == tl["num_aux_hidden_states"] == len(LAYER_IDS) - 1


def test_layer_ids_out_of_order_refused(tmp_path):
    # An extraction from before extract sorted the ids: vLLM would feed the draft its aux layers in layer order.
    p = make_pipeline(tmp_path)
    dc = p["out"] / "hidden_states" / "data_config.json"
    dc.write_text(json.dumps({**json.loads(dc.read_text()), "layer_ids": [2, 1, 3, N]}))
    rc, doc = run_train(p)
    assert rc == 2 and "increasing order" in doc["error"]
    assert not (p["out"] / "draft").exists()


def test_full_vocab_and_two_aux_layers_export(tmp_path):
    """A draft vocabulary equal to the target's exports no d2t/t2d (vLLM has no buffer for them then), and two
    aux layers are written as such (fc input 2*H), not padded to vLLM's old default of 3."""
    p = make_pipeline(tmp_path)
    np.save(p["out"] / "vocab" / "d2t.npy", np.zeros(V, dtype=np.int64))
    np.save(p["out"] / "vocab" / "t2d.npy", np.ones(V, dtype=bool))
    hs_dir = p["out"] / "hidden_states"
    from safetensors.torch import load_file, save_file
    for f in hs_dir.glob("hs_*.safetensors"):   # keep two aux layers + N
        t = load_file(str(f))
        t["hidden_states"] = t["hidden_states"][:, 1:].contiguous()
        save_file(t, str(f))
    dc = hs_dir / "data_config.json"
    dc.write_text(json.dumps({**json.loads(dc.read_text()), "layer_ids": LAYER_IDS[1:]}))
    write_manifest(str(hs_dir), SAMPLES)   # another extraction: its own manifest
    rc, doc = run_train(p, "--max-steps", "2")
    assert rc == 0, doc
    cfg, tensors = read_export(p["out"])
    assert "d2t" not in tensors and "t2d" not in tensors
    assert cfg["draft_vocab_size"] == V and tuple(tensors["lm_head.weight"].shape) == (V, H)
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS[1:-1]
    assert cfg["num_aux_hidden_states"] == 2 and tuple(tensors["fc.weight"].shape) == (H, 2 * H)
    # eval's transformers engine serves it: each draft id is the same target id
    from kimi_eagle_host.evaluation.spec_hf import load_draft
    _, aux, draft_to_target, _ = load_draft(str(p["out"] / "draft" / "export"), torch.zeros(V, H), "cpu")
    assert aux == LAYER_IDS[1:-1] and draft_to_target.tolist() == list(range(V))


def test_resume_refuses_another_target(tmp_path):
    p = make_pipeline(tmp_path / "a")
    rc, part = run_train(p, "--epochs", "5", "--save-every", "2", "--stop-at-step", "2")
    assert rc == 0 and part["step"] == 2
    other = tmp_path / "other-target"
    shutil.copytree(p["target"], other)   # same shapes, another model: its head must not meet these features
    rc, bad = run_train({**p, "target": other}, "--epochs", "5", "--save-every", "2", "--resume")
    assert rc == 2 and "different settings" in bad["error"] and "model" in bad["error"]


def _record_extraction(p, **fields):
    """data_config.json as extract writes it for this target: its weights' fingerprint and the cut."""
    from kimi_eagle_host.step_runtime import model_fingerprint

    dc = p["out"] / "hidden_states" / "data_config.json"
    record = {**json.loads(dc.read_text()), "weights_fingerprint": model_fingerprint(str(p["target"])),
              "seq_len": SEQ, "prepared_sha256": "a" * 64, **fields}
    dc.write_text(json.dumps(record))
    write_manifest(str(dc.parent), SAMPLES, record["prepared_sha256"])   # an extraction's own manifest


def test_hidden_states_of_other_weights_layers_or_cut_are_refused(tmp_path):
    """Offline, train reads what extract wrote: features of another target's weights beside this target's head,
    other layers than --layer-ids names, or a shorter cut than the files hold would train a draft that serves
    worse with exit 0. Each is one line, exit 2, before any step."""
    from safetensors.torch import load_file, save_file

    p = make_pipeline(tmp_path)
    _record_extraction(p)
    other = tmp_path / "retrained-target"
    shutil.copytree(p["target"], other)   # the same shapes and config, other weights
    weights = load_file(str(other / "model.safetensors"))
    weights["lm_head.weight"] = weights["lm_head.weight"] * 1.01
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    for extra, says in [(("--seq-len", str(SEQ - 4)), "--seq-len"), (("--layer-ids", "1,3,4"), "--layer-ids")]:
        rc, doc = run_train(p, "--max-steps", "1", *extra)
        assert rc == 2 and says in doc["error"], doc
    rc, doc = run_train({**p, "target": other}, "--max-steps", "1")
    assert rc == 2 and "other weights" in doc["error"] and str(other) in doc["error"], doc
    assert not (p["out"] / "draft").exists()
    rc, doc = run_train(p, "--max-steps", "1", "--seq-len", str(SEQ), "--layer-ids", ",".join(map(str, LAYER_IDS)))
    assert rc == 0, doc


@pytest.mark.parametrize("change", ["prepared data", "cut", "vocabulary"])
def test_resume_refuses_other_data_or_another_vocabulary(tmp_path, change):
    """A checkpoint continues only the documents it was trained on, in its order, and its head's rows only for the
    tokens they were trained for."""
    p = make_pipeline(tmp_path)
    _record_extraction(p)
    common = ("--epochs", "5", "--save-every", "2")
    rc, part = run_train(p, *common, "--stop-at-step", "2")
    assert rc == 0 and part["step"] == 2
    if change == "vocabulary":   # the same size, other tokens
        t2d = np.load(p["out"] / "vocab" / "t2d.npy")
        ids = np.sort(np.append(np.flatnonzero(t2d)[:-1], np.flatnonzero(~t2d)[0]))
        t2d = np.zeros_like(t2d)
        t2d[ids] = True
        d2t = (ids - np.arange(len(ids))).astype(np.int64)
        np.save(p["out"] / "vocab" / "d2t.npy", d2t)
        np.save(p["out"] / "vocab" / "t2d.npy", t2d)
        key = "draft_vocab_sha256"
    else:
        key = {"prepared data": "prepared_sha256", "cut": "seq_len"}[change]
        _record_extraction(p, **{key: "b" * 64 if key == "prepared_sha256" else SEQ + 8})
    rc, bad = run_train(p, *common, "--resume")
    assert rc == 2 and "different settings" in bad["error"] and key in bad["error"], bad


def test_a_run_from_step_0_removes_an_earlier_runs_checkpoints_and_candidates(tmp_path):
    """Kept, an earlier run's checkpoints outrank the new run's own (the highest steps are kept) and a --resume
    continues them; its candidates would be served by choose as this run's. This run stopped and started again
    without --resume is refused instead: its checkpoints are what a forgotten flag would cost."""
    p = make_pipeline(tmp_path)
    common = ("--epochs", "5", "--save-every", "2", "--holdout-fraction", "0.25")
    rc, first = run_train(p, *common, "--choose-checkpoints", "2")
    assert rc == 0 and (p["out"] / "draft" / "candidates").is_dir(), first
    chosen = p["out"] / "draft" / "export" / "selection.json"   # choose's record, as it installs a candidate
    chosen.write_text(json.dumps({"chosen_step": 10}))
    rc, part = run_train(p, *common, "--lr", "1e-3", "--stop-at-step", "4")
    assert rc == 0 and part["step"] == 4
    assert sorted(f.name for f in (p["out"] / "draft" / "checkpoints").iterdir()) == [
        "step_00000002.pt", "step_00000004.pt"]
    assert not (p["out"] / "draft" / "candidates").exists()
    # the same run started again from step 0 by a forgotten --resume: refused, its checkpoints kept
    rc, again = run_train(p, *common, "--lr", "1e-3")
    assert rc == 2 and "--resume" in again["error"] and "stopped at step 4 of" in again["error"], again
    assert len(list((p["out"] / "draft" / "checkpoints").iterdir())) == 2
    rc, rest = run_train(p, *common, "--lr", "1e-3", "--resume")
    assert rc == 0 and rest["resumed_from_step"] == 4 and rest["finished"], rest
    assert not chosen.exists()   # this run's export is no chosen checkpoint: eval must not say it is


def test_help():
    r = subprocess.run([*TRAIN, "--help"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0
    for flag in ("--model", "--output-dir", "--epochs", "--lr", "--batch-size", "--ttt-steps", "--device",
                 "--dtype", "--resume", "--max-steps", "--seed", "--log-every", "--save-every"):
        assert flag in r.stdout


# ---------------------------------------------------------------------------------------------------
# speculators' own Eagle3DraftModel loads the export and computes the same logits as our model.

SPEC_SCRIPT = textwrap.dedent("""
    import sys, types, json, torch
    # speculators 0.9 imports these at package import time for its data pipeline only; the model
    # class does not use them, so empty stand-ins are enough to import it here.
    class Stub(types.ModuleType):
        def __getattr__(self, name):
            if name.startswith('__'): raise AttributeError(name)
            return type(name, (), {})
    for n in ['openai', 'openai.types', 'openai.types.chat', 'openai.types.completion', 'datasets',
              'hs_connectors']:
        m = Stub(n); m.__path__ = []; sys.modules.setdefault(n, m)
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    export, inputs, dest = sys.argv[1:4]
    cfg = Eagle3SpeculatorConfig.from_pretrained(export)
    cfg.transformer_layer_config._attn_implementation = 'eager'
    model = Eagle3DraftModel.from_pretrained(export, config=cfg).eval()
    got = []
    model.lm_head.register_forward_hook(lambda mod, i, o: got.append(o.detach()))
    x = torch.load(inputs)
    with torch.no_grad():
        model(hidden_states=x['aux'], input_ids=x['ids'], document_ids=torch.zeros_like(x['ids']), ttt_steps=3)
    torch.save({'logits': got, 'aux_ids': model.target_layer_ids,
                'd2t': model.d2t, 't2d': model.t2d}, dest)
""")


def install_speculators_09(tmp_path_factory):
    """The session fixture `speculators_site` (tests/conftest.py): speculators 0.9.0 (+ loguru, which its weight loader imports, and hs-connectors, which its train config
    reads) in a throwaway --target dir."""
    site = tmp_path_factory.mktemp("spec09")
    pkgs = []
    for name, pin in (("speculators", "speculators==0.9.0"), ("hs_connectors", "hs-connectors==0.9.0")):
        wheel = sorted(WHEEL_CACHE.glob(f"{name}-0.9.0-*.whl")) if WHEEL_CACHE.is_dir() else []
        pkgs.append(str(wheel[0]) if wheel else pin)
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        "--target", str(site), *pkgs, "loguru==0.7.3"], capture_output=True, text=True, timeout=300)
    if r.returncode != 0:
        why = f"cannot install speculators 0.9.0 --no-deps: {r.stderr.strip()[-300:]}"
        if os.environ.get("KIMI_EAGLE_NEED_SPECULATORS") == "1":   # CI: the comparisons with it must run
            pytest.fail(why)
        pytest.skip(why)
    return site


def test_speculators_loads_export_same_logits(trained, speculators_site, tmp_path):
    from safetensors.torch import load_file

    p, _ = trained
    exp = p["out"] / "draft" / "export"
    cfg = json.loads((exp / "config.json").read_text())
    # Our model, rebuilt from the export alone.
    tl = cfg["transformer_layer_config"]
    c = {"hidden_size": tl["hidden_size"], "num_attention_heads": tl["num_attention_heads"],
         "num_key_value_heads": tl["num_key_value_heads"], "head_dim": tl["head_dim"],
         "intermediate_size": tl["intermediate_size"], "rms_norm_eps": tl["rms_norm_eps"],
         "rope_theta": tl["rope_parameters"]["rope_theta"]}
    ours = dm.Eagle3Draft(c, len(cfg["eagle_aux_hidden_state_layer_ids"]), cfg["draft_vocab_size"],
                          cfg["norm_before_residual"])
    sd = load_file(str(exp / "model.safetensors"))
    embed = sd.pop("embed_tokens.weight")
    ours.load_state_dict({k: v for k, v in sd.items() if k not in ("d2t", "t2d")})
    from kimi_eagle_host.data import packing

    doc = str(p["out"] / "hidden_states" / "hs_0.safetensors")
    b = packing.build_rows([doc], [[0]], SEQ - 1, 3 * H, H, torch.float32)
    aux, ids = b["aux"], b["ids"]
    with torch.no_grad():   # both attention paths: the reference one and flex_attention (eager on CPU)
        mine = ours(aux, ids, lambda t: torch.nn.functional.embedding(t, embed), 3, b["positions"], b["doc_ids"])
        flex = ours(aux, ids, lambda t: torch.nn.functional.embedding(t, embed), 3, b["positions"], b["doc_ids"],
                    flex=True)
    torch.save({"aux": aux, "ids": ids}, tmp_path / "in.pt")
    script = tmp_path / "spec.py"
    script.write_text(SPEC_SCRIPT)
    env = {**os.environ, "PYTHONPATH": str(speculators_site)}
    r = subprocess.run([sys.executable, str(script), str(exp), str(tmp_path / "in.pt"), str(tmp_path / "o.pt")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = torch.load(tmp_path / "o.pt")
    assert theirs["aux_ids"] == LAYER_IDS[:-1]
    assert torch.equal(theirs["d2t"], torch.from_numpy(p["d2t"]))
    assert torch.equal(theirs["t2d"], torch.from_numpy(p["t2d"]))
    assert len(theirs["logits"]) == 3
    for k in range(3):
        torch.testing.assert_close(mine[k], theirs["logits"][k], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(flex[k], theirs["logits"][k], rtol=1e-4, atol=1e-4)
