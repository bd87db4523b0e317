"""What the trainer counts as accepted, and which positions its loss sees.

acc[k] is what serving would accept: the draft's choice mapped to a target id (draft id + d2t) against the
target's argmax over its FULL vocabulary (it once compared argmaxes inside the draft vocabulary, counting a hit
whenever the target's real choice lay outside it). cond_acc[k] counts position k only if every earlier position
from the same index was accepted, as vLLM counts accepted tokens per position. Positions whose target choice has
no draft id leave the loss (EAGLE, SpecForge) but stay misses for acceptance."""
from __future__ import annotations


import torch

from kimi_eagle_host.draft.draft_model import RMSNorm
from kimi_eagle_host.training.target_head import full_vocab_argmax
from kimi_eagle_host.training import ttt_loss


def test_acc_counts_target_choices_outside_the_draft_vocab_as_misses():
    T = 6
    draft_to_target = torch.tensor([1, 3, 5, 7])            # draft id i -> target id
    target_ids = torch.tensor([[8, 8, 8, 3, 3, 3]])         # the target's real choice is 8 (no draft id) at t<3
    tops = [torch.full((1, T), 1)]                          # the draft always says draft id 1 = target 3
    doc = torch.zeros(1, T, dtype=torch.long)
    scored = ttt_loss.step_masks(torch.ones(1, T, dtype=torch.bool), doc, 1)
    fig = ttt_loss.summarize(ttt_loss.acceptance_counts(tops, draft_to_target, target_ids, scored), [0.0], 1)
    assert fig["acc"] == [0.5]                               # 3 of 6: a target choice of 8 is never accepted
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[draft_to_target] = True
    in_loss = ttt_loss.loss_masks(scored, t2d[target_ids])
    assert in_loss[0].tolist() == [[False, False, False, True, True, True]]   # ...and is not trained toward


def test_conditional_acceptance_needs_every_earlier_position():
    # 3 steps over 8 indices; hits[k][j]: is step k's guess from index j right?
    hits = [[1, 1, 0, 1, 1, 1, 1, 1],
            [1, 0, 1, 1, 0, 1, 1],
            [0, 1, 1, 1, 1, 1]]
    draft_to_target = torch.arange(4)
    target = torch.zeros(1, 8, dtype=torch.long)
    tops = [torch.tensor([h]).long() * 0 + (1 - torch.tensor([h]).long()) for h in hits]   # 0 = right, 1 = wrong
    scored = ttt_loss.step_masks(torch.ones(1, 8, dtype=torch.bool), torch.zeros(1, 8, dtype=torch.long), 3)
    fig = ttt_loss.summarize(ttt_loss.acceptance_counts(tops, draft_to_target, target, scored), [0, 0, 0], 3)
    # indices 0..5 are scored at every step; chains: j=0 (1,1,0) j=1 (1,0,.) j=2 (0,..) j=3 (1,1,1) j=4 (1,0,.)
    # j=5 (1,1,1) -> position 0: 5/6, position 1: 3/6, position 2: 2/6
    assert fig["cond_acc"] == [round(5 / 6, 4), 0.5, round(2 / 6, 4)]
    assert fig["accept_len"] == round(1 + 5 / 6 + 3 / 6 + 2 / 6, 4)
    assert fig["acc"] == [round(7 / 8, 4), round(5 / 7, 4), round(5 / 6, 4)]   # teacher-forced: higher


def test_positions_across_a_document_boundary_are_not_scored():
    doc = torch.tensor([[0, 0, 0, 1, 1, -1]])
    m = ttt_loss.step_masks(torch.ones(1, 6, dtype=torch.bool), doc, 2)
    assert m[0].tolist() == [[True, True, True, True, True, False]]
    assert m[1].tolist() == [[True, True, False, True, False]]   # index 2 -> 3 and 4 -> padding cross over


def test_full_vocab_argmax_matches_the_unchunked_head():
    torch.manual_seed(0)
    H, V = 8, 50
    norm = RMSNorm(H, 1e-6)
    head = torch.randn(V, H)
    last = torch.randn(2, 7, H)
    want = torch.nn.functional.linear(norm(last), head).argmax(-1)
    assert torch.equal(full_vocab_argmax(last, norm, head, chunk=3), want)


def test_served_like_rounds_start_where_the_last_round_ended():
    """The held-out figure serving would count on the same text: a round at index j accepts the chain from j, the
    next starts at j + chain + 1, and each scored span (answer) starts afresh. The same hits as above: averaged over
    every index 5/6, 3/6, 2/6; replayed as rounds the easy chains at 3 and 5 are partly jumped over."""
    hits = [[1, 1, 0, 1, 1, 1, 1, 1],
            [1, 0, 1, 1, 0, 1, 1],
            [0, 1, 1, 1, 1, 1]]
    draft_to_target = torch.arange(4)
    target = torch.zeros(1, 8, dtype=torch.long)
    tops = [torch.tensor([h]).long() * 0 + (1 - torch.tensor([h]).long()) for h in hits]
    scored = ttt_loss.step_masks(torch.ones(1, 8, dtype=torch.bool), torch.zeros(1, 8, dtype=torch.long), 3)
    counts = ttt_loss.round_counts(tops, draft_to_target, target, scored)
    # chains from j = 0..5: 2, 1, 0, 3, 1, 3: rounds at 0 (2 accepted) -> 3 (3 accepted) -> 7 (not scored at every
    # step: the span ends)
    assert counts.tolist() == [2, 2, 2, 1]
    fig = ttt_loss.summarize_rounds(counts, 3)
    assert fig == {"rounds": 2, "cond_acc": [1.0, 1.0, 0.5], "accept_len": 3.5}
    # served with fewer tokens a round (k < S) the chains are cut at k and the rounds come closer: k = 2, rounds at 0
    # (2) -> 3 (2 of 3) -> 6 (not scored at every step); k = 1, rounds at 0 (1) -> 2 (0) -> 3 (1) -> 5 (1)
    assert ttt_loss.round_counts(tops, draft_to_target, target, scored, (2,)).tolist() == [2, 2, 2, 0]
    assert ttt_loss.round_counts(tops, draft_to_target, target, scored, (1,)).tolist() == [4, 3, 0, 0]
    # every k from one call, in the order asked: what the held-out evaluation reads
    assert ttt_loss.round_counts(tops, draft_to_target, target, scored, (1, 2, 3)).tolist() == [
        4, 3, 0, 0, 2, 2, 2, 0, 2, 2, 2, 1]
    assert ttt_loss.summarize_rounds([4, 3, 0, 0], 1) == {"rounds": 4, "cond_acc": [0.75], "accept_len": 1.75}
    # two answers in one row (a user turn between them, not in the loss): the second starts its own rounds at its
    # first index, whatever the first's last round jumped to
    mask = torch.tensor([[1, 1, 1, 1, 0, 0, 1, 1, 1, 1]], dtype=torch.bool)
    scored = ttt_loss.step_masks(mask, torch.zeros(1, 10, dtype=torch.long), 1)
    wrong_at = {1, 6}                                          # one miss in each answer
    top = torch.tensor([[1 if j in wrong_at else 0 for j in range(10)]])
    counts = ttt_loss.round_counts([top], draft_to_target, torch.zeros(1, 10, dtype=torch.long), scored)
    # answer 1, indices 0..3: round 0 accepts 1 -> round 2 accepts 1 -> (4 is not scored); answer 2, 6..9: round 6
    # accepts 0 -> 7 accepts 1 -> 9 accepts 1
    assert counts.tolist() == [5, 4]   # 5 rounds, 4 tokens accepted
