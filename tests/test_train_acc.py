"""The trainer's logged top-1 agreement (acc[k]) is what serving would accept: the draft's choice mapped
to a target id (draft id + d2t) against the target's argmax over its full vocabulary. It used to compare
argmaxes inside the draft vocabulary, which counts a hit whenever the target's real choice lies outside
that vocabulary and the draft picks the best in-vocabulary runner-up."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

TRAIN = Path(__file__).resolve().parents[1] / "remote_payloads" / "pipeline" / "train.py"


def load_train():
    sys.path.insert(0, str(TRAIN.parent))
    spec = importlib.util.spec_from_file_location("kimi_eagle_train_acc", TRAIN)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tr = load_train()


def test_acc_counts_target_choices_outside_the_draft_vocab_as_misses():
    V, K, T = 10, 4, 6
    draft_to_target = torch.tensor([1, 3, 5, 7])            # draft id i -> target id
    full = torch.full((1, T, V), -5.0)
    full[0, :, 3] = 2.0                                      # best in-vocab token everywhere: target 3
    full[0, :3, 8] = 4.0                                     # ...but the target's real choice at t<3 is 8
    target_ids = full.argmax(-1)
    restricted = full[..., draft_to_target]                  # what the loss sees (draft vocab only)
    draft = torch.full((1, T, K), -5.0)
    draft[..., 1] = 3.0                                      # the draft always says draft id 1 = target 3
    mask = torch.ones(1, T, dtype=torch.bool)
    _, _, accs, _ = tr.step_losses([draft], restricted, mask, 1.0, target_ids=target_ids,
                                    draft_to_target=draft_to_target)
    assert accs == [0.5]                                     # 3 of 6: a target choice of 8 is never accepted
    _, _, none, _ = tr.step_losses([draft], restricted, mask, 1.0)
    assert none is None                                      # not computed on steps that do not log


def test_full_vocab_argmax_matches_the_unchunked_head():
    torch.manual_seed(0)
    H, V = 8, 50
    norm = tr.RMSNorm(H, 1e-6)
    head = torch.randn(V, H)
    last = torch.randn(2, 7, H)
    want = torch.nn.functional.linear(norm(last), head).argmax(-1)
    assert torch.equal(tr.full_vocab_argmax(last, norm, head, chunk=3), want)
