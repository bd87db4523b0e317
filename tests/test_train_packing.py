"""The trainer's fast paths give the numbers of the plain ones, on a real tiny draft:

- the TTT attention without a [T, k*T] mask (reference path and flex_attention) equals the dense-mask attention
  it replaced, at every TTT step, with GQA and padding;
- documents packed into one row give the logits, loss and gradients of the same documents padded one per row;
- the chunked lm_head + KL equals the whole-vocabulary formula, values and gradients;
- packing puts every document in exactly one row; a step's rows split over ranks add up to the step;
- a resumed run with feature noise and loader workers equals an uninterrupted one; RNG state is restored
  only where it applies (a checkpoint of 2 GPUs resumed on 1 used to die with an IndexError);
- knobs: held-out figures per position, Muon, TTT depth 7 (8 refused).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_train import make_pipeline, read_export, run_train

from kimi_eagle_host.draft import draft_model as dm
from kimi_eagle_host.data import packing
from kimi_eagle_host.training import ttt_loss
from kimi_eagle_host.training.checkpoints import restore_rng

CFG = dict(hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
           rms_norm_eps=1e-6, rope_theta=10000.0)
K_DRAFT, VOCAB = 24, 64


def tiny_draft(seed=0, layers=1):
    torch.manual_seed(seed)
    m = dm.Eagle3Draft({**CFG, "num_hidden_layers": layers}, 3, K_DRAFT, True)
    for p in m.parameters():
        p.data.normal_(0, 0.2)
    return m, torch.randn(VOCAB, 32)


def dense_mask_reference(m, embed, aux, ids, valid, steps):
    """The attention as it was: every step's keys concatenated, one dense [B,1,T,(k+1)T] boolean mask."""
    B, T = ids.shape
    pos = (1 + torch.arange(T)).expand(B, T)
    idx = torch.arange(T)
    causal = (idx[:, None] >= idx[None, :])[None] & valid[:, None, :]
    diag = torch.eye(T, dtype=torch.bool).expand(B, T, T)
    h, kv, out, x = m.fc(aux), [[] for _ in m.layers], [], ids
    for k in range(steps):
        mask = torch.cat([causal] + [diag] * k, -1)[:, None]
        h = m.incremental(F.embedding(x, embed), h, pos + k, mask, kv)
        out.append(m.lm_head(m.norm(h)))
        x = torch.cat([ids[:, k + 1:], ids.new_zeros(B, min(k + 1, T))], 1)[:, :T]
    return out


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("flex", [False, True])
def test_attention_without_dense_mask_equals_the_dense_one(flex, layers):
    """Also for a draft of two layers (draft_layers 2): training's TTT unroll equals the incremental path eval's
    proposer runs, layer by layer, each layer with its own keys and values."""
    m, embed = tiny_draft(layers=layers)
    B, T = 2, 20
    aux, ids = torch.randn(B, T, 96), torch.randint(0, VOCAB, (B, T))
    valid = torch.ones(B, T, dtype=torch.bool)
    valid[1, 15:] = False
    with torch.no_grad():
        want = dense_mask_reference(m, embed, aux, ids, valid, 4)
        got = m(aux, ids, lambda t: F.embedding(t, embed), 4, doc_ids=torch.where(valid, 0, -1), flex=flex)
    for k in range(4):
        torch.testing.assert_close(got[k][valid], want[k][valid], rtol=1e-5, atol=1e-5)


def docs(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(n, 96, generator=g), torch.randn(n, 32, generator=g),
             torch.randint(0, VOCAB, (n,), generator=g), torch.rand(n, generator=g) > 0.2) for n in lengths]


def batch_of(rows, width):
    """Packed tensors of rows (lists of documents) like packing.build_rows makes them."""
    R = len(rows)
    b = {"aux": torch.zeros(R, width, 96), "last": torch.zeros(R, width, 32), "ids": torch.zeros(R, width).long(),
         "loss_mask": torch.zeros(R, width, dtype=torch.bool), "doc_ids": torch.full((R, width), -1),
         "positions": torch.ones(R, width).long()}
    for r, row in enumerate(rows):
        at = 0
        for d, (a, last, i, lm) in row:
            n = i.shape[0]
            b["aux"][r, at:at + n], b["last"][r, at:at + n], b["ids"][r, at:at + n] = a, last, i
            b["loss_mask"][r, at:at + n], b["doc_ids"][r, at:at + n] = lm, d
            b["positions"][r, at:at + n] = torch.arange(1, n + 1)
            at += n
    return b


def loss_and_grads(m, embed, rows_, b, steps, flex=False):
    m.zero_grad()
    target_norm = dm.RMSNorm(32, 1e-6)
    rows = torch.randn(K_DRAFT, 32, generator=torch.Generator().manual_seed(5))
    target_h = target_norm(b["last"])
    scored = ttt_loss.step_masks(b["loss_mask"], b["doc_ids"], steps)
    denoms = torch.stack([s.sum() for s in scored]).float()
    loss, per_step, _ = m(b["aux"], b["ids"], lambda t: F.embedding(t, embed), steps, b["positions"], b["doc_ids"],
                          flex, loss_fn=lambda normed, w: ttt_loss.ttt_loss(normed, w, target_h, rows, scored, denoms,
                                                                             0.8, torch.float32))
    loss.backward()
    return loss.detach(), per_step, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def test_packed_rows_equal_padded_rows():
    m, embed = tiny_draft(3)
    ds = list(enumerate(docs([7, 11, 5])))
    packed = batch_of([ds], 23)
    padded = batch_of([[d] for d in ds], 11)
    steps = 3
    with torch.no_grad():
        lp = m(packed["aux"], packed["ids"], lambda t: F.embedding(t, embed), steps, packed["positions"],
               packed["doc_ids"])
        ld = m(padded["aux"], padded["ids"], lambda t: F.embedding(t, embed), steps, padded["positions"],
               padded["doc_ids"])
    starts = [0, 7, 18]
    for k in range(steps):
        for (d, (_, _, i, _)), s in zip(ds, starts):
            n = i.shape[0] - k     # positions whose step-k guess stays inside the document
            torch.testing.assert_close(lp[k][0, s:s + n], ld[k][d, :n], rtol=1e-5, atol=1e-5)
    m.lm_head.weight.requires_grad_(True)
    a = loss_and_grads(m, embed, None, packed, steps)       # (flex_attention has no backward on CPU)
    b = loss_and_grads(m, embed, None, padded, steps)
    torch.testing.assert_close(a[0], b[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(a[1], b[1], rtol=1e-5, atol=1e-6)
    for n in b[2]:
        torch.testing.assert_close(a[2][n], b[2][n], rtol=1e-4, atol=1e-6, msg=n)


def test_chunked_kl_equals_the_whole_vocabulary_formula(monkeypatch):
    torch.manual_seed(0)
    N, H, K = 37, 16, 50
    h = torch.randn(N, H, requires_grad=True)
    W = torch.randn(K, H, requires_grad=True)
    t, rows = torch.randn(N, H), torch.randn(K, H)
    w = (torch.rand(N) > 0.3).float() / 20
    monkeypatch.setattr(ttt_loss, "CHUNK_ELEMENTS", 8 * K)   # 8 positions per chunk: 5 chunks, the last short
    loss, top = ttt_loss._ChunkedKL.apply(h, W, t, rows, w, ttt_loss.chunk_rows(K), torch.float32)
    loss.backward()
    gh, gW = h.grad.clone(), W.grad.clone()
    h.grad = W.grad = None
    q = F.softmax(t @ rows.T, -1)
    want = ((q * (q.log() - F.log_softmax(h @ W.T, -1))).sum(-1) * w).sum()
    want.backward()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(gh, h.grad)
    torch.testing.assert_close(gW, W.grad)
    assert torch.equal(top, (h @ W.T).argmax(-1))


def test_packing_places_every_document_once():
    lengths = [5, 17, 3, 9, 9, 30, 1, 12, 16, 8] * 7
    rows = packing.pack_rows(lengths, 32, seed=4)
    assert sorted(d for r in rows for d in r) == list(range(len(lengths)))
    assert all(sum(min(lengths[d], 32) for d in r) <= 32 for r in rows)
    assert len(rows) <= -(-sum(min(n, 32) for n in lengths) // 32) + 2     # nearly full rows
    assert rows == packing.pack_rows(lengths, 32, seed=4)
    plan = packing.Plan(rows, 5, seed=4)
    for step in range(plan.steps_per_epoch + 2):
        parts = [plan.rank_rows(step, r, 2) for r in range(2)]
        assert all(len(p) == 3 for p in parts)                             # same shape on every rank
        assert sorted(map(tuple, parts[0] + parts[1])) == sorted(map(tuple, plan.step_rows(step) + [[]] * (6 - len(plan.step_rows(step)))))


def test_rng_restored_only_where_it_applies():
    set_cpu, set_cuda = [], []
    two_ranks = {"world_size": 2, "rng": [{"cpu": "c0", "cuda": "g0"}, {"cpu": "c1", "cuda": "g1"}]}
    said = restore_rng(two_ranks, 0, 1, 1, set_cpu.append, set_cuda.append)
    assert "not restored" in said and set_cpu == set_cuda == []
    assert restore_rng(two_ranks, 1, 2, 2, set_cpu.append, set_cuda.append) == "RNG state restored"
    assert set_cpu == ["c1"] and set_cuda == ["g1"]
    # A checkpoint of the old layout from one process that saw 2 GPUs (get_rng_state_all), resumed with 1 GPU:
    # set_rng_state_all raised IndexError; now only this rank's own device state is used.
    set_cpu, set_cuda = [], []
    old = {"rng_cpu": "c", "rng_cuda": ("g0", "g1")}
    assert restore_rng(old, 0, 1, 1, set_cpu.append, set_cuda.append) == "RNG state restored"
    assert set_cpu == ["c"] and set_cuda == ["g0"]
    old2 = {"rng_cpu": "c", "rng_cuda": ("g0", "g1"), "world_size": 2}
    assert "not restored" in restore_rng(old2, 0, 1, 1, set_cpu.append, set_cuda.append)


def test_resume_with_noise_and_loader_workers_matches_uninterrupted(tmp_path):
    common = ("--epochs", "3", "--save-every", "100", "--feature-noise", "0.05", "--lr-schedule", "linear",
              "--warmup-steps", "2", "--log-every", "1")
    a = make_pipeline(tmp_path / "a")
    rc, full = run_train(a, *common)
    assert rc == 0 and full["total_steps"] == 12
    b = make_pipeline(tmp_path / "b")
    rc, part = run_train(b, *common, "--stop-at-step", "5", "--loader-workers", "2")
    assert rc == 0 and part["step"] == 5
    rc, rest = run_train(b, *common, "--resume", "--loader-workers", "2")
    assert rc == 0 and rest["finished"], rest
    assert [h["loss"] for h in part["history"] + rest["history"]] == pytest.approx(
        [h["loss"] for h in full["history"]], rel=1e-6)
    _, x = read_export(a["out"])
    _, y = read_export(b["out"])
    for k in x:
        assert torch.equal(x[k], y[k]), k
    rc, quiet = run_train(make_pipeline(tmp_path / "c"), *common[:2], "--max-steps", "3")
    assert quiet["history"][-1]["loss"] != full["history"][2]["loss"]      # the noise is really there


def test_heldout_figures_per_position(tmp_path):
    p = make_pipeline(tmp_path)
    rc, doc = run_train(p, "--epochs", "30", "--holdout-fraction", "0.25", "--eval-every", "30")
    assert rc == 0, doc
    assert doc["samples"] == 16 and doc["heldout"]["documents"] == 4
    assert doc["total_steps"] == 90                                     # 12 training documents, 4 per step
    first, last = doc["heldout_history"][0], doc["heldout"]
    assert len(last["cond_acc"]) == len(last["acc"]) == len(last["step_losses"]) == 3
    # conditional acceptance cannot rise with depth (a chain of hits only gets shorter)
    assert all(x >= y for x, y in zip(last["cond_acc"], last["cond_acc"][1:]))
    assert last["accept_len"] == pytest.approx(1 + sum(last["cond_acc"]), abs=1e-3)
    assert last["accept_len"] > first["accept_len"] and last["accept_len"] > 2.0, doc["heldout_history"]
    # the rounds serving would run on the same text: one per draft, each position at most as often as the one
    # before, and never more than the average over every index promises on this learnable data
    served = last["served_like"]
    assert served["rounds"] > 0 and len(served["cond_acc"]) == 3
    assert all(x >= y for x, y in zip(served["cond_acc"], served["cond_acc"][1:]))
    assert served["accept_len"] == pytest.approx(1 + sum(served["cond_acc"]), abs=1e-3)
    assert 1.0 < served["accept_len"] <= last["accept_len"] + 1e-6, (served, last)
    # the same rounds at every k <= 3 tokens a round: each more token can only add, k = 3 is the figure above
    by_k = [last["served_like_by_k"][k] for k in ("1", "2", "3")]
    assert 1.0 < by_k[0] <= by_k[1] <= by_k[2] == served["accept_len"], by_k


def test_holdout_max_samples_caps_the_split_and_keeps_prompts_together():
    """A cap on the held-out documents (online keeps them all in its spool for the whole run): the first of the same
    seeded order, whole prompt groups still on one side; no cap is the fraction's split."""
    from kimi_eagle_host.training.data_plan import split_holdout

    keys = [d // 3 for d in range(300)]                      # 100 prompts, three documents each
    train, held = split_holdout(300, 0.2, 5, keys)
    assert len(held) == 60
    train_c, held_c = split_holdout(300, 0.2, 5, keys, cap=10)
    assert len(held_c) == 9 and set(held_c) < set(held)        # three whole groups of the same order
    assert {keys[d] for d in held_c}.isdisjoint(keys[d] for d in train_c)
    assert sorted(train_c + held_c) == list(range(300))
    assert split_holdout(300, 0.2, 5, keys, cap=1000) == (train, held)
    assert split_holdout(300, 0.2, 5, None, cap=7)[1] == split_holdout(300, 7 / 300 + 1e-9, 5)[1]


def test_train_honours_holdout_max_samples_and_a_changed_split_does_not_resume(tmp_path):
    """--holdout-max-samples caps what train holds out; a resume compares the split (its held-out count), so a cap
    that changes it is refused like another holdout_fraction, and one that holds out the same documents
    continues."""
    p = make_pipeline(tmp_path)
    common = ("--epochs", "2", "--holdout-fraction", "0.25", "--save-every", "100")
    rc, part = run_train(p, *common, "--holdout-max-samples=2", "--stop-at-step", "2")
    assert rc == 0 and part["step"] == 2, part
    rc, doc = run_train(p, *common, "--holdout-max-samples=3", "--resume")
    assert rc == 2 and "'holdout': (2, 3)" in doc["error"], doc
    # 0.125 of 16 documents without a cap holds out the same 2: the same data, continued
    rc, rest = run_train(p, "--epochs", "2", "--holdout-fraction", "0.125", "--save-every", "100", "--resume")
    assert rc == 0 and rest["resumed_from_step"] == 2 and rest["heldout"]["documents"] == 2, rest


def test_muon_and_seven_ttt_steps(tmp_path, capsys):
    p = make_pipeline(tmp_path)
    rc, doc = run_train(p, "--max-steps", "6", "--ttt-steps", "7", "--optimizer", "muon", "--log-every", "1")
    assert rc == 0 and doc["optimizer"] == "muon" and len(doc["final_cond_acc"]) == 7, doc
    assert doc["history"][-1]["loss"] < doc["history"][0]["loss"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:   # the schema's range, checked as the flags are read
        run_train(p, "--ttt-steps", "8")
    assert refused.value.code == 2 and "expected an integer from 1 to 7 (got 8)" in capsys.readouterr().err


def test_a_two_layer_draft_trains_exports_and_loads(tmp_path, capsys):
    """draft_layers 2: the trainer fits a draft of two decoder layers, the export says so and holds both layers'
    tensors (what vLLM loads: tests/test_known_acceptance.py serves one), eval's loader reads it back as trained;
    a resume with another depth, and speculators' trainer (which builds one layer) asked for two, are refused."""
    from kimi_eagle_host.evaluation.spec_hf import load_draft

    p = make_pipeline(tmp_path)
    rc, doc = run_train(p, "--max-steps", "8", "--draft-layers", "2", "--log-every", "1", "--save-every", "4")
    assert rc == 0 and doc["finished"], doc
    assert doc["history"][-1]["loss"] < doc["history"][0]["loss"]
    cfg, tensors = read_export(p["out"])
    assert cfg["transformer_layer_config"]["num_hidden_layers"] == 2
    second = sorted(k for k in tensors if k.startswith("layers.1."))
    assert "layers.1.self_attn.q_proj.weight" in second and "layers.1.mlp.down_proj.weight" in second
    assert tensors["layers.1.self_attn.q_proj.weight"].shape[1] == tensors["fc.weight"].shape[0]  # reads H, not 2H
    assert tensors["layers.0.self_attn.q_proj.weight"].shape[1] == 2 * tensors["fc.weight"].shape[0]
    draft = load_draft(str(p["out"] / "draft" / "export"), None, "cpu")[0]
    assert len(draft.layers) == 2
    assert torch.equal(draft.layers[1].mlp.up_proj.weight, tensors["layers.1.mlp.up_proj.weight"].float())

    rc, bad = run_train(p, "--max-steps", "8", "--draft-layers", "1", "--resume")
    assert rc == 2 and "different settings" in bad["error"] and "draft_shape" in bad["error"], bad
    rc, bad = run_train(p, "--max-steps", "8", "--draft-layers", "2", "--trainer", "speculators")
    assert rc == 2 and bad["error"].startswith("--draft-layers: only with --trainer ours"), bad
    capsys.readouterr()
    with pytest.raises(SystemExit) as refused:   # the schema's range
        run_train(p, "--draft-layers", "5")
    assert refused.value.code == 2 and "from 1 to 4 (got 5)" in capsys.readouterr().err
