"""The prepared dataset, as the prepare step writes it and extract (and the benchmarks) read it:

  <output-dir>/prepared/shard_00000.safetensors  input_ids int64 [sum T], loss_mask uint8 [sum T],
                                                 offsets int64 [n+1], source_line int64 [n]
  <output-dir>/prepared/manifest.json            format, count, shards, ... (written last)

Sample index i (extract's hs_{i}.safetensors) is the position in this dataset.
"""
import hashlib
import json
import os

from kimi_eagle_host.step_runtime import BadInput, atomic_write

FORMAT = "kimi-eagle-prepared/1"
KEY_BYTES = 16                              # a prompt key (prompt_key): a sha256 cut short
PROMPT_KEYS_FILE = "training_prompts.keys"  # a draft's training prompts, beside its export (write_prompt_keys)


def manifest_digest(prepared_dir):
    """sha256 of <prepared_dir>/manifest.json (the identity extract records), None where there is none."""
    path = os.path.join(prepared_dir, "manifest.json")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


class PreparedDataset:
    """Random access to prepared samples: ds[i] -> (input_ids int64 ndarray, loss_mask uint8 ndarray)."""

    def __init__(self, prepared_dir):
        path = os.path.join(prepared_dir, "manifest.json")
        if not os.path.isfile(path):
            raise BadInput(f"{path}: not found (run the prepare step first)")
        with open(path, "rb") as f:
            raw = f.read()
        # The data's identity: the manifest names every shard with its sha256 (prepare writes it last).
        self.digest = hashlib.sha256(raw).hexdigest()
        self.manifest = json.loads(raw)
        if self.manifest.get("format") != FORMAT:
            raise BadInput(f"{path}: field 'format' is {self.manifest.get('format')!r}, expected {FORMAT!r}")
        from safetensors.numpy import load_file

        self.ids, self.masks, self.lines = [], [], []
        for shard in self.manifest["shards"]:
            t = load_file(os.path.join(prepared_dir, shard["file"]))
            off = t["offsets"]
            for j in range(len(off) - 1):
                self.ids.append(t["input_ids"][off[j]:off[j + 1]])
                self.masks.append(t["loss_mask"][off[j]:off[j + 1]])
            self.lines.extend(int(x) for x in t["source_line"])
        if len(self.ids) != self.manifest["count"]:
            raise BadInput(f"{path}: field 'count' is {self.manifest['count']} but the shards hold {len(self.ids)} samples")

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return self.ids[i], self.masks[i]


def prompt_keys(prepared_dir) -> list:
    """Each sample's prompt as the choose step serves it (its token ids up to the first trained token: the system
    turn, the first user turn, the answer's opening), as a short digest; None for a sample with no trained token.
    Reads the masks and only the prompts' ids (a shard's ids are 8 bytes a token, its mask 1)."""
    from safetensors import safe_open

    with open(os.path.join(prepared_dir, "manifest.json")) as f:
        shards = json.load(f)["shards"]
    keys = []
    for shard in shards:
        with safe_open(os.path.join(prepared_dir, shard["file"]), framework="numpy") as t:
            mask, off, ids = t.get_tensor("loss_mask"), t.get_tensor("offsets"), t.get_slice("input_ids")
            for a, b in zip(off[:-1].tolist(), off[1:].tolist()):
                first = int(mask[a:b].argmax()) if mask[a:b].any() else 0
                keys.append(prompt_key(ids[a:a + first]) if first else None)
    return keys


def prompt_key(ids) -> bytes:
    """A prompt's key as prompt_keys gives it: a short digest of its token ids (as int64)."""
    import numpy as np

    return hashlib.sha256(np.asarray(ids, dtype=np.int64).tobytes()).digest()[:KEY_BYTES]


def write_prompt_keys(folder, keys) -> int:
    """The distinct prompt keys of `keys` (prompt_keys; None, a sample without a trained token, left out) as
    folder/PROMPT_KEYS_FILE, sorted, KEY_BYTES each: 16 MB for a million prompts, where prompt_keys reads every
    sample's loss mask (GBs at Kimi scale). Returns how many."""
    distinct = sorted({k for k in keys if k is not None})
    atomic_write(os.path.join(folder, PROMPT_KEYS_FILE), b"".join(distinct))
    return len(distinct)


def read_prompt_keys(folder):
    """The set write_prompt_keys wrote in `folder`; None where there is none (or it is not whole keys)."""
    try:
        with open(os.path.join(folder, PROMPT_KEYS_FILE), "rb") as f:
            data = f.read()
    except OSError:
        return None
    if len(data) % KEY_BYTES:
        return None
    return {data[i:i + KEY_BYTES] for i in range(0, len(data), KEY_BYTES)}


def check_vocab_built_from(vocab_dir, prepared_sha256):
    """Refuse a vocabulary counted from other prepared data than the hidden states were extracted from (either
    side unknown: nothing to compare)."""
    path = os.path.join(vocab_dir, "vocab_info.json")
    if not prepared_sha256 or not os.path.isfile(path):
        return
    try:
        with open(path) as f:
            built_from = json.load(f).get("prepared_sha256")
    except (OSError, ValueError, AttributeError) as e:
        raise BadInput(f"{path}: unreadable ({type(e).__name__}); run vocab again") from None
    if built_from and built_from != prepared_sha256:
        raise BadInput(f"{path}: the vocabulary was counted from other prepared data (sha256 {built_from[:12]}) "
                       f"than the hidden states were extracted from ({prepared_sha256[:12]}); run vocab again")
