"""kimi-eagle preflight over the real sshd: each failure kind reported with its fix; healthy passes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, make_env

FAKE_SMI = "#!/usr/bin/env bash\necho '0, NVIDIA H200, 143771, 143000'\n"


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    """speculators 0.3.0 (real wheel) plus vllm 0.16.0 metadata, as a host's site-packages."""
    from fixtures_speculators import _wheel

    d = tmp_path_factory.mktemp("site")
    wheel = _wheel("0.3.0", tmp_path_factory.mktemp("wheels"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(d), str(wheel)], check=True)
    info = d / "vllm-0.16.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.16.0\n")
    return d


def world(tmp_path, sshd, site, *, layer_ids="[2, 3]", model=None, dataset_rows=None):
    from transformers import LlamaConfig

    model_dir = tmp_path / "model"
    LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=256).save_pretrained(model_dir)
    data = tmp_path / "chat.jsonl"
    rows = dataset_rows or [json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})]
    data.write_text("\n".join(rows) + "\n")
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "nvidia-smi").write_text(FAKE_SMI)
    (bindir / "nvidia-smi").chmod(0o755)
    pipeline = f"""pipeline:
  model: {model or model_dir}
  dataset: {data}
  output_dir: {tmp_path / 'out'}
  backend: vllm
  layer_ids: {layer_ids}
  seq_len: 128
"""
    e = make_env(tmp_path, sshd, host_env={"PYTHONPATH": f"{site}:{REPO}", "PATH": f"{bindir}:/usr/bin:/bin"}, extra=pipeline)
    return e


def checks_of(r):
    doc = r.json()[0]
    return {c["name"]: c for c in doc["checks"]}


def test_each_failure_is_reported_with_its_fix_and_a_healthy_setup_passes(tmp_path, sshd, site):
    e = world(tmp_path, sshd, site)
    # Unpatched speculators 0.3.0 on vLLM 0.16.
    r = e.cli("--json", "preflight", "extract", "--host", "gpu")
    assert r.code == 1
    c = checks_of(r)
    assert c["patch"]["status"] == "fail" and "kimi-eagle deploy-patch --host gpu" in c["patch"]["fix"]
    # `run` refuses before starting anything.
    run = e.cli("run", "extract", "--host", "gpu", "--detach")
    assert run.code == 1 and "preflight failed" in run.stderr and "deploy-patch --host gpu" in run.stdout
    assert not list((e.workdir / "runs").glob("*/job.sh"))   # no job folder (a missing runs/ has none either)
    # After the fix, the patch check passes; the healthy setup passes as a whole (extract needs prepared data:
    # check the prepare step, which reads the dataset, and the patch state).
    assert e.cli("deploy-patch", "--host", "gpu").code == 0
    ok = e.cli("--json", "preflight", "prepare", "--host", "gpu")
    c = checks_of(ok)
    assert ok.code == 0, c
    assert all(v["status"] != "fail" for v in c.values())
    human = e.cli("preflight", "prepare", "--host", "gpu")
    assert human.code == 0 and "preflight passed" in human.stdout

    # Too little disk, through a flag given after --.
    r = e.cli("--json", "preflight", "prepare", "--host", "gpu", "--", "--assume-free-disk-bytes", "1000")
    assert r.code == 1 and checks_of(r)["disk"]["status"] == "fail" and checks_of(r)["disk"]["fix"]


def test_layer_id_out_of_range(tmp_path, sshd, site):
    e = world(tmp_path, sshd, site, layer_ids="[2, 9]")
    r = e.cli("--json", "preflight", "extract", "--host", "gpu")
    c = checks_of(r)
    assert r.code == 1 and c["layer_ids"]["status"] == "fail"
    assert "9" in c["layer_ids"]["detail"] and c["layer_ids"]["fix"]


def test_missing_model_path(tmp_path, sshd, site):
    e = world(tmp_path, sshd, site, model=tmp_path / "nope")
    r = e.cli("--json", "preflight", "prepare", "--host", "gpu")
    c = checks_of(r)
    assert r.code == 1 and c["model"]["status"] == "fail" and "nope" in c["model"]["detail"] and c["model"]["fix"]


def test_bad_dataset(tmp_path, sshd, site):
    e = world(tmp_path, sshd, site, dataset_rows=['{"messages": [{"role": "user", "content": "hi"}]}', "{not json"])
    r = e.cli("--json", "preflight", "prepare", "--host", "gpu")
    c = checks_of(r)
    assert r.code == 1 and c["dataset"]["status"] == "fail" and ":2" in c["dataset"]["detail"] and c["dataset"]["fix"]


@pytest.mark.parametrize("host", ["local", "gpu"])
def test_a_host_python_that_does_not_exist_is_named_with_the_fix(tmp_path, sshd, host):
    e = make_env(tmp_path, sshd, extra="pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n")
    e.inventory.write_text(e.inventory.read_text().replace(f"python: {sys.executable}", "python: /opt/nowhere/python3"))
    for argv in (["preflight", "prepare", "--host", host], ["run", "exec", "--host", host, "--", "true"]):
        r = e.cli(*argv)
        said = [ln for ln in (r.stdout + r.stderr).splitlines() if ln.strip()]
        assert r.code == 2 and len(said) == 1, (argv, r.code, said)
        assert "/opt/nowhere/python3 not found" in said[0] and "set `python:` in the inventory" in said[0], said
        assert "exited 127" not in said[0]
