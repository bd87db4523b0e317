"""vLLM 0.32 (real CPU build) on a host whose memory is partly used: the engine's share is sized from what the
extraction needs and what is free, and preflight says what it will take.

vLLM's own default asks for 0.92 of the host's memory and refuses to start when less is available ("Available memory
on node 0 ... is less than desired CPU memory utilization"): on any machine where other processes hold more than
8 % of the memory (this one, shared by the test suite), the extraction failed at engine start. Here the host's env
sets no VLLM_CPU_KVCACHE_SPACE, as a user's would not.
"""

from __future__ import annotations

import json

import pytest

from test_vllm_backends import HOST_ENV, build_model, host_env, run_step
from vllm_envs import env_python

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]


def test_extraction_sizes_its_engine_from_free_memory(tmp_path, sshd, monkeypatch):
    py = env_python("0.32.0")
    model = build_model(py, tmp_path / "llama", "llama")
    monkeypatch.delitem(HOST_ENV, "VLLM_CPU_KVCACHE_SPACE")
    e = host_env(tmp_path, sshd, py, model, tmp_path / "out")
    assert "VLLM_CPU_KVCACHE_SPACE" not in e.inventory.read_text()
    run_step(e, "prepare", "--max-samples", "4")
    pre = e.cli("--json", "preflight", "extract", "--host", "gpu")
    (doc,) = pre.json()
    checks = {c["name"]: c for c in doc["checks"]}
    assert checks["engine-memory"]["status"] == "pass", checks.get("engine-memory")
    assert "KV cache 1 GiB of host memory" in checks["engine-memory"]["detail"]
    r = run_step(e, "extract")
    assert "vLLM engine memory: KV cache 1 GiB of host memory" in r.stdout, r.stdout[-3000:]
    cfg = json.loads((tmp_path / "out" / "hidden_states" / "data_config.json").read_text())
    assert cfg["backend"] == "vllm-native" and cfg["count"] == 4
    assert len(list((tmp_path / "out" / "hidden_states").glob("hs_*.safetensors"))) == 4
