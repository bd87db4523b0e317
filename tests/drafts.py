"""Targets and drafts the tests build, in one place: a tiny random Llama target, a draft our own trainer exports, a
config-only stand-in draft for checks that never load one, and a target/draft pair whose acceptance is known by
construction (the eval tests' reference).

Known acceptance. The target is a tiny Llama whose next token depends on its last token only, along a cycle:
every token x is embedded at one of M points of a circle, U[phi(x)], and the target answers the cycle's token
C[phi(x) + 1] (its attention and MLP outputs are zero, so every layer's residual stream is the embedding, and its
lm_head row of C[m] points at U[m - 1]). Once the target has answered, each token is the next on the cycle. A draft
that reads the fused aux features U[phi(x_j)] of position j and rotates them `lead` steps along the circle in its
MLP, then scores them with the target's own lm_head rows (d2t/t2d), proposes C[phi(x_j) + lead + 1] at step 0 and
moves one step on per further step:
  lead 1: exactly the target's next tokens, every draft accepted (acceptance length k + 1);
  lead 2: always one token ahead of the target, never accepted (acceptance length exactly 1.00).
M points 45 degrees apart keep every margin far beyond bf16's rounding (vLLM serves in bf16).
"""
from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

CYCLE = [70 + 5 * m for m in range(8)]   # ordinary BPE ids of the tiny tokenizer (specials are 0..7)
DRAFT_IDS = range(64, 128)               # the draft vocabulary: target ids 64..127, the cycle among them


def build_tiny_llama(tmp_path, out=None, seed=0, heads=None):
    """The tiny random Llama target (tiny_model --kind llama); with `out` and another seed, rebuilt in place with
    other weights. heads=2 gives head_dim 32, where vLLM's CPU attention kernels start."""
    out = Path(out or tmp_path / "tiny-llama")
    argv = [sys.executable, "-m", "kimi_eagle_host.pipeline.tiny_model", "--kind", "llama", "--out", str(out),
            "--seed", str(seed), *(["--heads", str(heads)] if heads else [])]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return out


def export_untrained_draft(tmp_path, model):
    """A draft exported by our own trainer after one step of a vanishing learning rate (= its init)."""
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from kimi_eagle_host.data.hs_manifest import write_manifest

    cfg = json.loads((model / "config.json").read_text())
    N, H, V = cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]
    out = tmp_path / "pipe"
    hs = out / "hidden_states"
    hs.mkdir(parents=True)
    ids = [2, N // 2, N - 3, N]
    for i in range(2):
        T = 12
        save_file({"token_ids": torch.randint(0, V, (T,)), "hidden_states": torch.randn(T, len(ids), H),
                   "loss_mask": torch.ones(T, dtype=torch.long)}, str(hs / f"hs_{i}.safetensors"))
    (hs / "data_config.json").write_text(json.dumps({"layer_ids": ids, "num_layers": N, "hidden_size": H,
                                                      "layer_convention": "vllm"}))
    write_manifest(str(hs), 2)
    (out / "vocab").mkdir()
    K = 64
    np.save(out / "vocab" / "d2t.npy", np.zeros(K, dtype=np.int64))
    t2d = np.zeros(V, dtype=bool)
    t2d[:K] = True
    np.save(out / "vocab" / "t2d.npy", t2d)
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.train", "--model", str(model), "--output-dir",
                        str(out), "--max-steps", "1", "--lr", "1e-12", "--dtype", "float32"],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return out / "draft" / "export"


def stub_draft(path, hidden, vocab, *, draft_vocab=128, aux_ids=(2, 4, 5), context=4096, nan_weights=False,
               layer=None, **config):
    """A config-only stand-in export for checks made before any model loads (never loaded as a model): what eval's
    checks read (config.json as speculators writes it, finite weights, d2t/t2d mapping draft token i to target token
    i) with `config` overriding top-level fields and `layer` the transformer_layer_config's."""
    import torch
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    cfg = {"speculators_model_type": "eagle3", "draft_vocab_size": draft_vocab,
           "eagle_aux_hidden_state_layer_ids": list(aux_ids),
           "transformer_layer_config": {"hidden_size": hidden, "vocab_size": vocab, "num_attention_heads": 4,
                                        "intermediate_size": 2 * hidden, "max_position_embeddings": context,
                                        "rope_theta": 10000.0, **(layer or {})}, **config}
    (path / "config.json").write_text(json.dumps(cfg))
    fc = torch.zeros(hidden, len(aux_ids) * hidden)
    fc[1, 2] = float("nan") if nan_weights else 0.0
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[:draft_vocab] = True
    save_file({"fc.weight": fc, "lm_head.weight": torch.zeros(draft_vocab, hidden),
               "d2t": torch.zeros(draft_vocab, dtype=torch.int64), "t2d": t2d}, str(path / "model.safetensors"))
    return path


# ------------------------------------------------------------------------------------------ known acceptance

def _circle(m, width):
    """U[m] (a point on the circle, plus a constant coordinate 2 the draft's MLP gates on), as a row of `width`."""
    import torch

    row = torch.zeros(width)
    angle = 2 * math.pi * (m % len(CYCLE)) / len(CYCLE)
    row[0], row[1], row[2] = math.cos(angle), math.sin(angle), 1.0
    return row


def cycle_target(tmp_path):
    """The cycle target (module doc), a real tiny_model Llama (head_dim 32, for vLLM) with its weights set."""
    import torch
    from safetensors.torch import load_file, save_file

    model = build_tiny_llama(tmp_path, tmp_path / "cycle-target", heads=2)
    weights = model / "model.safetensors"
    sd = load_file(str(weights))
    V, H = sd["model.embed_tokens.weight"].shape
    for name in sd:
        if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            sd[name] = torch.zeros_like(sd[name])          # every layer's residual stream is the embedding
        elif name.endswith("norm.weight"):
            sd[name] = torch.ones_like(sd[name])
    phase = {c: m for m, c in enumerate(CYCLE)}
    sd["model.embed_tokens.weight"] = torch.stack([_circle(phase.get(x, x), H) for x in range(V)])
    head = torch.zeros(V, H)
    for m, c in enumerate(CYCLE):
        head[c] = _circle(m - 1, H)
        head[c, 2] = 0.0
    sd["lm_head.weight"] = head
    save_file(sd, str(weights), metadata={"format": "pt"})
    return model


# A deeper known draft splits its rotation unevenly over its layers: each layer's MLP turns the point by its share of
# `lead` steps. Skip a layer, or run one twice, and the point lands on another token of the cycle.
LAYER_SHARES = {1: (1.0,), 2: (0.3, 0.7)}


def known_draft(target, out, lead, layers=1):
    """An export (our export_speculators) of the cycle target's draft that runs `lead` steps along the cycle:
    lead 1 proposes the target's own next tokens, lead 2 a token the target never chooses (module doc); `layers`
    2: a draft of two decoder layers whose rotations add up to the same (LAYER_SHARES)."""
    import torch

    from kimi_eagle_host.draft.draft_model import Eagle3Draft, draft_layer_config, export_speculators, \
        load_target_config

    tcfg, archs = load_target_config(str(target))
    N, H = tcfg["num_hidden_layers"], tcfg["hidden_size"]
    c = draft_layer_config(tcfg, argparse.Namespace(draft_num_heads=None, draft_num_kv_heads=None,
                                                    draft_intermediate_size=None, draft_layers=layers))
    aux = [2, N // 2, N - 3]
    draft = Eagle3Draft(c, len(aux), len(DRAFT_IDS), False)
    from safetensors.torch import load_file

    target_sd = load_file(str(Path(target) / "model.safetensors"))
    ids = torch.tensor(list(DRAFT_IDS))
    gate = 30.0                               # silu(30) = 30 to 1e-12: the MLP is linear where it is used
    scale = math.sqrt(H / 2)                  # RMSNorm of U[m] (or of any turn of it) multiplies it by this
    with torch.no_grad():
        for p in draft.parameters():
            p.zero_()
        for norm in (m for m in draft.modules() if type(m).__name__ == "RMSNorm"):
            norm.weight.fill_(1.0)
        draft.fc.weight[:, :H] = torch.eye(H)                 # the first aux layer's features: U[phi(x_j)]
        for layer, share in zip(draft.layers, LAYER_SHARES[layers]):
            angle = 2 * math.pi * lead * share / len(CYCLE)
            rot = torch.tensor([[math.cos(angle), -math.sin(angle)], [math.sin(angle), math.cos(angle)]])
            mlp = layer.mlp
            mlp.gate_proj.weight[:2, 2] = gate / scale         # gates on the constant coordinate
            mlp.up_proj.weight[:2, :2] = rot - torch.eye(2)
            mlp.down_proj.weight[:2, :2] = torch.eye(2) / (gate * scale)   # h + (R - I) h = R h
        draft.lm_head.weight.copy_(target_sd["lm_head.weight"][ids])   # the target's rows of the mapped ids
    V = tcfg["vocab_size"]
    d2t = ids - torch.arange(len(ids))
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    args = argparse.Namespace(norm_before_residual=False, ttt_steps=3, model=str(target), export_embed_tokens=True)
    export_speculators(str(out), draft, c, aux, d2t, t2d, args, archs, target_sd["model.embed_tokens.weight"],
                       torch.float32)
    return Path(out)
