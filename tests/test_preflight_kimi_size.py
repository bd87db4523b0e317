"""Preflight at Kimi-K2.5's real size, from its config alone (no weights anywhere): the hidden states' storage plan,
GPU memory for the model at tensor parallelism 8 (INT4 routed experts as the Hub checkpoint stores them), and the
parameter count of an MLA + MoE model. The GPUs are an nvidia-smi stand-in listing eight H200s (no GPU here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ["-m", "kimi_eagle_host.ops.preflight"]  # after the host's Python
from kimi_eagle_host import model_size, storage_plan
from kimi_eagle_host.target import kimi_model

GIB = 1 << 30


def smi(tmp: Path, n: int, free_mib: int = 143000) -> Path:
    p = tmp / "nvidia-smi"
    p.write_text("#!/bin/sh\n" + "".join(f'echo "{i}, NVIDIA H200, 143771, {free_mib}"\n' for i in range(n)))
    p.chmod(0o755)
    return p


@pytest.fixture
def kimi(tmp_path):
    """Kimi-K2.5's config.json (61 layers, hidden 7168, 384 experts, INT4 experts) and an extract-ready output dir
    whose prepared manifest says 100 M tokens."""
    model = tmp_path / "Kimi-K2.5"
    kimi_model.write_real_config(model)
    out = tmp_path / "out"
    (out / "prepared").mkdir(parents=True)
    (out / "prepared" / "manifest.json").write_text(json.dumps({"count": 50000, "tokens": 100_000_000}))
    return {"model": model, "out": out, "tmp": tmp_path}


def preflight(kimi, *extra, gpus=8, backend="hf", tp=8, env=None):
    p = subprocess.run([sys.executable, *SCRIPT, "--step", "extract", "--backend", backend, "--model", str(kimi["model"]),
                        "--output-dir", str(kimi["out"]), "--runs-dir", str(kimi["tmp"]), "--tp-size", str(tp),
                        "--nvidia-smi", str(smi(kimi["tmp"], gpus)), *extra], capture_output=True, text=True, timeout=300,
                        env=env)
    assert p.returncode in (0, 1), p.stderr
    doc = json.loads(p.stdout)
    assert not list(kimi["model"].glob("*.safetensors"))        # nothing was loaded, nothing written
    return p.returncode, {c["name"]: c for c in doc["checks"]}


def test_the_real_config_counts_a_trillion_parameters_and_595_gb_as_stored():
    cfg = kimi_model.real_config()
    parts = model_size.parameters(cfg["text_config"])
    assert 1.02e12 < sum(parts.values()) < 1.04e12                # Kimi-K2: 1.04 T total
    assert parts["routed_experts"] / sum(parts.values()) > 0.98
    stored, how = model_size.weight_bytes(cfg["text_config"], "bfloat16", cfg["quantization_config"])
    assert 585e9 < stored < 605e9, how                             # the Hub checkpoint: ~595 GB of safetensors
    bf16, _ = model_size.weight_bytes({**cfg["text_config"], "quantization_config": None})
    assert 2.0e12 < bf16 < 2.1e12
    # MLA caches one 576-wide latent per layer and token, the same on every rank: 61 x 576 x 2 B
    assert model_size.kv_bytes_per_token(cfg["text_config"], tp=8) == 61 * 576 * 2


def test_600k_samples_of_kimi_hidden_states_need_344_tb_offline(kimi):
    """The storage plan at the scale of TorchSpec's Kimi-K2.5 draft: 600,000 samples of 10,000 tokens on average
    (6 B tokens), the default 4 captured layers of hidden 7168 in bf16."""
    samples, avg_len = 600_000, 10_000
    (kimi["out"] / "prepared" / "manifest.json").write_text(json.dumps({"count": samples, "tokens": samples * avg_len}))
    assert 4 * 7168 * 2 == 57_344
    # + an int64 token id and loss-mask entry per token, and each sample file's safetensors header
    offline = samples * avg_len * (57_344 + 16) + samples * 256
    rc, checks = preflight(kimi, "--assume-free-disk-bytes", str(400 * 10**12))
    storage = checks["storage"]
    assert storage["status"] == "pass" and "offline fits" in storage["detail"], storage
    assert storage["plan"]["hidden_state_bytes_per_token"] == 57_344 and storage["plan"]["offline_bytes"] == offline
    assert storage["detail"].startswith("offline needs 344.2 TB of hidden states (57,360 B/token x 6,000,000,000 "
                                        "tokens in 600,000 samples)"), storage["detail"]
    assert "[2, 30, 58, 61]" in checks["layer_ids"]["detail"]
    # A 2.1 TB disk: the run would fill it. One failing check, one line naming both figures. Online's buffer of
    # 0.2 GB (and no held-out documents) fits its folder, so the fix offers online.
    spool = kimi["tmp"] / "spool"
    spool.mkdir()
    small = ("--step-settings", json.dumps({"extract": {}, "train": {"online_spool_dir": str(spool),
                                                                    "online_buffer_gb": 0.2, "holdout_fraction": 0}}))
    rc, checks = preflight(kimi, "--assume-free-disk-bytes", str(2_100_000_000_000), *small)
    storage = checks["storage"]
    assert rc == 1 and storage["status"] == "fail" and "\n" not in storage["detail"], storage
    assert "offline needs 344.2 TB" in storage["detail"] and "2.1 TB free on" in storage["detail"]
    assert "offline does not fit" in storage["detail"] and "online stores none" in storage["detail"]
    assert "set hidden_states=online" in storage["fix"] and "steps.prepare.max_samples" in storage["fix"]
    assert [n for n, c in checks.items() if c["status"] == "fail"] == ["storage"]   # not the disk check too
    # The same disk online: no hidden-state files, so the check passes and says what the run costs instead.
    rc, checks = preflight(kimi, "--assume-free-disk-bytes", str(2_100_000_000_000), "--hidden-states", "online",
                           *small)
    storage = checks["storage"]
    assert rc == 0 and storage["status"] == "pass", storage
    assert storage["detail"].startswith("hidden_states: online, no hidden-state files; offline needs 344.2 TB")
    # the buffer: one engine batch (engine_batch_size 8) of samples of seq_len, more than 0.2 GB: one always goes
    plan = storage["plan"]
    assert plan["spool_dir"] == str(spool) and plan["engines"] == 1, plan                # tp 8 on 8 GPUs
    assert plan["online_buffer_bytes"] == plan["min_buffer_bytes"] == 8 * plan["one_sample_bytes"], plan


def test_the_hours_count_the_gpus_the_job_uses_not_every_gpu_listed(kimi):
    """A host of eight H200s shared with other jobs: the run's hours are for the GPUs its steps will use, as the
    launcher narrows them (CUDA_VISIBLE_DEVICES, the host's `gpus:`), and online's split layout extracts on
    engine_gpus and trains on train_gpus."""
    import os

    def plan(*extra, env=None):
        rc, checks = preflight(kimi, *extra, env={k: v for k, v in {**os.environ, **(env or {})}.items()
                                                  if v is not None})
        return checks["storage"]["plan"]

    clean = {"CUDA_VISIBLE_DEVICES": None}
    eight = plan(env=clean)
    two = plan(env={"CUDA_VISIBLE_DEVICES": "6,7"})
    assert eight["gpus"] == 8 and two["gpus"] == 2, two
    assert two["extract_hours"] == pytest.approx(eight["extract_hours"] * 4)
    assert eight["train_gpus"] == 8 and two["train_gpus"] == 2
    assert "(estimate from one-H200 figures, 2 GPUs)" in " ".join(two["lines"])
    assert plan("--gpus", "4", env=clean)["gpus"] == 4                           # the inventory's gpus: 4
    split = plan("--hidden-states", "online", "--step-settings",
                 json.dumps({"train": {"engine_gpus": [0, 1], "train_gpus": [2, 3, 4, 5, 6, 7]}}), env=clean)
    assert split["gpus"] == 2 and split["train_gpus"] == 6, split
    assert split["train_hours_per_epoch"] == pytest.approx(eight["train_hours_per_epoch"] * 8 / 6)
    assert "2 GPUs extracting, 6 training" in " ".join(split["lines"])


def test_the_int4_checkpoint_fits_eight_h200_at_tp8_and_not_four(kimi):
    rc, checks = preflight(kimi, backend="vllm", tp=8)
    gpu = checks["gpu"]
    assert gpu["status"] == "pass", gpu
    assert "/ tp 8" in gpu["detail"] and "4-bit" in gpu["detail"]
    per_gpu = float(gpu["detail"].split("= ")[1].split(" GiB per GPU")[0])
    assert 70 < per_gpu < 85, gpu["detail"]                       # 553 GiB / 8 + KV + activations + context
    rc, checks = preflight(kimi, backend="vllm", tp=4, gpus=4)
    assert checks["gpu"]["status"] == "fail" and "too little free" in checks["gpu"]["detail"], checks["gpu"]


def test_the_same_model_in_bf16_does_not_fit_tp8(kimi):
    cfg = json.loads((kimi["model"] / "config.json").read_text())
    cfg.pop("quantization_config")
    cfg["text_config"].pop("quantization_config")
    (kimi["model"] / "config.json").write_text(json.dumps(cfg))
    rc, checks = preflight(kimi, backend="vllm", tp=8)
    gpu = checks["gpu"]
    assert gpu["status"] == "fail" and "x 2 B" in gpu["detail"] and "quantized checkpoint" in gpu["fix"], gpu


def test_online_refuses_a_buffer_folder_that_cannot_hold_what_the_run_keeps_there(kimi):
    """Online keeps its buffer (online_buffer_gb, at least one sample) and the held-out documents in
    online_spool_dir: a folder without room for them is one failed check naming it and what to change, before the
    model loads (not ENOSPC in the engine after it)."""
    spool = kimi["tmp"] / "spool"
    spool.mkdir()

    def online(*extra, **train):
        rc, checks = preflight(kimi, "--hidden-states", "online", *extra, "--step-settings",
                               json.dumps({"train": {"online_spool_dir": str(spool), **train}}))
        storage = checks["storage"]
        assert rc == 1 and storage["status"] == "fail" and "\n" not in storage["detail"], storage
        return storage

    # a buffer of 10 PB: one engine batch (8 x 117.5 MB at seq_len 2048) fits there, the buffer does not
    storage = online(online_buffer_gb=1e7, holdout_fraction=0)
    assert storage["detail"].startswith(f"hidden_states: online, but online keeps up to ~5.7 TB in {spool} ("), storage
    assert "does not fit" in storage["detail"] and "one batch of engine_batch_size 8 samples of seq_len 2048 (117.5 MB each): 939.8 MB" in storage["detail"]
    assert storage["fix"].startswith("set online_buffer_gb=") and "(what fits there)" in storage["fix"], storage
    # not even one engine batch: seq_len 10^9
    storage = online("--seq-len", str(10**9))
    assert storage["fix"].startswith(f"{spool} cannot hold even one batch of engine_batch_size 8 samples of seq_len "
                                  f"1000000000"), storage
    assert "lower steps.train.engine_batch_size or seq_len" in storage["fix"], storage
    # the held-out documents alone: 600k samples of 10k tokens, 2 % held out without a cap, are 6.9 TB kept for
    # the whole run
    (kimi["out"] / "prepared" / "manifest.json").write_text(json.dumps({"count": 600_000, "tokens": 6 * 10**9}))
    storage = online(online_buffer_gb=0.2, holdout_max_samples=12_000)
    assert "12,000 held-out documents, ~6.9 TB (holdout_fraction 0.02, at most holdout_max_samples 12000)" \
        in storage["detail"], storage
    assert "hold out fewer documents (steps.train.holdout_max_samples, steps.train.holdout_fraction)" \
        in storage["fix"], storage


def test_online_keeps_a_bounded_held_out_set_at_kimi_size(kimi):
    """600k samples of 10k tokens: 2 % held out would be 12,000 documents, 6.9 TB kept in /dev/shm for the whole
    run. The default cap (steps.train.holdout_max_samples, 500) keeps ~287 GB, which a host's memory holds."""
    (kimi["out"] / "prepared" / "manifest.json").write_text(json.dumps({"count": 600_000, "tokens": 6 * 10**9}))
    spool = kimi["tmp"] / "spool"
    spool.mkdir()
    rc, checks = preflight(kimi, "--hidden-states", "online", "--step-settings",
                           json.dumps({"train": {"online_spool_dir": str(spool), "online_buffer_gb": 2}}))
    plan = checks["storage"]["plan"]
    assert plan["heldout_documents"] == 500 and plan["holdout_max_samples"] == 500, plan
    assert plan["heldout_bytes"] == 500 * 10_000 * 57_360 + 500 * 256           # the data's mean tokens a sample
    line = next(x for x in plan["lines"] if x.startswith("online keeps"))
    assert "500 held-out documents, ~286.8 GB (holdout_fraction 0.02, at most holdout_max_samples 500)" in line, line
    # a folder of 100 GB (an assumed size: this host's own) cannot hold them: the fix names the cap
    tight = storage_plan.plan(kimi_model.real_config()["text_config"], [2, 30, 58, 61],
                              {"tokens": 6 * 10**9, "samples": 600_000, "source": "m", "estimate": False},
                              disk_path="/d", disk_free=0, keep_free=0, seq_len=16384, spool_dir="/dev/shm",
                              spool_free=100 * 10**9, online_buffer_gb=2, holdout_fraction=0.02,
                              holdout_max_samples=500)
    assert tight["spool_fits"] is False and "steps.train.holdout_max_samples" in storage_plan.spool_fix(tight)
    # a folder that is not there
    rc, checks = preflight(kimi, "--hidden-states", "online", "--step-settings",
                           json.dumps({"train": {"online_spool_dir": str(spool / "nowhere")}}))
    assert checks["storage"]["status"] == "fail" and "nowhere: not a folder" in checks["storage"]["detail"]
