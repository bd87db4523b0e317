"""Random 1B-shaped inputs for the trainer (hidden 2048, 20 layers, vocab 32000, draft vocab 8192; documents of
800-2047 tokens). RT_HIDDEN, RT_LAYERS, RT_VOCAB, RT_DRAFT_VOCAB, RT_MIN_LEN, RT_MAX_LEN: smaller ones, for a CPU
rehearsal (bench/gpu/trainer_cuda_check.sh)."""
import json, os, sys
import numpy as np, torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
from kimi_eagle_host.data.hs_manifest import write_manifest  # noqa: E402

root = sys.argv[1]; n_docs = int(sys.argv[2]) if len(sys.argv) > 2 else 40
H, N, V, K = (int(os.environ.get(f"RT_{k}", d)) for k, d in (("HIDDEN", 2048), ("LAYERS", 20), ("VOCAB", 32000),
                                                             ("DRAFT_VOCAB", 8192)))
MIN_LEN, MAX_LEN = int(os.environ.get("RT_MIN_LEN", 800)), int(os.environ.get("RT_MAX_LEN", 2048))
os.makedirs(f"{root}/target", exist_ok=True); os.makedirs(f"{root}/out/hidden_states", exist_ok=True)
os.makedirs(f"{root}/out/vocab", exist_ok=True)
json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": H, "num_hidden_layers": N,
           "vocab_size": V, "num_attention_heads": 16, "num_key_value_heads": 16, "intermediate_size": 11 * H // 4,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 4096, "tie_word_embeddings": False},
          open(f"{root}/target/config.json", "w"))
g = torch.Generator().manual_seed(0)
save_file({"model.embed_tokens.weight": (0.02 * torch.randn(V, H, generator=g)).bfloat16(),
           "model.norm.weight": torch.ones(H).bfloat16(),
           "lm_head.weight": (0.02 * torch.randn(V, H, generator=g)).bfloat16()}, f"{root}/target/model.safetensors")
rng = np.random.default_rng(0)
ids = np.sort(rng.choice(V, K, replace=False)); t2d = np.zeros(V, bool); t2d[ids] = True
np.save(f"{root}/out/vocab/d2t.npy", (ids - np.arange(K)).astype(np.int64)); np.save(f"{root}/out/vocab/t2d.npy", t2d)
for i in range(n_docs):
    T = int(rng.integers(MIN_LEN, MAX_LEN))
    lm = torch.ones(T, dtype=torch.int64); lm[:16] = 0
    save_file({"token_ids": torch.randint(0, V, (T,), generator=g), "loss_mask": lm,
               "hidden_states": torch.randn(T, 4, H, generator=g).bfloat16()}, f"{root}/out/hidden_states/hs_{i}.safetensors")
json.dump({"layer_ids": [2, N // 2, N - 3, N], "num_layers": N, "hidden_size": H, "layer_convention": "vllm"},
          open(f"{root}/out/hidden_states/data_config.json", "w"))
# What extract writes last: train reads exactly the samples a manifest lists (without it: "manifest.json: missing").
write_manifest(f"{root}/out/hidden_states", n_docs)
print("data ready")
