"""The hidden-state sample files, one place for everyone who writes or reads them (extract's hf engine, the vLLM
connector, the trainer):

  <output-dir>/hidden_states/hs_{i}.safetensors   token_ids int64 [T], hidden_states [T, L, H] (dtype of the
                                                  run), loss_mask int64 [T]; i = index in the prepared dataset,
                                                  L = len(layer ids)
  <output-dir>/hidden_states/data_config.json     model, layer ids + convention, num layers, hidden size, dtype,
                                                  engine, versions (extract writes it; FORMAT names the layout)
  <output-dir>/hidden_states/manifest*.json       which samples belong to the extraction (hs_manifest.py): readers
                                                  take that list, never a listing of the folder

Every sample is written to tmp_path(...) and os.replace()d, so a file that exists is complete; a failed write
in a vLLM worker leaves error_path(...) with the reason instead.
"""
import os
import re

from kimi_eagle_host.step_runtime import BadInput

FORMAT = "kimi-eagle-hidden-states/1"
LAYOUT = "hs_{i}.safetensors: token_ids int64 [T], hidden_states [T, L, H], loss_mask int64 [T]"
TENSORS = ("token_ids", "hidden_states", "loss_mask")
# data_config fields that must agree before extract resumes into an existing directory: the target (its folder
# and its weights), the layers, and the code's sample format (samples written by another format are never
# counted as done)
COMPAT_KEYS = ("model", "weights_fingerprint", "layer_ids", "num_layers", "hidden_size", "dtype", "layer_convention",
               "format", "layout")
SAMPLE_RE = re.compile(r"^hs_(\d+)\.safetensors$")
TMP_RE = re.compile(r"^\.hs_(\d+)\.safetensors\.tmp-\d+$")


def sample_path(out_dir, i):
    return os.path.join(out_dir, f"hs_{i}.safetensors")


def tmp_path(path):
    """Where a sample is written before its rename: hidden, and unique to this process."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.tmp-{os.getpid()}")


def taken_path(path):
    """An online run's tombstone of a document the trainer took (read and deleted): an engine that waits for the
    file to appear (vLLM's connector writes it in a worker) must not miss one written and taken between two looks."""
    return path + ".taken"


def error_path(path):
    folder, name = os.path.split(path)
    return os.path.join(folder, "." + name.replace(".safetensors", ".error"))


def check_sample_headers(files, num_ids: int, hidden: int) -> list[int]:
    """Validate shapes from the safetensors headers (no data read); return each sample's token count after the
    EAGLE shift (tokens - 1: what a trainer sees of it)."""
    from safetensors import safe_open

    lengths = []
    for p in files:
        with safe_open(p, "pt") as f:
            keys = set(f.keys())
            for need in TENSORS:
                if need not in keys:
                    raise BadInput(f"{p}: missing tensor '{need}'")
            hs = f.get_slice("hidden_states").get_shape()
            T = f.get_slice("token_ids").get_shape()
            lm = f.get_slice("loss_mask").get_shape()
        if len(hs) != 3 or hs[1] != num_ids or hs[2] != hidden or len(T) != 1 or hs[0] != T[0] or lm != T:
            raise BadInput(f"{p}: hidden_states {hs} / token_ids {T} / loss_mask {lm} do not match "
                             f"[T, {num_ids}, {hidden}] / [T] / [T]")
        if T[0] < 2:
            raise BadInput(f"{p}: token_ids: need at least 2 tokens, got {T[0]}")
        lengths.append(T[0] - 1)
    return lengths


def check_sample(path, token_ids, loss_mask, num_layer_ids, hidden_size, full=False):
    """Return None if the file is a valid sample for these token ids, else a short reason.

    Cheap mode (resume): header + token ids + shape. Full mode (--validate): also loss mask, finiteness and no
    vector left all zeros (never captured).
    """
    import numpy as np
    import torch
    from safetensors import safe_open

    if not os.path.exists(path):
        return "missing"
    try:
        with safe_open(path, framework="pt") as f:
            keys = set(f.keys())
            if keys != set(TENSORS):
                return f"unexpected tensors {sorted(keys)}"
            t = len(token_ids)
            shape = list(f.get_slice("hidden_states").get_shape())
            if shape != [t, num_layer_ids, hidden_size]:
                return f"hidden_states shape {shape}, expected {[t, num_layer_ids, hidden_size]}"
            got = f.get_tensor("token_ids").numpy()
            if got.shape != (t,) or not np.array_equal(got, token_ids):
                return "token_ids do not match the prepared sample"
            if not full:
                return None
            mask = f.get_tensor("loss_mask").numpy()
            if mask.shape != (t,) or not np.array_equal(mask.astype(np.int64), loss_mask.astype(np.int64)):
                return "loss_mask does not match the prepared sample"
            hs = f.get_tensor("hidden_states")
            if not bool(torch.isfinite(hs.float()).all()):
                return "hidden_states contain NaN/Inf"
            # A real residual stream is never exactly zero over a whole vector; a capture that skipped positions
            # (a prefix-cache hit, a connector that saw only part of the prompt) leaves its buffer's zeros there.
            zero = (hs == 0).all(dim=-1)
            if bool(zero.any()):
                slots = sorted(set(zero.nonzero()[:, 1].tolist()))
                return (f"hidden_states: {int(zero.any(dim=1).sum())} of {t} positions are all zeros at layer "
                        f"slot(s) {slots} (never captured)")
    except Exception as e:  # truncated / corrupt file
        return f"unreadable ({type(e).__name__}: {e})"
    return None



_ST_DTYPES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32", "torch.int64": "I64",
              "torch.int32": "I32", "torch.uint8": "U8", "torch.bool": "BOOL"}


def write_safetensors(path, tensors):
    """Write a .safetensors file straight from the tensors' memory.

    safetensors' own save_file first copies every tensor into a Python bytes object; here the kernel copies
    once, from (pinned) host memory into the file, and the GIL is released during the write, so several
    writer threads really run in parallel. The layout is the format's: 8-byte header length, JSON header
    padded to 8 bytes, then the tensors' bytes back to back.
    """
    import json as _json

    header, views, offset = {}, [], 0
    for name, t in tensors.items():
        t = t.contiguous()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _ST_DTYPES[str(t.dtype)], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        # A byte view of the same memory (numpy has no bfloat16; raw bytes need none).
        views.append(t.view(-1).view(dtype=__import__("torch").uint8).numpy() if nbytes else b"")
        offset += nbytes
    raw = _json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for v in views:
            f.write(memoryview(v))


def clean_stale_tmp(out_dir, lo, hi):
    """Remove temp files a killed run of *this* range left behind (other ranks may be writing theirs)."""
    for name in os.listdir(out_dir):
        m = TMP_RE.match(name)
        if m and lo <= int(m.group(1)) < hi:
            os.unlink(os.path.join(out_dir, name))
