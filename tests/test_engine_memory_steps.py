"""Every step that starts a vLLM engine (extract, regenerate, eval) sizes its memory share one way
(vllm_compat.step_engine_memory), and preflight says what each will take.

On a CPU host the engine's KV cache is what the step wants (its sequences at once, each of its context), at most
half of the memory available, and at least one sequence: when not even that fits, the step refuses in one line
before any engine starts, with nothing written. A value the user set wins. Memory figures are this machine's own
(/proc/meminfo, as vLLM's CPU worker reads them); the steps and preflight run in the real vLLM 0.32 CPU build. The
steps starting their engines on a host whose memory another process holds: test_regenerate_eval.py (vllm tier).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import REPO, make_env
from drafts import stub_draft
from held_memory import meminfo

from kimi_eagle_host.vllm_compat import GIB, engine_memory, step_engine_memory

PAYLOADS = REPO / "kimi_eagle_host"
PREFLIGHT = ["-m", "kimi_eagle_host.ops.preflight"]  # after the host's Python
# Far more context than this machine's memory holds the KV cache of, even for a tiny model (10^8 tokens).
HUGE_CONTEXT = 100_000_000
NOT_ONE_SEQUENCE = "the vLLM engine's KV cache needs"


def llama_config(path: Path) -> Path:
    """A model folder with only a Llama config: 8 layers, 1 KV head of 32 (1 KiB of bf16 KV per token)."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512}))
    return path


# ------------------------------------------------------------------------------ the sizing, on this machine

def test_the_users_kv_cache_wins():
    m = engine_memory(1 << 50, environ={"VLLM_CPU_KVCACHE_SPACE": "3"})
    assert m["env"] == {} and "KV cache 3 GiB of host memory (VLLM_CPU_KVCACHE_SPACE as set" in m["says"]


def test_a_step_wanting_more_than_half_of_what_is_available_gets_half(tmp_path):
    model = llama_config(tmp_path / "m")
    available, _ = meminfo()
    # 256 sequences of a context whose KV cache is an eighth of what is available: one fits, all of them do not.
    tokens = available // 8 // 1024
    m = step_engine_memory(str(model), 1, tokens, 256, environ={})
    gib = int(m["env"]["VLLM_CPU_KVCACHE_SPACE"])
    assert tokens * 1024 <= gib * GIB <= available / 2 + GIB and "half of what is available" in m["says"]


def test_the_engines_one_step_runs_at_once_each_size_themselves_for_their_part(tmp_path):
    """regenerate --engines N: on a CPU host the N engines split the half of host memory one engine may take; on a
    GPU the engines dealt to it split what was free there (at most vLLM's default share). The step's processes
    (engine_processes.process_env) and preflight (several_engines_environ) give every engine the same environment to
    size itself in."""
    from kimi_eagle_host.engine.engine_processes import process_env
    from kimi_eagle_host.ops.preflight.engine import several_engines_environ
    from kimi_eagle_host.vllm_compat import GPU_ENGINES_ENV, GPU_SHARE_ENV

    model = llama_config(tmp_path / "m")
    available, _ = meminfo()
    tokens = available // 32 // 1024   # one sequence fits an eighth of what is available; 256 of them want more
    one = int(step_engine_memory(str(model), 1, tokens, 256, environ={})["env"]["VLLM_CPU_KVCACHE_SPACE"])
    env = {k: v for k, v in several_engines_environ(4, 0).items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    four = step_engine_memory(str(model), 1, tokens, 256, environ=env)
    assert int(four["env"]["VLLM_CPU_KVCACHE_SPACE"]) <= one // 4 + 1 and "shared by 4 engines" in four["says"]
    with pytest.raises(ValueError, match="available to 16 engines; the vLLM engine's KV cache needs"):
        step_engine_memory(str(model), 1, tokens, 256, environ={**env, "KIMI_EAGLE_ENGINE_OF": "0/16"})
    # GPUs: 4 engines on 2 GPUs, two a GPU: 0.45 each on an idle GPU, whichever of the two says it
    step_env = process_env(1, 4, ["0", "1"], environ={})
    assert step_env[GPU_ENGINES_ENV] == several_engines_environ(4, 2)[GPU_ENGINES_ENV] == "0/2"
    gpu = step_engine_memory(str(model), 1, 64, 1, gpu_free_total=(130 * GIB, 140 * GIB), environ=step_env)
    assert gpu["kwargs"]["gpu_memory_utilization"] == 0.45 and "its part, 2 engines on the GPU" in gpu["says"]
    assert GPU_ENGINES_ENV not in several_engines_environ(1, 2)   # one engine: vLLM's own sizing
    assert GPU_ENGINES_ENV not in process_env(0, 2, ["0"], environ={GPU_SHARE_ENV: "0.3"})   # the user's share wins
    # 3 engines on a GPU another process holds half of: each takes a third of what was free, the later ones
    # seeing what the ones up left (they start one at a time)
    total, free, shares = 140 * GIB, 70 * GIB, []
    for up in range(3):
        m = step_engine_memory(str(model), 1, 64, 1, gpu_free_total=(free, total),
                               environ={GPU_ENGINES_ENV: f"{up}/3"})
        shares.append(m["kwargs"]["gpu_memory_utilization"])
        free -= int(shares[-1] * total)
    assert shares == [0.16, 0.16, 0.16] and free >= 0, (shares, free)


def test_on_a_cpu_host_the_engine_runs_in_the_steps_process_unless_told(tmp_path, capsys):
    """vLLM's engine core and worker would each be a process of their own, each importing vLLM again (half of an
    engine's CPU time on this box): a CPU host's steps keep the engine in their process. The user's setting wins,
    and extraction, whose connector needs the engine process, keeps it."""
    from kimi_eagle_host.vllm_compat import IN_PROCESS_ENV, size_engine

    model = str(llama_config(tmp_path / "m"))
    env: dict = {}
    m = size_engine("eval", model, 1, 64, 1, environ=env)
    assert env[IN_PROCESS_ENV] == "0" and "the engine runs in this process" in m["says"]
    assert "the engine runs in this process" in capsys.readouterr().err
    for env, in_process, want in (({IN_PROCESS_ENV: "1"}, True, "1"), ({}, False, None)):
        m = size_engine("extract", model, 1, 64, 1, environ=env, in_process_on_cpu=in_process)
        assert env.get(IN_PROCESS_ENV) == want and "in this process" not in m["says"]


def test_a_step_whose_one_sequence_does_not_fit_is_one_line(tmp_path):
    with pytest.raises(ValueError) as e:
        step_engine_memory(str(llama_config(tmp_path / "m")), 1, HUGE_CONTEXT, 1, environ={})
    assert "\n" not in str(e.value) and NOT_ONE_SEQUENCE in str(e.value) and "VLLM_CPU_KVCACHE_SPACE" in str(e.value)


def test_preflight_sizes_an_engine_from_the_least_free_of_the_gpus_it_spans(tmp_path, monkeypatch):
    """An engine over --tp-size GPUs (or several engines, one a GPU) starts only where every one of its GPUs has
    room: on a host whose second GPU another process holds, tp 2 fails on that GPU, named, where preflight read the
    first GPU only and passed; tp 1 stays on the free first GPU and passes. GPUs as nvidia-smi
    lists them (a stand-in script); the sizing is the steps' own (real, no vLLM needed to decide)."""
    from kimi_eagle_host.ops.preflight.cli import build_parser, parse_step_settings
    from kimi_eagle_host.ops.preflight.engine import check_engine_memory

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/usr/bin/env bash\n"
                   "echo '0, NVIDIA H200, 143771, 143000, GPU-0f1e2d3c-aaaa'\n"
                   "echo '1, NVIDIA H200, 143771, 400, GPU-9a8b7c6d-bbbb'\n")
    smi.chmod(0o755)
    model = llama_config(tmp_path / "m")
    for name in ("CUDA_VISIBLE_DEVICES", "KIMI_EAGLE_GPU_MEMORY_UTILIZATION"):
        monkeypatch.delenv(name, raising=False)
    ctx = {"vllm": {"dist": "vllm", "version": "0.32.0"}, "vllm_path": "native", "torch_cuda": "12.8"}

    def engine_memory(*flags, settings=None, step="regenerate"):
        args = build_parser().parse_args(["--step", step, "--engine", "vllm", "--model", str(model), *flags])
        args.smi_path, args.layer_ids_parsed = str(smi), None
        args.step_settings_parsed = parse_step_settings(json.dumps({step: settings or {}}), step)
        (c,) = check_engine_memory(args, ctx)
        return c

    c = engine_memory("--tp-size", "1")
    assert c["status"] == "pass" and c["detail"].startswith("regenerate: GPU0: vLLM engine memory:"), c
    c = engine_memory("--tp-size", "2")
    assert c["status"] == "fail" and c["detail"].startswith(
        "regenerate: GPU1, the least free of its 2 GPUs: the GPU has 0.4 of 140.4 GiB free"), c
    # the host's `gpus: 1` narrows the job to GPU 0: two engines share it
    c = engine_memory("--gpus", "1", settings={"engines": 2})
    assert c["status"] == "pass" and c["detail"].startswith("regenerate (each of 2 engines): GPU0: "), c
    # engines dealt over both GPUs: the held one has no room for its engine (each engine's part of vLLM's default
    # share was taken as the user's setting, never weighed against what is free, and this passed)
    c = engine_memory("--tp-size", "1", settings={"engines": 4})
    assert c["status"] == "fail" and c["detail"].startswith(
        "regenerate (each of 4 engines): GPU1, the least free of its 2 GPUs: the GPU has 0.4 of 140.4 GiB free for "
        "2 engines;"), c
    # online, an engine beside each of the trainer's GPUs: the held one fails; the split layout's engine on GPU 0 fits
    c = engine_memory("--hidden-states", "online", step="train")
    assert c["status"] == "fail" and c["detail"].startswith(
        "train (online engine, beside the trainer): GPU1, the least free of its 2 GPUs: the GPU has 0.4 of"), c
    c = engine_memory("--hidden-states", "online", "--engine-gpus", "0", step="train")
    assert c["status"] == "pass" and c["detail"].startswith("train (online engine): GPU0: vLLM engine memory:"), c


# --------------------------------------------------------------------- the steps and preflight, on vLLM 0.32

@pytest.fixture(scope="module")
def v32(tmp_path_factory):
    from vllm_envs import SUITE_VLLM, env_python

    py = env_python(SUITE_VLLM)
    root = tmp_path_factory.mktemp("v32")
    model = root / "tiny-llama"
    subprocess.run([str(py), "-m", "kimi_eagle_host.pipeline.tiny_model", "--kind", "llama", "--heads", "2",
                    "--out", str(model)], check=True, capture_output=True, timeout=600)
    prompts = root / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                               for i in range(2)))
    cfg = json.loads((model / "config.json").read_text())
    # a model that states a context as long as the one asked for: the engine's memory, not the model, refuses it
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": HUGE_CONTEXT}))
    # a stand-in export of this target (never loaded as a model): its context is the target's, as train copies it,
    # so parity passes and the engine's memory is what refuses
    draft = stub_draft(root / "draft", cfg["hidden_size"], cfg["vocab_size"], draft_vocab=64, aux_ids=[1, 2, 3],
                       context=HUGE_CONTEXT)
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    return {"py": py, "model": model, "prompts": prompts, "draft": draft, "env": env}


@pytest.mark.vllm
@pytest.mark.timeout(900)
@pytest.mark.parametrize("script, flags", [
    ("regenerate.py", ["--dataset", "{prompts}"]),
    ("eval.py", ["--prompts", "{prompts}", "--draft", "{draft}"]),
])
def test_a_step_refuses_in_one_line_before_its_engine_starts_when_one_sequence_does_not_fit(v32, tmp_path, script,
                                                                                             flags):
    out = tmp_path / "out"
    argv = [str(v32["py"]), "-m", "kimi_eagle_host.pipeline." + script.removesuffix(".py"), "--model", str(v32["model"]), "--engine", "vllm",
            "--output-dir", str(out), "--max-model-len", str(HUGE_CONTEXT),
            *[f.format(prompts=v32["prompts"], draft=v32["draft"]) for f in flags]]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=v32["env"])
    step = script[:-3]
    refusal = [ln for ln in p.stderr.splitlines() if ln.startswith(f"{step}: vLLM engine: host memory:")]
    assert p.returncode == 1 and len(refusal) == 1 and NOT_ONE_SEQUENCE in refusal[0], p.stderr[-3000:]
    assert "Traceback" not in p.stderr and "Initializing a V1 LLM engine" not in p.stderr  # no engine started
    assert json.loads(p.stdout.strip().splitlines()[-1])["error"] == refusal[0][len(step) + 2:]
    assert not out.exists()  # nothing written


def preflight(v32, step, *extra, env=None):
    p = subprocess.run([str(v32["py"]), *PREFLIGHT, "--step", step, "--backend", "vllm", "--model",
                        str(v32["model"]), *extra], capture_output=True, text=True, timeout=300,
                       env=env or v32["env"])
    return [c for c in json.loads(p.stdout)["checks"] if c["name"] == "engine-memory"]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_preflight_says_what_the_regenerate_and_eval_engines_take(v32):
    sized = "vLLM engine memory: KV cache 1 GiB of host memory (VLLM_CPU_KVCACHE_SPACE, sized from the step"
    for step in ("regenerate", "eval"):
        (c,) = preflight(v32, step)
        assert c["status"] == "pass" and c["detail"].startswith(f"{step}: {sized}"), c
    (c,) = preflight(v32, "eval", env={**v32["env"], "VLLM_CPU_KVCACHE_SPACE": "3"})
    assert c["status"] == "pass" and "KV cache 3 GiB of host memory (VLLM_CPU_KVCACHE_SPACE as set" in c["detail"]
    # online, train runs extract's engine itself: preflight sizes that one (with the hidden states it keeps), not
    # extract's, and says where it runs
    (c,) = preflight(v32, "train", "--hidden-states", "online")
    assert c["status"] == "pass" and c["detail"].startswith(f"train (online engine, beside the trainer): {sized}"), c
    (c,) = preflight(v32, "all", "--hidden-states", "online", "--engine-gpus", "1")
    assert c["status"] == "pass" and c["detail"].startswith(f"train (online engine): {sized}"), c
    (c,) = preflight(v32, "regenerate", "--step-settings", json.dumps({"regenerate": {"engines": 2}}))
    assert c["status"] == "pass" and c["detail"].startswith(f"regenerate (each of 2 engines): {sized}"), c
    (c,) = preflight(v32, "regenerate", "--step-settings", json.dumps({"regenerate": {"max_model_len": HUGE_CONTEXT}}))
    assert c["status"] == "fail" and c["detail"].startswith("regenerate: host memory:") and "\n" not in c["detail"]
    assert "VLLM_CPU_KVCACHE_SPACE" in c["fix"]


@pytest.mark.vllm
@pytest.mark.timeout(900)
def test_preflight_through_the_controller_sizes_each_engine_of_the_chain_with_its_recipe_settings(v32, tmp_path,
                                                                                                  sshd):
    """`preflight all` with regenerate and eval in the chain: the host sizes both engines with the recipe's settings
    of each step (here eval's context cannot fit: that one fails, naming the step)."""
    extra = textwrap.dedent(f"""\
        pipeline:
          model: {v32["model"]}
          dataset: {v32["prompts"]}
          output_dir: {tmp_path / "out"}
          regenerate: true
          eval_prompts: {v32["prompts"]}
          steps:
            regenerate: {{max_model_len: 512, chunk_size: 8}}
            eval: {{max_model_len: {HUGE_CONTEXT}}}
        """)
    e = make_env(tmp_path, sshd, host_env={"HF_HUB_OFFLINE": "1"}, extra=extra, python=str(v32["py"]))
    r = e.cli("--json", "preflight", "all", "--host", "gpu", timeout=300)
    (doc,) = r.json()
    memory = {c["detail"].split(":")[0]: c for c in doc["checks"] if c["name"] == "engine-memory"}
    assert set(memory) == {"regenerate", "eval"}, doc["checks"]
    assert memory["regenerate"]["status"] == "pass" and "KV cache 1 GiB" in memory["regenerate"]["detail"]
    assert memory["eval"]["status"] == "fail" and NOT_ONE_SEQUENCE in memory["eval"]["detail"]
    assert r.code != 0 and not doc["ok"]
