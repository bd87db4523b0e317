"""hidden_states: online: train runs the engine itself and takes its hidden states through a bounded buffer in memory.

What a user would notice, on a real tiny target (transformers on CPU) through the real steps: the online run trains
exactly what the offline run (extract, then train from the files) trains — the same losses, held-out figures and
exported weights, bit for bit, with the same engine and batch —; a run stopped mid-stream (max steps, or SIGTERM to
its process group as `kimi-eagle stop` sends) and resumed ends where a straight run ends; the engine dying is one
error, not a hang; nothing of the buffer is left behind.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import REPO, host_cmd
from kimi_eagle_host.pipeline import tiny_model

SAMPLE = os.path.join(REPO, "kimi_eagle_host", "sample_data", "chat.jsonl")
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(REPO)}
LAYERS = "1,2,4"
SEQ_LEN = 64
# Two epochs of 24 documents (a quarter held out), two rows per step: 18 steps, a held-out evaluation at the end.
COMMON = ("--epochs", "2", "--batch-size", "2", "--log-every", "1", "--lr-schedule", "constant",
          "--holdout-fraction", "0.25", "--report-to", "none", "--save-every", "4")
ONLINE = ("--hidden-states", "online", "--layer-ids", LAYERS, "--seq-len", str(SEQ_LEN), "--engine-batch-size", "1")


def run(step, *args, env=None, timeout=600):
    p = subprocess.run(host_cmd(f"pipeline.{step}", *args), capture_output=True, text=True, env=env or ENV,
                       timeout=timeout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = None
    return p.returncode, doc, p.stderr


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Llama target, its prepared data and vocabulary; `offline/` also extracted (one document per forward,
    as the online engine runs here) and trained."""
    root = tmp_path_factory.mktemp("online")
    model = tiny_model.build(str(root / "model"), kind="llama", layers=4, seed=0)["out_dir"]
    off = root / "offline"
    code, _, err = run("prepare", "--model", model, "--dataset", SAMPLE, "--output-dir", off, "--seq-len", SEQ_LEN,
                       "--max-samples", 24)
    assert code == 0, err
    code, _, err = run("vocab", "--model", model, "--output-dir", off, "--draft-vocab-size", 100)
    assert code == 0, err
    code, _, err = run("extract", "--model", model, "--output-dir", off, "--seq-len", SEQ_LEN, "--batch-size", 1,
                       "--layer-ids", LAYERS)
    assert code == 0, err
    code, trained, err = run("train", "--model", model, "--output-dir", off, *COMMON)
    assert code == 0, err
    return {"root": root, "model": model, "offline": off, "trained": trained}


def online_dir(made, name: str) -> Path:
    """A pipeline root with the prepared data and vocabulary only: no hidden states."""
    out = made["root"] / name
    for part in ("prepared", "vocab"):
        shutil.copytree(made["offline"] / part, out / part)
    return out


def spool_base(made, name: str) -> Path:
    base = made["root"] / f"shm-{name}"
    base.mkdir()
    return base


def export_weights(out: Path) -> dict:
    return load_file(str(out / "draft" / "export" / "model.safetensors"))


def assert_same_training(a: dict, b: dict, out_a: Path, out_b: Path) -> None:
    assert [(h["step"], h["loss"], h["acc"], h["cond_acc"]) for h in a["history"]] == \
        [(h["step"], h["loss"], h["acc"], h["cond_acc"]) for h in b["history"]]
    assert a["heldout"] == b["heldout"]
    wa, wb = export_weights(out_a), export_weights(out_b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].equal(wb[k]), k


def leftovers(base: Path) -> list[str]:
    return sorted(os.listdir(base))


def test_online_trains_exactly_what_offline_trains(made):
    out, base = online_dir(made, "online"), spool_base(made, "equal")
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                         "--online-spool-dir", base)
    assert code == 0, err
    assert doc["hidden_states"] == "online" and doc["finished"] and doc["target_tops"] == "every step"
    assert_same_training(made["trained"], doc, made["offline"], out)
    assert not (out / "hidden_states").exists() and leftovers(base) == []   # never a file of the run, no spool left
    assert doc["online"]["engine_tok_s"] > 0
    made["online"] = (doc, out)


def test_online_stopped_by_sigterm_resumes_exactly(made):
    """SIGTERM to the whole process group (kimi-eagle stop): the engine outlives it, the trainer finishes its step
    with the documents it needs, checkpoints and exits 1; the spool is gone; --resume ends as a straight run.
    Both runs keep the documents that come again for the second epoch (online_cache_gb): the same training."""
    out, base = online_dir(made, "stopped"), spool_base(made, "stopped")
    env = {**ENV, "KIMI_EAGLE_TEST_STEP_DELAY_S": "0.4"}
    cache = ("--online-cache-gb", "1")
    args = host_cmd("pipeline.train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                    "--online-spool-dir", base, *cache)
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    deadline = time.time() + 300
    ckpts = out / "draft" / "checkpoints"
    while time.time() < deadline and p.poll() is None and not list(ckpts.glob("step_*.pt")):
        time.sleep(0.1)   # a checkpoint at step 4: well into the stream
    os.killpg(p.pid, signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    doc = json.loads(stdout)
    assert p.returncode == 1 and "stopped by SIGTERM" in doc["error"], stderr
    assert 4 <= doc["step"] < doc["total_steps"]
    assert leftovers(base) == []
    code, rest, err = run("train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                          "--online-spool-dir", base, "--resume", *cache)
    assert code == 0 and rest["resumed_from_step"] == doc["step"], err
    assert rest["online"]["cached_documents"] > 0
    trained = made["trained"]["history"]
    assert [h["loss"] for h in rest["history"]] == [h["loss"] for h in trained if h["step"] > doc["step"]]
    assert rest["heldout"] == made["trained"]["heldout"]
    want = export_weights(made["offline"])
    got = export_weights(out)
    assert all(want[k].equal(got[k]) for k in want)


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


def test_engine_killed_is_one_error_not_a_hang(made):
    """The engine dies (SIGKILL) while the trainer needs its documents: the trainer ends at once with one line
    naming the engine, and removes the spool."""
    out, base = online_dir(made, "killed"), spool_base(made, "killed")
    env = {**ENV, "KIMI_EAGLE_TEST_STEP_DELAY_S": "0.3"}
    # A buffer of one document: the engine can never run ahead of the trainer by more than that.
    args = host_cmd("pipeline.train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                    "--online-spool-dir", base, "--online-buffer-gb", "0.000001")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and not list(base.glob("*/s_2_*")):
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    engine = _children(p.pid)
    assert len(engine) == 1
    os.kill(engine[0], signal.SIGKILL)
    t0 = time.time()
    stdout, stderr = p.communicate(timeout=120)
    assert time.time() - t0 < 60
    doc = json.loads(stdout)
    assert p.returncode == 1
    assert doc["error"].startswith("online: the engine (pid") and "exited with code -9" in doc["error"], doc
    assert "Traceback" not in doc["error"]
    assert leftovers(base) == []


def test_online_refusals(made, tmp_path):
    """Settings online cannot honour are one line, exit 2, before any engine starts."""
    out = online_dir(made, "refused")
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *ONLINE, "--online-spool-dir",
                         tmp_path / "nowhere", "--report-to", "none")
    assert code == 2 and "--online-spool-dir" in doc["error"] and "not a folder" in doc["error"]
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *ONLINE, "--layer-ids", "1,9",
                         "--report-to", "none")
    assert code == 2 and "9" in doc["error"]
