"""Prompts the target writes itself (the Magpie technique, arXiv 2406.08464): when public data runs out, an aligned
chat model given only its chat template's opening of a user turn completes a plausible user request.

The opening comes from the target tokenizer's own chat template (never a hard-coded marker): a one-message chat
whose user text is a sentinel is rendered, and everything before the sentinel is the opening; the first piece of
text after it is the end-of-turn marker where a written prompt stops (so does any special token, e.g. eos).

Resumable and deterministic: completions are written in batches of `batch` samples, batch b seeded from the seed and
b, each batch a file (atomic) under `<folder>` = regenerated/self_prompts/<key>/ (the key: the target, its
weights, the opening, the sampling settings, the engine and this code). A later run reads the batches already
there and samples only the missing ones, then judges every written prompt in order against the set so far
(curation: repeats and filters; and whether it fits the context): the same files always give the same prompts, so
a stopped run continues without duplicates, and asking for more prompts later continues the same batches.
"""
from __future__ import annotations

import json
import os
import time

from kimi_eagle_host.step_runtime import BadInput, atomic_write, log, progress_line

SENTINEL = "\ue000kimi-eagle user text\ue001"  # private-use characters: no template or tokenizer makes them up
# Batches in a row that add no usable prompt before the writer gives up (a target repeating itself).
PATIENCE = 8


def template_opening(tok, model: str) -> tuple[str, list[str]]:
    """(the chat template's text before a user message, the strings where a written prompt ends)."""
    try:
        text = tok.apply_chat_template([{"role": "user", "content": SENTINEL}], tokenize=False,
                                       add_generation_prompt=False)
    except Exception as e:  # noqa: BLE001
        raise BadInput(f"{model}: the chat template cannot render a user turn ({type(e).__name__}: {e})") from None
    if not isinstance(text, str) or text.count(SENTINEL) != 1:
        raise BadInput(f"{model}: the chat template does not show a user message's text once; the target cannot "
                       "be given the opening of a user turn (self_prompts needs a chat template)")
    opening, after = text.split(SENTINEL)
    if not opening.strip():
        raise BadInput(f"{model}: the chat template puts nothing before a user message: no opening to complete")
    stops = [after.split()[0]] if after.split() else []
    specials = [t for t in getattr(tok, "all_special_tokens", []) or [] if t]
    return opening, list(dict.fromkeys(stops + specials))


def cleaned(text: str, stops: list[str]) -> str:
    """A completion up to its first end-of-turn marker or special token, trimmed."""
    cut = min((i for i in (text.find(s) for s in stops) if i >= 0), default=len(text))
    return text[:cut].strip()


def batch_path(folder: str, b: int) -> str:
    return os.path.join(folder, f"b_{b:08d}.jsonl")


def read_batch(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


class Writer:
    """Writes batches of completions of `opening` until `needed` prompts are accepted."""

    def __init__(self, folder, complete, opening_ids, stops, batch, seed):
        """complete(prompt token ids, n, seed) -> [(text, tokens)]: the engine's sampler (regenerate's)."""
        self.folder, self.complete, self.ids, self.stops = folder, complete, opening_ids, stops
        self.batch, self.seed = batch, seed
        self.stats = {"batches": 0, "batches_written_now": 0, "completions": 0, "tokens_now": 0, "seconds_now": 0.0,
                      "stalled": False}

    def _batch(self, b):
        path = batch_path(self.folder, b)
        if os.path.isfile(path):
            return read_batch(path)
        t0 = time.time()
        out = self.complete(self.ids, self.batch, self.seed * 1_000_003 + b * 7919)
        self.stats["seconds_now"] += time.time() - t0
        self.stats["tokens_now"] += sum(n for _, n in out)
        self.stats["batches_written_now"] += 1
        raw = [{"text": text, "tokens": n} for text, n in out]
        atomic_write(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in raw))
        return raw

    def fill(self, needed: int, accept) -> list[tuple[str, str]]:
        """[(id, prompt)] of up to `needed` accepted prompts; accept(id, text) -> None (kept) or why not."""
        kept, b, idle = [], 0, 0
        while len(kept) < needed and idle < PATIENCE:
            before = len(kept)
            for j, r in enumerate(self._batch(b)):
                cid, text = f"self-{b}-{j}", cleaned(r["text"], self.stops)
                self.stats["completions"] += 1
                if accept(cid, text) is None:
                    kept.append((cid, text))
                    if len(kept) == needed:
                        break
            idle = idle + 1 if len(kept) == before else 0
            b += 1
            self.stats["batches"] = b
            dt = max(self.stats["seconds_now"], 1e-9)
            progress_line("self-prompts", len(kept), needed, tok_s=self.stats["tokens_now"] / dt)
        if len(kept) < needed:
            self.stats["stalled"] = True
            log(f"regenerate: the target wrote no new usable prompt in {PATIENCE} batches in a row: {len(kept)} of "
                f"{needed} self-written prompts")
        return kept
