"""The learning-rate schedule: its shape at known steps (optim.lr_at), and what a real train run used at every step
(its history, logged each step, and the optimizer state it saved), also across a stop and a resume."""
from __future__ import annotations

import argparse
import math

import pytest
import torch

from kimi_eagle_host.training.optim import lr_at
from test_train import make_pipeline, run_train

LR = 1e-3


def schedule(kind, warmup):
    return argparse.Namespace(lr=LR, lr_schedule=kind, warmup_steps=warmup)


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
def test_warmup_rises_linearly_to_the_peak(kind):
    a = schedule(kind, 4)
    assert [lr_at(s, 20, a) for s in range(4)] == pytest.approx([LR / 4, LR / 2, 3 * LR / 4, LR])
    assert lr_at(4, 20, a) == pytest.approx(LR)      # the first step after the warm-up is at the peak


def test_decay_shapes_at_known_steps():
    # 4 warm-up steps of 24: the decay spans steps 4..23, t = (step - 4) / 20
    cos, lin, const = schedule("cosine", 4), schedule("linear", 4), schedule("constant", 4)
    assert lr_at(14, 24, cos) == pytest.approx(LR * (0.1 + 0.9 * 0.5)) == pytest.approx(0.55 * LR)   # halfway
    assert lr_at(14, 24, lin) == pytest.approx(LR / 2)
    assert lr_at(9, 24, cos) == pytest.approx(LR * (0.1 + 0.45 * (1 + math.cos(math.pi / 4))))
    assert lr_at(23, 24, lin) == pytest.approx(LR / 20)    # the last step: one step short of zero
    assert lr_at(24, 24, cos) == pytest.approx(0.1 * LR)   # cosine ends at 10 % of the peak, linear at 0
    assert lr_at(24, 24, lin) == 0.0
    assert {lr_at(s, 24, const) for s in range(4, 24)} == {LR}
    for a in (cos, lin):                               # after the warm-up it only falls
        after = [lr_at(s, 24, a) for s in range(4, 24)]
        assert all(x > y for x, y in zip(after, after[1:])), after
    # no warm-up: the first step trains at the peak
    assert lr_at(0, 10, schedule("cosine", 0)) == pytest.approx(LR)


def test_a_run_trains_each_step_at_the_scheduled_rate_also_after_a_resume(tmp_path):
    """--log-every 1: the history holds the rate of every step. Stopped after step 5 and resumed, the schedule
    continues where it was (a schedule restarted at the resume would warm up again), and the optimizer state the
    run saved last holds the last step's rate."""
    p = make_pipeline(tmp_path)
    flags = ["--epochs", "4", "--lr", str(LR), "--lr-schedule", "linear", "--warmup-steps", "3", "--log-every", "1",
             "--save-every", "100"]
    rc, first = run_train(p, *flags, "--stop-at-step", "5")
    assert rc == 0 and first["step"] == 5, first
    rc, rest = run_train(p, *flags, "--resume")
    assert rc == 0 and rest["finished"] and rest["resumed_from_step"] == 5, rest
    total = rest["total_steps"]
    assert total == 16                                   # 16 samples, 4 rows per step, 4 epochs
    history = first["history"] + rest["history"]
    assert [h["step"] for h in history] == list(range(1, total + 1))
    a = schedule("linear", 3)
    assert [h["lr"] for h in history] == pytest.approx([lr_at(s, total, a) for s in range(total)], rel=1e-9)
    assert history[2]["lr"] == pytest.approx(LR) and history[-1]["lr"] == pytest.approx(LR / 13)
    saved = torch.load(rest["checkpoint"], map_location="cpu", weights_only=False)["optimizer"]
    lrs = [g["lr"] for g in (saved["param_groups"] if "param_groups" in saved
                             else [g for o in saved.values() for g in o["param_groups"]])]
    assert lrs and lrs == pytest.approx([LR / 13] * len(lrs)), lrs
