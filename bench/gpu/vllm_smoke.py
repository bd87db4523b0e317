"""vLLM on the GPU machine, before our connector is involved: engine start-up (with torch.compile and CUDA
graphs, vLLM's defaults) and hidden-state extraction through vLLM's own ExampleHiddenStatesConnector on our
prepared samples. A smoke test of the carried install that also gives vLLM's stock figure.

    python bench/gpu/vllm_smoke.py --model DIR --prepared DIR --out DIR --layer-ids 2,10,17,20 [--seq-len 2048]

Prints one JSON line: import and engine start seconds, samples, tokens, tokens/s (generate() until every
file is written), files written.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's kimi_eagle_host


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--prepared", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--layer-ids", required=True)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--max-samples", type=int, default=0, help="the first N samples (0 = all)")
    a = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    t0 = time.time()
    from vllm import LLM, SamplingParams
    import vllm
    from kimi_eagle_host.data.prepared_data import PreparedDataset

    import_s = time.time() - t0
    ds = PreparedDataset(a.prepared)
    os.makedirs(a.out, exist_ok=True)
    ids = [int(i) for i in a.layer_ids.split(",")]
    t1 = time.time()
    llm = LLM(model=a.model, dtype="bfloat16", max_model_len=a.seq_len + 1, enable_prefix_caching=False,
              enforce_eager=a.enforce_eager, disable_log_stats=True,
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": ids}}},
              kv_transfer_config={"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {"shared_storage_path": a.out}})
    start_s = time.time() - t1
    n = min(len(ds), a.max_samples) if a.max_samples else len(ds)
    prompts = [{"prompt_token_ids": [int(t) for t in ds[i][0][:a.seq_len]]} for i in range(n)]
    tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
    t2 = time.time()
    outs = llm.generate(prompts, SamplingParams(max_tokens=1), use_tqdm=False)
    paths = [o.kv_transfer_params.get("hidden_states_path") for o in outs if o.kv_transfer_params]
    deadline = time.time() + 300
    while time.time() < deadline and any(os.path.exists(p + ".lock") and not os.path.exists(p) for p in paths):
        time.sleep(0.05)
    # The stock connector holds an exclusive lock on <file>.lock while it writes; wait for every lock.
    import fcntl

    for p in paths:
        if os.path.exists(p + ".lock"):
            with open(p + ".lock") as lf:
                fcntl.flock(lf, fcntl.LOCK_SH)
    secs = time.time() - t2
    print(json.dumps({"vllm": vllm.__version__, "import_s": round(import_s, 1), "engine_start_s": round(start_s, 1),
                      "samples": len(prompts), "tokens": tokens, "seconds": round(secs, 3),
                      "tokens_per_s": round(tokens / secs, 1), "files": len(glob.glob(os.path.join(a.out, "*.safetensors"))),
                      "enforce_eager": a.enforce_eager}))


if __name__ == "__main__":
    main()
