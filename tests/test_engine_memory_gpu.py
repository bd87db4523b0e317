"""The vLLM engine's GPU memory share (vllm_compat.engine_memory) on a GPU that another process partly holds.

vLLM's default asks for 0.9 of the GPU and dies at start-up when less is free. The share is sized from what is free
at start instead; a value the user set wins; a GPU with too little free is one clear error. The first tests pass the
GPU's answer (torch.cuda.mem_get_info) in; the `test_gpu_*` ones run the steps on a real CUDA GPU beside a foreign
holder (skipped without one; bench/gpu/side_by_side.py's `engine_mem` stage runs them on the GPU machine).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import pytest

from kimi_eagle_host.vllm_compat import engine_memory

GIB = 1 << 30
H200 = 141 * GIB


def test_idle_gpu_keeps_the_default_share():
    m = engine_memory(2 * GIB, gpu_free_total=(H200 - GIB // 2, H200), environ={})
    assert m["kwargs"] == {"gpu_memory_utilization": 0.9} and m["env"] == {}


def test_busy_gpu_gets_what_is_free_not_the_default():
    free = int(H200 * 0.6)  # another process holds 40 %
    m = engine_memory(2 * GIB, gpu_free_total=(free, H200), environ={})
    share = m["kwargs"]["gpu_memory_utilization"]
    assert share * H200 <= free and share == pytest.approx(0.58, abs=1e-3)
    assert "of the GPU" in m["says"] and "free at start" in m["says"]


def test_the_users_share_wins():
    m = engine_memory(2 * GIB, gpu_free_total=(H200 // 2, H200), environ={"KIMI_EAGLE_GPU_MEMORY_UTILIZATION": "0.3"})
    assert m["kwargs"] == {"gpu_memory_utilization": 0.3}


def test_too_little_free_is_one_line():
    with pytest.raises(ValueError) as e:
        engine_memory(8 * GIB, gpu_free_total=(5 * GIB, H200), environ={})
    assert "\n" not in str(e.value) and "GiB free" in str(e.value)


@pytest.mark.parametrize("value", ["half", "0", "1.5"])
def test_a_share_the_user_set_that_is_no_fraction_is_one_line(value):
    with pytest.raises(ValueError) as e:
        engine_memory(2 * GIB, gpu_free_total=(H200, H200), environ={"KIMI_EAGLE_GPU_MEMORY_UTILIZATION": value})
    assert "\n" not in str(e.value) and f"KIMI_EAGLE_GPU_MEMORY_UTILIZATION={value!r}" in str(e.value)


def test_an_engine_beside_its_trainer_takes_what_it_needs_and_leaves_the_rest():
    # The online run's engine on the trainer's GPU (co-located): vLLM's 90 % left the Kimi-shaped target's trainer
    # 14.6 GiB of the H200 and it ran out of memory. Sized for itself: weights + KV + vLLM's start-up overhead.
    from kimi_eagle_host.vllm_compat import ENGINE_OVERHEAD_BYTES

    weights, kv = 8 * GIB, 3 * GIB
    m = engine_memory(kv, gpu_free_total=(H200 - GIB, H200), beside_trainer_weights=weights, environ={})
    taken = m["kwargs"]["gpu_memory_utilization"] * H200
    assert taken == pytest.approx(weights + kv + ENGINE_OVERHEAD_BYTES, abs=H200 / 1000)   # a share of 3 decimals
    assert H200 - taken > 100 * GIB and "the rest is the trainer's" in m["says"]
    alone = engine_memory(kv, gpu_free_total=(H200 - GIB, H200), environ={})   # its own GPUs (split, extract)
    assert alone["kwargs"]["gpu_memory_utilization"] == 0.9
    users = engine_memory(kv, gpu_free_total=(H200, H200), beside_trainer_weights=weights,
                          environ={"KIMI_EAGLE_GPU_MEMORY_UTILIZATION": "0.5"})
    assert users["kwargs"] == {"gpu_memory_utilization": 0.5}


def test_a_co_located_engine_is_sized_from_the_targets_weights_and_hidden_states(tmp_path):
    # step_engine_memory reads the weights from the safetensors index (per tensor-parallel rank) and counts the
    # hidden states extraction keeps in KV-cache blocks (one hidden_size vector per captured layer and token).
    from kimi_eagle_host.engine.extract_vllm import hidden_state_bytes_per_token
    from kimi_eagle_host.vllm_compat import ENGINE_OVERHEAD_BYTES, step_engine_memory

    text = {"hidden_size": 7168, "num_hidden_layers": 4, "num_attention_heads": 64, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": text}))
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 16 * GIB}}))
    extra = hidden_state_bytes_per_token(str(tmp_path), [1, 2, 3, 4], "bfloat16")
    assert extra == 4 * 7168 * 2
    m = step_engine_memory(str(tmp_path), 2, 1025, 128, gpu_free_total=(H200, H200), beside_trainer=True,
                           extra_bytes_per_token=extra, environ={})
    kv = (4 * 576 * 2 + extra) * 1025 * 128
    taken = m["kwargs"]["gpu_memory_utilization"] * H200
    assert taken == pytest.approx(8 * GIB + kv + ENGINE_OVERHEAD_BYTES, abs=H200 / 1000)


# ------------------------------------------------------------------ on a real GPU that another process partly holds
# The steps themselves (extract, eval, regenerate through vLLM) beside a foreign process holding most of the GPU's
# memory (bench/gpu/gpu_holder.py: a crashed worker, another user's job).

REPO = Path(__file__).resolve().parents[1]
HOLDER = REPO / "bench" / "gpu" / "gpu_holder.py"
SHARE_ENV = "KIMI_EAGLE_GPU_MEMORY_UTILIZATION"
ENGINE_STARTS = "Initializing a V1 LLM engine"   # vLLM's first line of an engine start


def gpu_memory_mib() -> tuple[int, int] | None:
    """(free, total) MiB of GPU 0 as nvidia-smi sees them; None without a CUDA GPU."""
    if not shutil.which("nvidia-smi"):
        return None
    p = subprocess.run(["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                       capture_output=True, text=True)
    if p.returncode != 0 or not p.stdout.strip():
        return None
    free, total = (int(x) for x in p.stdout.split(","))
    return free, total


needs_gpu = pytest.mark.skipif(gpu_memory_mib() is None, reason="needs a CUDA GPU (bench/gpu: the engine_mem stage)")


@contextmanager
def foreign_holder(gib: float, tmp: Path):
    """A process that is not ours holding `gib` GiB of GPU 0 until the block ends."""
    ready = tmp / f"held-{gib:.1f}"
    proc = subprocess.Popen([sys.executable, str(HOLDER), "--gib", f"{gib:.2f}", "--ready-file", str(ready)])
    try:
        deadline = time.monotonic() + 300
        while not ready.exists():
            assert proc.poll() is None, f"the holder died (exit {proc.returncode})"
            assert time.monotonic() < deadline, "the holder never got its memory"
            time.sleep(0.5)
        yield proc
    finally:
        proc.kill()
        proc.wait()


def step(name: str, *args, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """One pipeline step as the host runs it; the user's share unset unless `env` sets it."""
    environ = {k: v for k, v in os.environ.items() if k != SHARE_ENV}
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline." + name.removesuffix(".py"), *map(str, args)], capture_output=True, text=True,
                       env={**environ, **(env or {})}, timeout=timeout)
    p.output = p.stdout + p.stderr
    return p


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """A small random Llama (head_dim 64, what the GPU kernels take) and 8 prepared chat samples."""
    root = tmp_path_factory.mktemp("engine_mem")
    model, out = root / "model", root / "out"
    r = step("tiny_model.py", "--out", model, "--kind", "llama", "--hidden", "256", "--layers", "8", "--vocab", "1024",
             "--dtype", "bf16")
    assert r.returncode == 0, r.output[-3000:]
    r = step("prepare.py", "--model", model, "--dataset", REPO / "kimi_eagle_host" / "sample_data" / "chat.jsonl",
             "--output-dir", out, "--seq-len", "256", "--max-samples", "8")
    assert r.returncode == 0, r.output[-3000:]
    return {"root": root, "model": model, "out": out}


@pytest.fixture(scope="module")
def held(pipeline):
    """Another process holds 60 % of the GPU: vLLM's default share (0.9) no longer fits in what is free."""
    free, total = gpu_memory_mib()
    with foreign_holder(0.6 * total / 1024, pipeline["root"]) as proc:
        yield proc


def engine_share(output: str) -> tuple[float, float]:
    """(GiB the engine may take, GiB free at start) from the step's log line."""
    m = re.search(r"vLLM engine memory: \d+% of the GPU \(([\d.]+) GiB; ([\d.]+) of [\d.]+ GiB free at start", output)
    assert m, output[-3000:]
    return float(m[1]), float(m[2])


@needs_gpu
def test_gpu_every_engine_starts_beside_a_foreign_holder(pipeline, held):
    free, total = gpu_memory_mib()
    assert free < 0.9 * total, "the holder must leave less than vLLM's default share free"
    model, out = pipeline["model"], pipeline["out"]

    r = step("extract.py", "--model", model, "--output-dir", out, "--backend", "vllm", "--seq-len", "256")
    assert r.returncode == 0, r.output[-4000:]
    takes, free_gib = engine_share(r.output)
    assert takes <= free_gib < 0.9 * total / 1024, r.output[-2000:]
    assert len(list((out / "hidden_states").glob("hs_*.safetensors"))) == 8

    for name, args in (("vocab.py", ("--model", model, "--output-dir", out, "--draft-vocab-size", "256")),
                       ("train.py", ("--model", model, "--output-dir", out, "--max-steps", "1", "--compile", "off"))):
        r = step(name, *args)
        assert r.returncode == 0, r.output[-4000:]

    r = step("eval.py", "--model", model, "--output-dir", out, "--engine", "vllm", "--num-prompts", "2",
             "--prompts", REPO / "kimi_eagle_host" / "sample_data" / "prompts_eval.jsonl", "--max-tokens", "16",
             "--batch-sizes", "1", "--timing-prompts", "1")
    assert r.returncode == 0, r.output[-4000:]
    assert json.loads((out / "eval" / "report.json").read_text())["engine"] == "vllm"
    assert engine_share(r.output)[0] <= free / 1024

    r = step("regenerate.py", "--model", model, "--dataset", REPO / "kimi_eagle_host" / "sample_data" / "chat.jsonl",
             "--output-dir", out, "--engine", "vllm", "--max-prompts", "4", "--max-tokens", "16", "--max-model-len", "512")
    assert r.returncode == 0, r.output[-4000:]
    assert engine_share(r.output)[0] <= free / 1024
    assert held.poll() is None, "the foreign holder must outlive every step"


@needs_gpu
def test_gpu_vllms_default_share_would_not_start_there(pipeline, held, tmp_path):
    """What every step did before it sized its engine: the user's 0.9 (vLLM's default) wins, and vLLM refuses."""
    r = step("extract.py", "--model", pipeline["model"], "--output-dir", pipeline["out"], "--out", tmp_path / "hs",
             "--backend", "vllm", "--seq-len", "256", env={SHARE_ENV: "0.9"})
    assert r.returncode != 0 and "90% of the GPU" in r.output and ENGINE_STARTS in r.output, r.output[-3000:]
    assert held.poll() is None


@needs_gpu
def test_gpu_too_little_free_is_one_line_before_any_engine(pipeline, tmp_path):
    free, total = gpu_memory_mib()
    # Left beside the holder (whose own CUDA context takes ~0.5 GiB more): 2.5 GiB, under the engine's 2 % margin of
    # an H200; then 1 GiB, where not even the step's CUDA context fits (on the H200 that was a CUDA out-of-memory
    # traceback from asking how much is free)
    for left_gib in (2.5, 1.0):
        with foreign_holder(free / 1024 - left_gib, tmp_path) as proc:
            r = step("extract.py", "--model", pipeline["model"], "--output-dir", pipeline["out"], "--out",
                     tmp_path / "hs", "--backend", "vllm", "--seq-len", "256")
            assert proc.poll() is None
        assert r.returncode == 1, r.output[-3000:]
        refusal = [s for s in r.stderr.splitlines() if s.startswith("extract: vLLM engine: the GPU has")]
        assert len(refusal) == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert ENGINE_STARTS not in r.output and not list((tmp_path / "hs").glob("hs_*"))
