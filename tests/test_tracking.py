"""Tracking: a real tiny training run writes tensorboard event files that tensorboard's own reader reads back
(loss and the acceptance signal per logged step, under the job's name); a tracker asked for by name and missing
is one line, exit 2, before any work."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import REPO
from test_train import make_pipeline

TRAIN = REPO / "remote_payloads" / "pipeline" / "train.py"


def _train(p, *extra, env=None):
    argv = [sys.executable, str(TRAIN), "--model", str(p["target"]), "--output-dir", str(p["out"]), "--device", "cpu",
            "--batch-size", "4", "--epochs", "2", "--lr", "3e-3", "--log-every", "2", *extra]
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_train_writes_tensorboard_events_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = make_pipeline(tmp_path)
    res = _train(p, "--report-to", "tensorboard", env={"KIMI_EAGLE_JOB_ID": "20260101-000000-train-abcd"})
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    run_dir = p["out"] / "tracking" / "20260101-000000-train-abcd"
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/acc_0", "train/acc_2"} <= set(tags), tags
    loss = acc.Scalars("train/loss")
    # One point per logged step, equal to the figures of the step's own result.
    assert [e.step for e in loss] == [h["step"] for h in result["history"]]
    assert [round(e.value, 4) for e in loss] == [round(h["loss"], 4) for h in result["history"]]
    assert [round(e.value, 4) for e in acc.Scalars("train/acc_0")] == [round(h["acc"][0], 4) for h in result["history"]]


def test_auto_is_tensorboard_when_installed_and_none_writes_nothing(tmp_path):
    p = make_pipeline(tmp_path)
    res = _train(p, "--report-to", "none", "--epochs", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (p["out"] / "tracking").exists()
    res = _train(p, "--epochs", "1")  # auto
    assert res.returncode == 0, res.stderr[-3000:]
    assert (p["out"] / "tracking").exists() == (importlib.util.find_spec("tensorboard") is not None)


@pytest.mark.parametrize("name", ["wandb", "mlflow", "trackio"])
def test_a_tracker_that_is_not_installed_is_bad_input_before_any_work(tmp_path, name):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    p = make_pipeline(tmp_path)
    res = _train(p, "--report-to", name)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (f"train: --report-to {name}: the host's Python has no {name} "
                                                   f"(pip install {name}), or use report_to: none")
    assert not (p["out"] / "draft").exists()
