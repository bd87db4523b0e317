"""The vLLM backends for real, through the product, on real vLLM CPU builds (tests/vllm_envs.py):

  part 1  vLLM 0.16.0 + speculators 0.3.0 / 0.4.0 (real wheels, patched by `deploy-patch`): unpatched 0.3.0 fails
          with the seed's error; patched, `run extract --backend vllm` equals `--backend hf --dtype float32` per
          layer within bf16 error, on a tiny Llama and on a tiny Llava laid out like a Hub checkpoint (the closest
          wrapper vLLM 0.16 runs on CPU: its Kimi-K2.5 / DeepSeek classes use MLA, which its CPU backend refuses).
  part 2  vLLM 0.32.0 native extract_hidden_states with our KV connector: equal to hf, resumable.
  part 3  the draft `train` exports from those states, served by vLLM 0.32 as an EAGLE-3 speculator.

The host is the real sshd fixture whose `python` is the vLLM env's interpreter. Engines are expensive on 2 cores
(minutes each), so each module fixture runs one extraction and several tests read its files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, make_env
from fixtures_speculators import _wheel
from vllm_envs import SUITE_VLLM, env_python

# Engine loads take minutes on 2 shared cores; the module fixtures run inside the first test that needs them.
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]

PAYLOADS = REPO / "kimi_eagle_host"
SAMPLE = PAYLOADS / "sample_data" / "chat.jsonl"
N_LAYERS = 6
LAYER_IDS = [1, 2, 4, N_LAYERS]      # vLLM convention; id N (last layer's output, pre-norm) included
SEQ_LEN, SAMPLES = 128, 16
# vLLM computes in bfloat16; hf runs float32. Mean relative error per layer seen: 0.35-0.9 %. An off-by-one
# layer is 40-98 % away, so 3 % separates right from wrong by an order of magnitude.
TOL = 0.03
HOST_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
            "VLLM_CPU_OMP_THREADS_BIND": "nobind"}


def build_model(py: Path, out: Path, kind: str) -> Path:
    """A tiny random model written by the env's own transformers (4.57 for vLLM 0.16: the Hub weight layout).
    head_dim 32: vLLM's CPU attention kernels start there."""
    subprocess.run([str(py), "-m", "kimi_eagle_host.pipeline.tiny_model", "--out", str(out), "--kind", kind,
                    "--layers", str(N_LAYERS), "--hidden", "64", "--heads", "2"],
                   check=True, capture_output=True, timeout=600)
    return out


def host_env(tmp_path, sshd, py: Path, model: Path, out_dir: Path, site: Path | None = None, backend="vllm",
             kv_space=True):
    """kv_space=False: the host's env sets no VLLM_CPU_KVCACHE_SPACE (as a user's would not)."""
    extra = textwrap.dedent(f"""\
        pipeline:
          model: {model}
          dataset: {SAMPLE}
          output_dir: {out_dir}
          layer_ids: {json.dumps(LAYER_IDS)}
          backend: {backend}
          seq_len: {SEQ_LEN}
          batch_size: 4
          tp_size: 1
        """)
    env = {**HOST_ENV, "PYTHONPATH": str(site) if site else ""}
    if not kv_space:
        del env["VLLM_CPU_KVCACHE_SPACE"]
    e = make_env(tmp_path, sshd, host_env=env, extra=extra, python=str(py))
    return e


def run_step(e, step, *extra, timeout=1500, overrides=()):
    r = e.cli("--json", "run", step, "--host", "gpu", "--no-gpu", "--no-preflight", *overrides, "--", *extra,
              timeout=timeout)
    assert r.code == 0, f"{step} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    return r


def mean_rel_err(a_dir: Path, b_dir: Path, shift: int = 0) -> list[float]:
    """Per layer: mean over tokens of |a - b| / |b| (L2 over hidden), all samples; token ids must be identical.
    shift=k compares a's layer j with b's layer j+k (an off-by-one capture)."""
    import torch
    from safetensors.torch import load_file

    files = sorted(a_dir.glob("hs_*.safetensors"))
    assert len(files) == SAMPLES
    sums, count = None, 0
    for f in files:
        a, b = load_file(str(f)), load_file(str(b_dir / f.name))
        assert torch.equal(a["token_ids"], b["token_ids"]), f.name
        assert torch.equal(a["loss_mask"].long(), b["loss_mask"].long()), f.name
        ha, hb = a["hidden_states"].float(), b["hidden_states"].float()
        assert ha.shape == hb.shape == (len(a["token_ids"]), len(LAYER_IDS), 64), (ha.shape, hb.shape)
        if shift:
            ha, hb = (ha[:, :-shift], hb[:, shift:]) if shift > 0 else (ha[:, -shift:], hb[:, :shift])
        rel = ((ha - hb).norm(dim=-1) / hb.norm(dim=-1).clamp_min(1e-6)).sum(0)
        sums = rel if sums is None else sums + rel
        count += ha.shape[0]
    return (sums / count).tolist()


def assert_progress_with_tokens_per_s(run_stdout: str, samples: int) -> dict:
    """The step's progress points as `logs --json` gives them: the last one says all samples done and a tokens/s
    figure (what the bar of `logs --follow` shows beside step/total and the ETA)."""
    points = []
    for line in run_stdout.splitlines():
        try:
            doc = json.loads(line)
        except ValueError:
            continue
        if isinstance(doc, dict) and isinstance(doc.get("progress"), dict) and doc["progress"]["step"] == "extract":
            points.append(doc["progress"])
    assert points, run_stdout[-3000:]
    last = points[-1]
    assert last["done"] == last["total"] == samples and last.get("tok_s", 0) > 0, points
    return last


def assert_matches_hf(got: Path, hf: Path):
    errs = mean_rel_err(got, hf)
    assert max(errs) < TOL, f"mean relative error per layer {errs} (tolerance {TOL})"
    for shift in (1, -1):   # the same comparison against the neighbouring layers must fail
        wrong = mean_rel_err(got, hf, shift)
        assert min(wrong) > 3 * TOL, f"off-by-one ({shift}) is too close: {wrong}"
    return errs


# ----------------------------------------------------------------------------------------------------
# part 1: vLLM 0.16.0 + speculators 0.3.0 / 0.4.0


@pytest.fixture(scope="module")
def v16(tmp_path_factory):
    py = env_python("0.16.0")
    root = tmp_path_factory.mktemp("v16")
    models = {k: build_model(py, root / k, k) for k in ("llama", "llava")}
    wheels = root / "wheels"
    sites = {}
    for v in ("0.3.0", "0.4.0"):
        sites[v] = root / f"site-{v}"
        subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check",
                        "--target", str(sites[v]), str(_wheel(v, wheels))], check=True, capture_output=True)
    return {"py": py, "root": root, "models": models, "sites": sites}


def test_unpatched_speculators_030_fails_with_the_seed_error(v16):
    script = textwrap.dedent("""
        import sys
        from speculators.data_generation.vllm_hidden_states_generator import VllmHiddenStatesGenerator
        if __name__ == "__main__":
            for model in sys.argv[1:]:
                try:
                    VllmHiddenStatesGenerator(model_path=model, layer_ids=[0, 1], max_model_len=64)
                    print("OK", model)
                except Exception as e:
                    print("ERR", type(e).__name__, " ".join(str(e).split())[:200])
        """)
    r = subprocess.run([str(v16["py"]), "-c", script, str(v16["models"]["llama"]), str(v16["models"]["llava"])],
                       capture_output=True, text=True, timeout=900,
                       env={**os.environ, **HOST_ENV, "PYTHONPATH": str(v16["sites"]["0.3.0"])})
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(("OK", "ERR"))]
    assert len(lines) == 2, r.stdout[-2000:] + r.stderr[-2000:]
    for ln in lines:
        assert ln.startswith("ERR ValidationError") and "SchedulerConfig" in ln and "is_encoder_decoder" in ln, ln


@pytest.fixture(scope="module")
def hf16(v16, tmp_path_factory, sshd):
    """prepare + `--backend hf --dtype float32` through the product, per model, on the 0.16 host."""
    out = {}
    for kind, model in v16["models"].items():
        tmp = tmp_path_factory.mktemp(f"hf16-{kind}")
        e = host_env(tmp, sshd, v16["py"], model, tmp / "out", backend="hf")
        run_step(e, "prepare", "--max-samples", str(SAMPLES))
        run_step(e, "extract", "--dtype", "float32")
        out[kind] = tmp / "out"
    return out


def extract_speculators(v16, hf16, tmp_path_factory, sshd, version, kind, batch_size=4):
    """deploy-patch -> preflight extract -> run extract --backend vllm, on a fresh copy of the speculators install."""
    tmp = tmp_path_factory.mktemp(f"s{version}-{kind}-b{batch_size}")
    site = tmp / "site"
    shutil.copytree(v16["sites"][version], site)
    e = host_env(tmp, sshd, v16["py"], v16["models"][kind], hf16[kind], site=site)
    r = e.cli("--json", "deploy-patch", "--host", "gpu")
    assert r.code == 0, r.stdout + r.stderr
    r = e.cli("--json", "preflight", "extract", "--host", "gpu")
    (doc,) = r.json()
    checks = {c["name"]: c for c in doc["checks"]}
    assert r.code == 0 and doc["ok"], json.dumps(doc["checks"], indent=1)
    assert f"speculators {version} + vllm 0.16.0: patch set" in checks["compat"]["detail"], checks["compat"]
    assert checks["patch"]["status"] == "pass", checks["patch"]
    assert checks["gpu"]["status"] == "warn" and "CPU build" in checks["gpu"]["detail"]
    # a folder of its own (the job records it) reading the hf run's prepared samples
    out = tmp / "hs" / "hidden_states"
    r = run_step(e, "extract", "--prepared-dir", str(hf16[kind] / "prepared"), "--batch-size", str(batch_size),
                 overrides=[f"output_dir={out.parent}"])
    assert_progress_with_tokens_per_s(r.stdout, SAMPLES)
    assert "speculators 0.3.0 (patched)" in r.stdout or version != "0.3.0", r.stdout[-3000:]
    cfg = json.loads((out / "data_config.json").read_text())
    assert cfg["engine"] == "vllm-speculators" and cfg["layer_ids"] == LAYER_IDS
    assert cfg["speculators_layer_ids"] == [i - 1 for i in LAYER_IDS]   # their convention: output of layer j
    return out, e


@pytest.fixture(scope="module")
def spec030_llama(v16, hf16, tmp_path_factory, sshd):
    return extract_speculators(v16, hf16, tmp_path_factory, sshd, "0.3.0", "llama")


def test_speculators_030_llama_matches_hf(spec030_llama, hf16):
    assert_matches_hf(spec030_llama[0], hf16["llama"] / "hidden_states")


@pytest.fixture(scope="module")
def spec040_llama_one_at_a_time(v16, hf16, tmp_path_factory, sshd):
    """0.4.0's extraction, one request at a time: what 0.3.0's batches are compared with (one engine start for both
    checks; both versions' generators run the same patched vLLM 0.16 engine on the same samples)."""
    return extract_speculators(v16, hf16, tmp_path_factory, sshd, "0.4.0", "llama", batch_size=1)


def test_speculators_030_batches_equal_batch_size_one(spec030_llama, spec040_llama_one_at_a_time):
    """speculators bug #279 (upstream): batched prefill and repeated generate() calls (4 calls of 4 here) must give what
    one request at a time gives."""
    errs = mean_rel_err(spec030_llama[0], spec040_llama_one_at_a_time[0])
    assert max(errs) < 5e-3, errs


def test_speculators_030_llava_hub_layout_matches_hf(v16, hf16, tmp_path_factory, sshd):
    model = v16["models"]["llava"]
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["text_config"]["architectures"] == ["LlamaForCausalLM"]
    assert (model / "preprocessor_config.json").is_file() and (model / "processor_config.json").is_file()
    from safetensors import safe_open
    with safe_open(str(model / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in names
    assert any(n.startswith("vision_tower.vision_model.") for n in names)
    out, _ = extract_speculators(v16, hf16, tmp_path_factory, sshd, "0.3.0", "llava")
    assert_matches_hf(out, hf16["llava"] / "hidden_states")


def test_speculators_040_llama_matches_hf(spec040_llama_one_at_a_time, hf16):
    assert_matches_hf(spec040_llama_one_at_a_time[0], hf16["llama"] / "hidden_states")


def test_vllm_016_cpu_backend_refuses_mla():
    """Why Kimi-K2.5 is not among the targets above: vLLM 0.16's CPU platform has no MLA attention."""
    src = (env_python("0.16.0").parent.parent / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
           / "site-packages" / "vllm" / "platforms" / "cpu.py").read_text()
    assert 'raise NotImplementedError("MLA is not supported on CPU.")' in src


# ----------------------------------------------------------------------------------------------------
# part 2: vLLM 0.32 native extraction with our KV connector; part 3: serving the trained draft


@pytest.fixture(scope="module")
def v32(tmp_path_factory, sshd):
    """The host's env sets no VLLM_CPU_KVCACHE_SPACE, as a user's would not: the product sizes the engine's memory
    (test_native_extraction_sizes_its_engine_from_free_memory)."""
    py = env_python(SUITE_VLLM)
    tmp = tmp_path_factory.mktemp("v32")
    model = build_model(py, tmp / "llama", "llama")
    e = host_env(tmp, sshd, py, model, tmp / "out", kv_space=False)
    assert "VLLM_CPU_KVCACHE_SPACE" not in e.inventory.read_text()
    run_step(e, "prepare", "--max-samples", str(SAMPLES))
    run_step(e, "extract", "--backend", "hf", "--dtype", "float32", "--prepared-dir", str(tmp / "out" / "prepared"),
             overrides=[f"output_dir={tmp / 'hf'}"])
    r = e.cli("--json", "preflight", "extract", "--host", "gpu")
    (doc,) = r.json()
    assert r.code == 0 and doc["ok"], json.dumps(doc["checks"], indent=1)
    checks = {c["name"]: c for c in doc["checks"]}
    assert "native extract_hidden_states" in checks["compat"]["detail"] and "patch" not in checks
    r = run_step(e, "extract")
    return {"py": py, "env": e, "model": model, "out": tmp / "out", "hf": tmp / "hf" / "hidden_states", "result": r.stdout,
            "preflight": checks}


def test_native_extraction_matches_hf(v32):
    hs = v32["out"] / "hidden_states"
    cfg = json.loads((hs / "data_config.json").read_text())
    assert cfg["engine"] == "vllm-native" and cfg["layer_ids"] == LAYER_IDS and cfg["dtype"] == "bfloat16"
    assert not list(hs.glob(".hs_*"))          # no temp files or error markers left
    assert_matches_hf(hs, v32["hf"])


def test_native_extraction_sizes_its_engine_from_free_memory(v32):
    """vLLM's own default asks for 0.92 of the host's memory and refuses to start when less is available ("Available
    memory on node 0 ... is less than desired CPU memory utilization"): on any machine where other processes hold more
    than 8 % of the memory (this one, shared by the test suite), the extraction failed at engine start. The engine's
    share is sized from what the extraction needs and what is free, and preflight says what it will take."""
    mem = v32["preflight"]["engine-memory"]
    assert mem["status"] == "pass" and "KV cache 1 GiB of host memory" in mem["detail"], mem
    assert "vLLM engine memory: KV cache 1 GiB of host memory" in v32["result"], v32["result"][-3000:]
    cfg = json.loads((v32["out"] / "hidden_states" / "data_config.json").read_text())
    assert cfg["engine"] == "vllm-native" and cfg["count"] == SAMPLES


def test_native_extraction_reports_its_progress_with_tokens_per_second(v32):
    assert_progress_with_tokens_per_s(v32["result"], SAMPLES)


def test_native_extraction_resumes(v32):
    import hashlib

    hs = v32["out"] / "hidden_states"
    digest = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in hs.glob("hs_*.safetensors")}
    for i in (3, 11):
        (hs / f"hs_{i}.safetensors").unlink()
    r = run_step(v32["env"], "extract")
    assert f"{SAMPLES - 2} done already, 2 to do" in r.stdout, r.stdout[-3000:]
    again = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in hs.glob("hs_*.safetensors")}
    assert again == digest      # the engine recomputes the two samples bit for bit


def test_trained_draft_serves_as_eagle3_in_vllm(v32):
    e, out = v32["env"], v32["out"]
    run_step(e, "vocab", "--draft-vocab-size", "256")
    run_step(e, "train", "--max-steps", "20", "--epochs", "5")
    export = out / "draft" / "export"
    cfg = json.loads((export / "config.json").read_text())
    assert cfg["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS[:-1]
    script = textwrap.dedent("""
        import json, sys
        if __name__ == "__main__":
            from vllm import LLM, SamplingParams
            target, draft = sys.argv[1], sys.argv[2]
            llm = LLM(model=target, dtype="bfloat16", max_model_len=256, enforce_eager=True, disable_log_stats=False,
                      speculative_config={"method": "eagle3", "model": draft, "num_speculative_tokens": 3})
            outs = llm.generate([{"prompt_token_ids": [1, 5, 9, 14, 30, 2, 7]}, {"prompt_token_ids": [3, 4, 8]}],
                                SamplingParams(max_tokens=24, temperature=0, ignore_eos=True), use_tqdm=False)
            m = {}
            for metric in llm.get_metrics():
                if metric.name.startswith("vllm:spec_decode"):
                    m[metric.name] = getattr(metric, "value", None) if not hasattr(metric, "values") else metric.values
            print("RESULT " + json.dumps({"tokens": [len(o.outputs[0].token_ids) for o in outs], "metrics": m}))
        """)
    # The engine core in this process, as eval and choose run it on a CPU host (vllm_compat.size_engine): vLLM's
    # default starts two more processes, each importing vLLM again (twice the CPU, docs/benchmarks.md).
    r = subprocess.run([str(v32["py"]), "-c", script, str(v32["model"]), str(export)], capture_output=True,
                       text=True, timeout=1200,
                       env={**os.environ, **HOST_ENV, "PYTHONPATH": "", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert r.returncode == 0 and line, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads(line[0][len("RESULT "):])
    assert doc["tokens"] == [24, 24]
    m = doc["metrics"]
    drafts, drafted = m["vllm:spec_decode_num_drafts"], m["vllm:spec_decode_num_draft_tokens"]
    assert drafts > 0 and drafted == 3 * drafts, m      # the draft really proposed, 3 tokens a time
    assert 0 <= m["vllm:spec_decode_num_accepted_tokens"] <= drafted
