"""Greedy speculative decoding with an EAGLE-3 draft in plain transformers: the `eval` step's engine when
the host has no vLLM that can serve the target's EAGLE-3.

Same definition as vLLM's counters: per round the draft proposes k tokens, the target scores them in one
forward pass, the longest prefix equal to the target's greedy choices is accepted, and the target's own
next token is appended; acceptance length = 1 + accepted / drafts.

The draft runs exactly as it was trained (draft_model.Eagle3Draft's forward, unrolled one position at a
time): step 0 reads the target's fused aux features of position j with the token at j+1 and keeps its
keys/values (they never change once the target accepted those tokens); step s >= 1 reads its own step s-1
output with its own step s-1 token, seeing the step-0 keys and its own chain only.
"""
import json
import os

import torch
import torch.nn.functional as F

from kimi_eagle_host.draft.draft_model import Eagle3Draft
from kimi_eagle_host.target.hf_target import HiddenStateCapture, load_model
from kimi_eagle_host.target.model_layers import resolve_decoder_stack


def load_draft(export_dir, target_embed, device):
    """Our Eagle3Draft from a speculators Eagle3 export (config.json + model.safetensors); fp32 on CPU."""
    from safetensors.torch import load_file

    with open(os.path.join(export_dir, "config.json")) as f:
        cfg = json.load(f)
    tl = cfg["transformer_layer_config"]
    rope = tl.get("rope_parameters") or {}
    c = {"hidden_size": tl["hidden_size"], "num_attention_heads": tl["num_attention_heads"],
         "num_key_value_heads": tl.get("num_key_value_heads") or tl["num_attention_heads"],
         "head_dim": tl.get("head_dim") or tl["hidden_size"] // tl["num_attention_heads"],
         "intermediate_size": tl["intermediate_size"], "rms_norm_eps": tl.get("rms_norm_eps", 1e-6),
         "num_hidden_layers": int(tl.get("num_hidden_layers") or 1),
         "rope_theta": float(rope.get("rope_theta") or tl.get("rope_theta") or 10000.0)}
    aux = [int(i) for i in cfg["eagle_aux_hidden_state_layer_ids"]]
    sd = load_file(os.path.join(export_dir, "model.safetensors"))
    K = int(cfg["draft_vocab_size"])
    model = Eagle3Draft(c, len(aux), K, bool(cfg.get("norm_before_residual", False)))
    # A draft over the target's whole vocabulary is exported without d2t (vLLM keeps none): the identity map.
    d2t = sd.pop("d2t", torch.zeros(K, dtype=torch.long)).long()
    sd.pop("t2d", None)
    embed = sd.pop("embed_tokens.weight", None)
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in sd.items()}, strict=False)
    missing = [m for m in missing if not m.endswith("inv_freq")]
    if missing or unexpected:
        raise RuntimeError(f"{export_dir}: draft tensors do not fit: missing {missing}, unexpected {unexpected}")
    embed = (embed if embed is not None else target_embed).float()
    return model.to(device).eval(), aux, (d2t + torch.arange(K)).to(device), embed.to(device)


class DraftProposer:
    """Incremental draft state for one sequence (batch 1)."""

    def __init__(self, draft, draft_to_target, embed):
        self.m, self.map, self.embed = draft, draft_to_target, embed
        self.k0 = self.v0 = None     # per draft layer: step-0 keys/values of every processed position
        self.n = 0                   # positions processed by step 0

    def _layers(self, ids, hidden, positions, mask, kv):
        return self.m.incremental(F.embedding(ids, self.embed), hidden, positions, mask, kv)

    @torch.no_grad()
    def propose(self, feats, next_ids, k):
        """feats [m, L*H]: target aux features of the m positions the target just accepted; next_ids [m]: the
        token after each of them (the last is the target's newest token). Returns k target token ids."""
        m = feats.shape[0]
        dev = feats.device
        pos = torch.arange(self.n + 1, self.n + 1 + m, device=dev)[None]
        n_layers = len(self.m.layers)
        kv = [[] if self.k0 is None else [(self.k0[i], self.v0[i])] for i in range(n_layers)]
        causal = torch.ones(m, self.n + m, dtype=torch.bool, device=dev)
        causal[:, self.n:] = torch.tril(torch.ones(m, m, dtype=torch.bool, device=dev))
        h = self._layers(next_ids[None], self.m.fc(feats[None]), pos, causal[None, None], kv)
        new = [layer_kv[-1] for layer_kv in kv]
        if self.k0 is None:
            self.k0, self.v0 = [kk for kk, _ in new], [vv for _, vv in new]
        else:
            self.k0 = [torch.cat([old, kk], dim=2) for old, (kk, _) in zip(self.k0, new)]
            self.v0 = [torch.cat([old, vv], dim=2) for old, (_, vv) in zip(self.v0, new)]
        self.n += m
        h = h[:, -1:]
        out = []
        kv = [[(k0, v0)] for k0, v0 in zip(self.k0, self.v0)]
        last_pos = pos[:, -1:]
        for s in range(k):
            tok = self.map[self.m.lm_head(self.m.norm(h)).argmax(-1)]        # [1,1] target ids
            out.append(int(tok))
            if s + 1 < k:
                h = self._layers(tok, h, last_pos + s + 1, None, kv)
        return out


class HFEngine:
    def __init__(self, model_dir, draft_dir, device, dtype):
        self.device = torch.device(device)
        self.target = load_model(model_dir, getattr(torch, dtype), device, 1)
        self.layers = resolve_decoder_stack(self.target)[1]
        self.draft = None
        if draft_dir:
            emb = self.target.get_input_embeddings().weight.detach()
            self.draft, self.aux, self.map, self.embed = load_draft(draft_dir, emb, self.device)

    def _forward(self, ids, cache, capture):
        """Target logits [T, V] of the new ids and (with capture) their aux features [T, L*H]."""
        if capture is None:
            out = self.target(input_ids=ids[None], past_key_values=cache, use_cache=True)
            return out.logits[0], out.past_key_values, None
        capture.captured = {}
        out = self.target(input_ids=ids[None], past_key_values=cache, use_cache=True)
        feats = torch.cat([capture.captured[i][0] for i in self.aux], dim=-1).float()
        return out.logits[0], out.past_key_values, feats

    @torch.no_grad()
    def generate(self, prompt_ids, max_tokens, eos_ids, k=0):
        """Greedy generation; with k > 0 speculative with the draft. Returns (tokens, stats)."""
        ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
        capture = HiddenStateCapture(self.layers, self.aux, early_stop=False) if k else None
        try:
            logits, cache, feats = self._forward(ids, None, capture)
            out = [int(logits[-1].argmax())]
            stats = {"drafts": 0, "accepted": 0, "per_pos": [0] * k}
            if not k:
                while len(out) < max_tokens and out[-1] not in eos_ids:
                    logits, cache, _ = self._forward(torch.tensor(out[-1:], device=self.device), cache, None)
                    out.append(int(logits[-1].argmax()))
                return out, stats
            prop = DraftProposer(self.draft, self.map, self.embed)
            new_ids = torch.cat([ids[1:], torch.tensor(out, device=self.device)])
            while len(out) < max_tokens and out[-1] not in eos_ids:
                d = prop.propose(feats, new_ids, k)
                logits, cache, feats_all = self._forward(torch.tensor(out[-1:] + d, device=self.device), cache,
                                                         capture)
                pred = logits.argmax(-1).tolist()
                a = 0
                while a < k and d[a] == pred[a]:
                    a += 1
                stats["drafts"] += 1
                stats["accepted"] += a
                for i in range(a):
                    stats["per_pos"][i] += 1
                emitted = d[:a] + [pred[a]]
                drop = k - a                # keep the last token and the accepted drafts
                if drop:
                    cache.crop(-drop)       # negative: drop from the end (positive crop is deprecated)
                feats = feats_all[: a + 1]
                new_ids = torch.tensor(emitted, device=self.device)
                for t in emitted:
                    out.append(t)
                    if t in eos_ids or len(out) >= max_tokens:
                        break
            return out, stats
        finally:
            if capture is not None:
                capture.remove()
