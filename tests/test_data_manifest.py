"""A step reads exactly what its run produced: extract's manifests, not a listing of hidden_states/.

Found by a probe: `run all`, then `run all seq_len=32` in the same folder trained on 80 samples — the second run's
47 and 33 files left by the first. Here: the same through the product (local transport), and the steps
directly for the finer cases (shards writing one folder, a resume that continues, a changed setting or changed
prepared data that starts clean, train refusing hidden states or a vocabulary of other prepared data).
Real torch, tiny random models, CPU.
"""
from __future__ import annotations

import json
import os
import re
import subprocess

import pytest

from conftest import REPO, TINY_PIPELINE, host_cmd, make_env

SAMPLE = REPO / "kimi_eagle_host" / "sample_data" / "chat.jsonl"
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error"}


def hs_indices(hs_dir) -> list[int]:
    return sorted(int(m.group(1)) for n in os.listdir(hs_dir) if (m := re.match(r"^hs_(\d+)\.safetensors$", n)))


def test_a_second_run_with_fewer_samples_trains_on_its_own_samples_only(tmp_path):
    env = make_env(tmp_path, None, extra=TINY_PIPELINE)
    common = ("--host", "local", "--no-preflight", "--no-gpu", "draft_vocab_size=64", "steps.train.max_steps=1")
    first = env.cli("run", "all", *common, timeout=1200)
    assert first.code == 0, (first.stdout[-3000:], first.stderr[-3000:])
    out = tmp_path / "localwork" / "out"
    n_first = json.loads((out / "prepared" / "manifest.json").read_text())["count"]
    assert f"train: {n_first} samples" in first.stdout

    second = env.cli("run", "all", *common, "seq_len=32", timeout=1200)
    assert second.code == 0, (second.stdout[-3000:], second.stderr[-3000:])
    n_second = json.loads((out / "prepared" / "manifest.json").read_text())["count"]
    assert n_second < n_first   # shorter samples: the ones without an assistant token after 32 are dropped
    assert f"train: {n_second} samples" in second.stdout, re.findall(r"train: \d+ samples", second.stdout)
    # extract says it starts clean, and why (the prepared data and the truncation changed)
    assert re.search(r"\[extract\] starting clean in \S+: removed \d+ samples .*seq_len 64 -> 32", second.stdout)
    assert hs_indices(out / "hidden_states") == list(range(n_second))   # nothing of the first run is left


def step(name, *args, timeout=600):
    p = subprocess.run(host_cmd(f"pipeline.{name}", *args), capture_output=True, text=True, env=ENV, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def spawn(name, *args):
    return subprocess.Popen(host_cmd(f"pipeline.{name}", *args), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=ENV)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from kimi_eagle_host.pipeline import tiny_model

    return tiny_model.build(str(tmp_path_factory.mktemp("model") / "llama"), kind="llama", layers=8, seed=0)["out_dir"]


def extract_shards(model, root, world_size, *extra):
    """extract as world_size concurrent shard processes writing one folder; returns their stderr."""
    procs = [spawn("extract", "--model", model, "--output-dir", root, "--seq-len", 48, "--batch-size", 4,
                   "--rank", r, "--world-size", world_size, *extra) for r in range(world_size)]
    errs = []
    for p in procs:
        _, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        errs.append(err)
    return errs


def train(model, root):
    return step("train", "--model", model, "--output-dir", root, "--device", "cpu", "--max-steps", 1,
                "--batch-size", 2, "--report-to", "none")


def test_shards_resume_and_restarts_keep_one_consistent_manifest(model, tmp_path):
    root = tmp_path / "out"
    hs = root / "hidden_states"
    code, _, err = step("prepare", "--model", model, "--dataset", SAMPLE, "--output-dir", root, "--seq-len", 48,
                        "--max-samples", 12)
    assert code == 0, err
    errs = extract_shards(model, root, 3)
    # the first shard to take the folder starts it, the others continue its data; the last one completes it
    assert sum("starting a new extraction" in e for e in errs) == 1
    assert sum("continuing the extraction" in e for e in errs) == 2
    assert sum("all 12 samples extracted" in e for e in errs) == 1
    manifest = json.loads((hs / "manifest.json").read_text())
    assert manifest["samples"] == [f"hs_{i}.safetensors" for i in range(12)] and len(manifest["shards"]) == 3
    code, _, err = step("vocab", "--model", model, "--output-dir", root, "--draft-vocab-size", 64)
    assert code == 0, err

    # the same settings again, as one process: it continues (says so) and rewrites nothing
    code, out, err = step("extract", "--model", model, "--output-dir", root, "--seq-len", 48)
    assert code == 0 and "continuing the extraction" in err and json.loads(out)["written"] == 0, err

    # fewer prepared samples: train refuses the hidden states of the earlier data, in one line, exit 2
    code, _, err = step("prepare", "--model", model, "--dataset", SAMPLE, "--output-dir", root, "--seq-len", 48,
                        "--max-samples", 7)
    assert code == 0 and "starting clean" in err and "(12 samples)" in err, err
    code, out, err = train(model, root)
    assert code == 2 and "extracted from other prepared data" in json.loads(out)["error"], err
    assert not (root / "draft").exists()

    # extract knows the data changed: starts clean, and every earlier file is gone
    errs = extract_shards(model, root, 2)
    assert sum("starting clean" in e and "removed 12 samples" in e and "prepared_sha256" in e for e in errs) == 1
    assert hs_indices(hs) == list(range(7))
    assert sorted(n for n in os.listdir(hs) if n.startswith("manifest.")) == [
        "manifest.json", "manifest.shard-0-3.json", "manifest.shard-3-7.json"]

    # the vocabulary still counts the earlier data: refused until vocab runs again
    code, out, err = train(model, root)
    assert code == 2 and "vocab_info.json" in json.loads(out)["error"], err
    code, _, err = step("vocab", "--model", model, "--output-dir", root, "--draft-vocab-size", 64)
    assert code == 0 and "rebuilding" in err and "from other prepared data" in err, err
    code, out, err = train(model, root)
    assert code == 0 and json.loads(out)["samples"] == 7, err

    # another setting (the layers): starts clean, says what changed
    code, out, err = step("extract", "--model", model, "--output-dir", root, "--seq-len", 48, "--layer-ids", "1,4,5,8")
    assert code == 0 and re.search(r"starting clean .*removed 7 samples .*layer_ids \[2, 4, 5, 8\] -> \[1, 4, 5, 8\]",
                                   err), err
    assert json.loads(out)["written"] == 7 and hs_indices(hs) == list(range(7))


def test_an_unfinished_extraction_is_refused_not_read(model, tmp_path):
    """A shard that never finished leaves no manifest.json: train says so instead of training on a part."""
    root = tmp_path / "out"
    code, _, err = step("prepare", "--model", model, "--dataset", SAMPLE, "--output-dir", root, "--seq-len", 48,
                        "--max-samples", 6)
    assert code == 0, err
    code, _, err = step("extract", "--model", model, "--output-dir", root, "--seq-len", 48, "--rank", 0,
                        "--world-size", 2)
    assert code == 0 and "3 of 6 samples extracted so far" in err, err
    code, _, err = step("vocab", "--model", model, "--output-dir", root, "--draft-vocab-size", 64)
    assert code == 0, err
    code, out, err = train(model, root)
    assert code == 2 and "manifest.json: missing" in json.loads(out)["error"], err
