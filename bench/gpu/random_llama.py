"""A Llama of any size with random bf16 weights, written fast (weights drawn on the GPU), for throughput runs.

    python bench/gpu/random_llama.py --out DIR --hidden 4096 --layers 32 --heads 32 --kv-heads 8 \
        --intermediate 14336 --vocab 32000            # 8 B-class (Llama-3-8B shapes, 32 k vocab)

kimi_eagle_host's tiny_model step draws every weight on the CPU from one seeded generator (reproducible, but
minutes for 8 B parameters). Throughput only needs the shapes, so here each tensor is drawn on the device and
saved in 4 GB safetensors shards; the tokenizer is tiny_model's (byte-level BPE padded to --vocab).
Prints one JSON line: parameters, seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--hidden", type=int, required=True)
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--heads", type=int, required=True)
    ap.add_argument("--kv-heads", type=int, required=True)
    ap.add_argument("--intermediate", type=int, required=True)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig, LlamaForCausalLM

    sys.path.insert(0, str(ROOT))  # the checkout's kimi_eagle_host
    from kimi_eagle_host.pipeline.tiny_model import build_tokenizer

    t0 = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(a.vocab)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, num_hidden_layers=a.layers,
                      num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, intermediate_size=a.intermediate,
                      max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      pad_token_id=tok.pad_token_id, tie_word_embeddings=False, dtype="bfloat16")
    cfg.architectures = ["LlamaForCausalLM"]
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    g = torch.Generator(device=a.device).manual_seed(a.seed)
    shard, shard_bytes, index, n = {}, 0, {}, 0

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(set(index.values())) + 1:05d}.safetensors"
        for k in shard:
            index[k] = name
        save_file(shard, str(out / name), metadata={"format": "pt"})
        shard, shard_bytes = {}, 0

    for name, shape in shapes.items():
        if len(shape) >= 2:
            t = torch.randn(shape, generator=g, device=a.device, dtype=torch.bfloat16) * 0.02
        else:  # norm weights near 1
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, device=a.device, dtype=torch.bfloat16)
        shard[name] = t.cpu()
        shard_bytes += t.numel() * 2
        n += t.numel()
        if shard_bytes >= 4 << 30:
            flush()
    if shard:
        flush()
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 2 * n},
                                                                  "weight_map": index}))
    cfg.save_pretrained(out)
    tok.save_pretrained(out)
    print(json.dumps({"out": str(out), "parameters": n, "seconds": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
