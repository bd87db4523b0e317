"""The bytes an online run (data/online_stream.py) keeps in its spool folder (`online_spool_dir`), in one place: the
trainer checks them against the folder's free space before its engine starts, and a planner can give the same
function estimates (the held-out share of the data's tokens and samples) instead of a run's documents. Stdlib only,
no imports: preflight's storage plan may use it.

A document's file in the spool is extract's sample format: per position (the document's tokens after the seq_len
cut) its hidden states of every captured layer, an int64 token id and an int64 loss-mask entry; per file a
safetensors header.
"""
from __future__ import annotations

ID_AND_MASK_BYTES = 16    # int64 token id + int64 loss-mask entry, per position
FILE_HEADER_BYTES = 256   # the safetensors header of a sample's three tensors (~230 B), rounded up


def token_bytes(n_layers: int, hidden: int, itemsize: int) -> int:
    """One position of a document's file: n_layers x hidden hidden-state values of itemsize bytes, id and mask."""
    return n_layers * hidden * itemsize + ID_AND_MASK_BYTES


def document_bytes(length: int, n_layers: int, hidden: int, itemsize: int) -> int:
    """A document's file: its T = length + 1 positions (length: after the EAGLE shift) and the header."""
    return (length + 1) * token_bytes(n_layers, hidden, itemsize) + FILE_HEADER_BYTES


def held_count(samples: int, fraction: float, cap: int | None) -> int:
    """How many of `samples` documents are held out (`steps.train.holdout_fraction` of them, at most
    `steps.train.holdout_max_samples` = cap; None: no cap): the trainer's split (training/data_plan.split_holdout)
    and the planner count the same. Online keeps every held-out document in the spool for the whole run, so a
    fraction alone would grow it with the data."""
    k = int(samples * fraction)
    return k if cap is None else min(k, cap)


def host_engines(ranks: int, tp_size: int, online_engines: int | None, split: bool, cuda: bool) -> int:
    """How many engines a host's `ranks` trainer ranks start online: `online_engines` when set; else one per
    tp_size ranks on CUDA (a target that fits one GPU gets an engine beside each GPU's rank), one on a CPU, in the
    split layout (`engine_gpus`) or where tp_size does not divide the ranks. The trainer (online_stream.
    ranks_per_engine, which also refuses bad values) and the planner count them here."""
    if online_engines is not None:
        return online_engines
    if not cuda or split or ranks % tp_size:
        return 1
    return ranks // min(tp_size, ranks)


def buffer_bytes(buffer_gb: float, engines: int, engine_batch: int, longest_document: int, data_bytes: float) -> int:
    """The most a host's buffer holds: each of its `engines` waits while its share of `online_buffer_gb` is full,
    but one engine batch (`engine_batch` documents of `longest_document` bytes, document_bytes) always goes into an
    empty one, so a share is never less than that; never more than the data (`data_bytes`). One floor for the
    trainer's check before its engine starts and for preflight's plan (which knows seq_len, not the longest
    document), so both say the same of a folder."""
    share = max(buffer_gb * 1e9 / max(1, engines), engine_batch * longest_document)
    return int(min(data_bytes, max(1, engines) * share))


def spool_bytes(held_positions: int, held_documents: int, per_position: int, cache_bytes: float,
                buffer_bytes: float) -> dict:
    """What an online run keeps in its spool folder at most, by part, in bytes:
      held    the held-out documents (held_count): extracted first and kept for the whole run
              (its evaluations read them again), outside the buffer's budget; held_positions = their positions
              (tokens after the seq_len cut), held_documents = how many, per_position = token_bytes(...);
      cache   documents kept for later epochs in the spool (`online_cache_gb`), where several trainer processes
              share an engine; 0 where each keeps its own in its memory (one trainer process per engine);
      buffer  the training documents not yet taken (buffer_bytes: `online_buffer_gb`, or one engine batch where
              that is more: a batch always goes into an empty buffer);
      total   their sum: what the folder's free space must hold.
    Held-out and cache grow with the data; only the buffer is bounded whatever the data's size."""
    parts = {"held": int(held_positions * per_position + held_documents * FILE_HEADER_BYTES),
             "cache": int(cache_bytes), "buffer": int(buffer_bytes)}
    return {**parts, "total": sum(parts.values())}
