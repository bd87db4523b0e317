#!/usr/bin/env python3
"""Pipeline step 3: the draft vocabulary = the K most frequent loss-masked target tokens.

Reads <output-dir>/prepared/token_freq.npy (int64 [target_vocab], written by prepare) and writes
<output-dir>/vocab/:
  d2t.npy  int64 [K]             d2t[i] = target_id(i) - i, draft ids ordered by target id
  t2d.npy  bool  [target_vocab]  t2d[t] = token t is in the draft vocabulary
(the speculators / EAGLE convention: target_id = i + d2t[i]). Ties in frequency go to the smaller token id,
so the result is deterministic. Target vocab size = the model config's vocab_size (text_config aware).

stdout: one JSON summary. Exit 0 ok, 1 failure, 2 bad input (K too large, missing/invalid frequency file).
"""
import os
import sys

from kimi_eagle_host.step_runtime import parse_step_args
from kimi_eagle_host.step_runtime import BadInput, atomic_save_npy, atomic_write_json, log, run_step


def select_draft_vocab(freq, k):
    """Return (d2t int64 [k], t2d bool [len(freq)]) for the top-k tokens by frequency (ties → lower id)."""
    import numpy as np

    freq = np.asarray(freq, dtype=np.int64)
    v = len(freq)
    if not 0 < k <= v:
        raise BadInput(f"--draft-vocab-size {k} must be in 1..{v} (the target vocab size)")
    # lexsort: last key is primary → sort by -freq, then by token id
    order = np.lexsort((np.arange(v), -freq))
    chosen = np.sort(order[:k]).astype(np.int64)
    d2t = chosen - np.arange(k, dtype=np.int64)
    t2d = np.zeros(v, dtype=bool)
    t2d[chosen] = True
    return d2t, t2d


def draft_to_target(d2t):
    import numpy as np

    return np.arange(len(d2t), dtype=np.int64) + np.asarray(d2t, dtype=np.int64)


def load_freq(path):
    import numpy as np

    if not os.path.isfile(path):
        raise BadInput(f"{path}: token frequency file not found (run the prepare step first)")
    try:
        freq = np.load(path, allow_pickle=False)
    except Exception as e:
        raise BadInput(f"{path}: not a readable .npy file ({type(e).__name__}: {e})") from None
    if freq.ndim != 1 or not np.issubdtype(freq.dtype, np.integer) or (freq < 0).any():
        raise BadInput(f"{path}: expected a 1-D array of non-negative integer counts, got {freq.dtype} {freq.shape}")
    return freq.astype(np.int64)


def model_vocab_size(model):
    from kimi_eagle_host.target.target_config import read_target_config, states

    v = read_target_config(model, states("vocab_size"))[0].get("vocab_size")
    if not v:
        raise BadInput(f"{model}: config has no vocab_size (looked in text_config too)")
    return int(v)


def replaces(out_dir, prepared_sha256):
    """One line: what this vocabulary replaces (it is always built whole from the counts)."""
    import json

    path = os.path.join(out_dir, "vocab_info.json")
    if not os.path.isfile(path):
        return f"new vocabulary in {out_dir}"
    try:
        with open(path) as f:
            before = json.load(f).get("prepared_sha256")
    except (OSError, ValueError, AttributeError):
        before = None
    same = before is not None and before == prepared_sha256
    return f"rebuilding {out_dir} from {'the same' if same else 'other'} prepared data"



def run(args):
    import numpy as np

    from kimi_eagle_host.data.prepared_data import manifest_digest

    prepared_dir = os.path.join(args.output_dir, "prepared")
    freq_path = args.token_freq or os.path.join(prepared_dir, "token_freq.npy")
    # The prepared data the counts belong to (train refuses hidden states of other data); unknown for a
    # frequency file given by --token-freq.
    prepared_sha256 = None if args.token_freq else manifest_digest(prepared_dir)
    out_dir = args.out or os.path.join(args.output_dir, "vocab")
    freq = load_freq(freq_path)
    target_vocab = model_vocab_size(args.model) if args.model else len(freq)
    if len(freq) > target_vocab:
        raise BadInput(f"{freq_path}: has {len(freq)} entries but the target vocab size is {target_vocab}")
    freq = np.pad(freq, (0, target_vocab - len(freq)))  # ids the tokenizer never produces count 0
    d2t, t2d = select_draft_vocab(freq, args.draft_vocab_size)

    log(f"[vocab] {replaces(out_dir, prepared_sha256)}")
    os.makedirs(out_dir, exist_ok=True)
    atomic_save_npy(os.path.join(out_dir, "d2t.npy"), d2t)
    atomic_save_npy(os.path.join(out_dir, "t2d.npy"), t2d)
    seen = int((freq > 0).sum())
    total = int(freq.sum())
    covered = int(freq[t2d].sum())
    info = {"draft_vocab_size": int(args.draft_vocab_size), "target_vocab_size": int(target_vocab),
            "token_freq": os.path.abspath(freq_path), "distinct_tokens_seen": seen,
            "loss_tokens": total, "coverage": covered / total if total else None, "prepared_sha256": prepared_sha256}
    atomic_write_json(os.path.join(out_dir, "vocab_info.json"), info)
    if seen < args.draft_vocab_size:
        log(f"[vocab] note: only {seen} distinct tokens were seen; the rest of the draft vocab is filled "
            f"with unseen tokens in id order")
    log(f"[vocab] K={args.draft_vocab_size} of {target_vocab}: covers {info['coverage']:.2%} of trained tokens"
        if total else "[vocab] no trained tokens counted")
    return {"ok": True, "step": "vocab", "out_dir": os.path.abspath(out_dir), **info}


def main(argv=None):
    return run_step("vocab", run, parse_step_args("vocab", argv, __doc__))


if __name__ == "__main__":
    sys.exit(main())
