"""One torch thread against two for a target's forward on this CPU, with the cores to itself and while another process
holds one: the measurement behind kimi_eagle_host/cpu_threads.py (a target of hidden size below 256 computes with one
thread on a CPU host).

Each case runs in a fresh process (torch's thread pool is set once per process): the demo's tiny Kimi-style target
(`tiny_model --kind kimi`, hidden size 64) and random Llamas of hidden size 256 and SmolLM2-135M's shape, a forward
of 4 x 100 tokens, the median of 30 after one warm-up. Prints one JSON line per case and the two-thread/one-thread
ratios.

  python3 bench/cpu_threads.py
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FORWARD = r"""
import json, os, statistics, sys, time, torch
from kimi_eagle_host.target.hf_target import load_model
model_dir, threads, shape = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if shape != "kimi" and not os.path.isdir(model_dir):
    from transformers import LlamaConfig, LlamaForCausalLM
    hidden, layers, inter, heads, kv, vocab = map(int, shape.split(","))
    LlamaForCausalLM(LlamaConfig(hidden_size=hidden, num_hidden_layers=layers, intermediate_size=inter,
                                 num_attention_heads=heads, num_key_value_heads=kv,
                                 vocab_size=vocab)).save_pretrained(model_dir)
model = load_model(model_dir, torch.float32, "cpu", 1)
torch.set_num_threads(threads)   # after load_model: the case's own count, whatever the rule chose
vocab = model.config.get_text_config().vocab_size
x = torch.randint(0, vocab, (4, 100))
walls = []
with torch.inference_mode():
    model(input_ids=x)
    cpu = time.process_time()
    for _ in range(30):
        t = time.perf_counter()
        model(input_ids=x)
        walls.append(time.perf_counter() - t)
print(json.dumps({"ms": round(statistics.median(walls) * 1000, 2),
                  "cpu_ms": round((time.process_time() - cpu) / 30 * 1000, 2)}))
"""

SHAPES = {  # name -> (hidden size, model argument)
    "tiny Kimi (the demo's)": (64, "kimi"),
    "Llama, hidden 256": (256, "256,8,768,4,4,8192"),
    "SmolLM2-135M's shape": (576, "576,30,1536,9,3,49152"),
}


def forward_ms(model_dir: Path, threads: int, shape: str, env: dict) -> dict:
    out = subprocess.run([sys.executable, "-c", FORWARD, str(model_dir), str(threads), shape], env=env,
                         capture_output=True, text=True, check=True, timeout=900)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRANSFORMERS_VERBOSITY": "error"}
    env.pop("OMP_NUM_THREADS", None)
    rows = []
    with tempfile.TemporaryDirectory(prefix="kimi-eagle-threads-") as tmp:
        kimi = Path(tmp) / "tiny-kimi"
        subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.tiny_model", "--kind", "kimi", "--out",
                        str(kimi)], env=env, check=True, capture_output=True, timeout=600)
        for name, (hidden, shape) in SHAPES.items():
            model_dir = kimi if shape == "kimi" else Path(tmp) / f"llama-{hidden}"
            for busy in (False, True):
                # Another process holding a core: a busy loop, as the controller, an engine or another job would.
                hog = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
                try:
                    one, two = (forward_ms(model_dir, n, shape, env) for n in (1, 2))
                finally:
                    if hog:
                        hog.kill()
                        hog.wait()
                row = {"target": name, "hidden": hidden, "another_process_on_a_core": busy, "one_thread": one,
                       "two_threads": two, "two_over_one_wall": round(two["ms"] / one["ms"], 2)}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"cores": os.cpu_count(), "ratios": {f"{r['target']}, {'busy' if r['another_process_on_a_core'] else 'idle'}":
                                                           r["two_over_one_wall"] for r in rows}}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
