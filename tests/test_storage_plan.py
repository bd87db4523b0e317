"""The storage plan (kimi_eagle_host/storage_plan.py) as preflight's `storage` check: a tiny target whose hidden
states fit, an estimate from the dataset before prepare has run, and Kimi-K2.5's real config through
`kimi-eagle preflight` on the local host, where offline needs hundreds of TB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_the_tiny_targets_prepared_hidden_states_fit_offline(tmp_path):
    w = tiny_world(tmp_path, manifest={"count": 100, "tokens": 20_000})
    rc, checks = host_preflight(w, "extract", "--layer-ids", "1,2,3,4")
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
    tight = ("--layer-ids", "1,2,3,4", "--min-free-disk-gib", "0", "--assume-free-disk-bytes", str(10**6))
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
    rc, checks = host_preflight(w, "all", "--dataset", str(w["data"]), "--layer-ids", "1,2,3,4")
    storage = checks["storage"]
    assert storage["status"] == "pass" and storage["plan"]["estimate"] is True, storage
    assert storage["plan"]["samples"] == 300 and storage["plan"]["tokens"] == 300 * 200
    assert storage["detail"].startswith("offline needs ~31.8 MB of hidden states (528 B/token x ~60,000 tokens")
    assert "prepare has not run" in storage["plan"]["data_from"]
    # A disk smaller than that: the same estimate fails the check, naming what to free.
    rc, checks = host_preflight(w, "all", "--dataset", str(w["data"]), "--layer-ids", "1,2,3,4",
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
    e = make_env(tmp_path, None, extra=f"pipeline:\n  model: {model}\n  output_dir: {out}\n  backend: hf\n")
    r = e.cli("preflight", "extract", "--host", "local", "--", "--assume-free-disk-bytes", str(2_100_000_000_000))
    assert r.code == 1, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    verdict = [ln for ln in lines if "storage:" in ln]
    assert len(verdict) == 1 and verdict[0].startswith("[local] FAIL  storage: offline needs 344.2 TB"), lines
    assert "2.1 TB free on" in verdict[0] and "offline does not fit" in verdict[0]
    block = "\n".join(lines[lines.index(verdict[0]) + 1:])
    assert "per token: 4 layers [2, 30, 58, 61] x hidden 7168 x 2 B (bfloat16) = 57,344 B" in block
    assert "6,000,000,000 tokens in 600,000 samples" in block and "extraction ~" in block
    assert "fix: offline does not fit: set hidden_states=online" in block
    assert lines[-1] == "[local] preflight FAILED"
    # --json carries the same plan as numbers
    doc = json.loads(e.cli("--json", "preflight", "extract", "--host", "local", "--",
                           "--assume-free-disk-bytes", str(2_100_000_000_000)).stdout)
    plan = {c["name"]: c for c in doc[0]["checks"]}["storage"]["plan"]
    assert plan["offline_fits"] is False and plan["bytes_per_token"] == 57_360
    assert plan["disk_free"] == 2_100_000_000_000
