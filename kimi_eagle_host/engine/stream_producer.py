"""The engine of an online run (data/online_stream.py): extracts the stream's documents in the order the trainer
takes them into its spool, and waits while the spool's buffer is full.

Started by the trainer as `python -m kimi_eagle_host.engine.stream_producer --spool DIR ...`, never by a person.
Engines: hf (transformers + the forward hooks extract uses, consecutive documents batched) and vllm (vLLM >= 0.18,
native extract_hidden_states with our KV connector, which writes each file in the worker; extract_vllm.py). A
sample file is extract's format and appears complete by rename. A failure is written to <spool>/engine.error (the
trainer raises it) and exits 1. SIGINT (the trainer's stop) ends it; so does the trainer's death (it then removes
the spool itself, since nobody else will); so does the spool's removal by anyone else (one line, exit 1): nothing
here recreates the folder, a document written into a new one would never reach the trainer.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
import time

from kimi_eagle_host.data import online_stream as spool_
from kimi_eagle_host.data.hidden_state_files import taken_path
from kimi_eagle_host.step_runtime import atomic_write_json, atomic_write_via, log

PARENT_POLL_S = 0.5


class Spool:
    """The producer's view of the spool: where each entry goes, and the buffer's room (backpressure)."""

    def __init__(self, path: str, buffer_bytes: int, bytes_per_token: int):
        import numpy as np

        self.path, self.budget, self.per_token = path, buffer_bytes, bytes_per_token
        self.entries = np.load(os.path.join(path, spool_.STREAM)).tolist()   # [kind, step, doc] in order
        self.outstanding = []   # (file, bytes, written) of training documents not yet taken by the trainer
        self.last_batch: list = []   # becomes [True] when the batch last taken is produced (written())
        self.kept_bytes = 0     # held-out and cached documents: they stay in the spool until the run ends
        self.peak_bytes = 0     # the most the spool ever held (the online run's hidden-state footprint)
        self.tokens, self.waited_s, self.t0 = 0, 0.0, time.monotonic()

    def file(self, entry) -> str:
        return os.path.join(self.path, spool_.entry_name(*entry))

    def used(self) -> int:
        # A document still being written (written() False) counts: its file is not there yet, but its bytes are.
        # One written and gone was taken by the trainer: its tombstone goes too.
        keep = []
        for f, b, w in self.outstanding:
            if not w() or os.path.exists(f):
                keep.append((f, b, w))
            else:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(taken_path(f))
        self.outstanding = keep
        return sum(b for _, b, _ in keep)

    def wait_room(self, entries, tokens_of, written=None) -> None:
        """Block while the buffer holds documents and these would pass its budget (never with an empty buffer:
        one batch always goes, however large). tokens_of(entry): its document's tokens; written(): whether the
        batch's files are complete (threads may write them after produced()); by default, once produced() is
        called for the batch."""
        if written is None:
            flag = self.last_batch = []
            written = lambda: bool(flag)   # noqa: E731
        need = [(self.file(e), tokens_of(e) * self.per_token, written) for e in entries if e[0] in spool_.TAKEN]
        t0 = time.monotonic()
        while need and self.used() and self.used() + sum(b for _, b, _ in need) > self.budget:
            time.sleep(0.005)
        self.waited_s += time.monotonic() - t0
        self.outstanding += need
        self.kept_bytes += sum(tokens_of(e) * self.per_token for e in entries if e[0] not in spool_.TAKEN)
        self.peak_bytes = max(self.peak_bytes, self.used() + self.kept_bytes)

    def windows(self, tokens_of):
        """The stream cut into consecutive stretches whose training documents fill at most half the buffer: an
        engine may produce a stretch in any order (longest first, as extract does, so a batch pads little) and
        never deadlock, since the trainer's next document is always in a stretch that fits beside what it has
        not taken yet; the other half lets the next stretch start while the trainer reads this one."""
        window, size = [], 0
        for e in self.entries:
            b = tokens_of(e) * self.per_token if e[0] in spool_.TAKEN else 0
            if window and size + b > self.budget // 2:
                yield window
                window, size = [], 0
            window.append(e)
            size += b
        if window:
            yield window

    def produced(self, tokens: int) -> None:
        self.last_batch.append(True)
        self.tokens += tokens
        atomic_write_json(os.path.join(self.path, spool_.ENGINE_FIGURES),
                          {"tokens": self.tokens, "seconds": round(time.monotonic() - self.t0, 3),
                           "waited_s": round(self.waited_s, 3), "buffer_bytes": self.used(),
                           "spool_peak_bytes": self.peak_bytes}, make_folder=False)


def run_hf(args, spool: Spool, ds, layer_ids) -> None:
    import torch

    from kimi_eagle_host.engine.extract_hf import Writer, extract_batches
    from kimi_eagle_host.target.hf_target import HiddenStateCapture, load_model
    from kimi_eagle_host.target.model_layers import resolve_decoder_stack

    torch_dtype = getattr(torch, args.dtype)
    model = load_model(args.model, torch_dtype, args.device, args.tp_size)
    _, layers, _ = resolve_decoder_stack(model)
    capture = HiddenStateCapture(layers, layer_ids)
    hidden = model.get_input_embeddings().weight.shape[1]

    def tokens_of(e):
        return min(len(ds[e[2]][0]), args.seq_len)

    cap = padded_tokens_cap(args.batch_size, args.seq_len, [tokens_of(e) for e in spool.entries])

    def sample_of(e):
        ids, mask = ds[e[2]]
        return ids[:args.seq_len], mask[:args.seq_len]

    def before(batch):   # room in the buffer for the batch; its bytes count until its files are written and taken
        flag = []
        spool.wait_room(batch, tokens_of, written=lambda: bool(flag))
        return lambda: flag.append(True)

    writer = Writer(spool.file, maxsize=2 * args.batch_size, threads=max(1, args.writers))
    try:
        extract_batches(model, capture, batches(spool, tokens_of, args.batch_size, cap), writer, torch_dtype,
                        sample_of=sample_of, pool_numel=cap * len(layer_ids) * hidden, before=before,
                        after=lambda batch, tokens: spool.produced(tokens))
    finally:
        capture.remove()
        writer.close()


def padded_tokens_cap(batch_size: int, seq_len: int, lengths: list[int]) -> int:
    """The most positions one forward pads to: batch_size documents of the stream's mean length (at least one
    whole sequence), so a batch of long documents holds fewer of them and pads little."""
    mean = sum(lengths) / len(lengths) if lengths else seq_len
    return max(seq_len, int(batch_size * mean))


def batches(spool: Spool, tokens_of, batch_size: int, cap: int):
    """The stream's batches: in each stretch of half the buffer (Spool.windows), longest first as extract sorts,
    at most batch_size documents and `cap` padded positions each. The stream's own order mixes lengths (the plan
    shuffles): batches of 64 of it, each padded to its longest, ran at 39-44 k tokens/s on an H200 beside the
    trainer, where extract (sorted) did 162 k alone."""
    for window in spool.windows(tokens_of):
        batch: list = []
        for e in sorted(window, key=lambda e: -tokens_of(e)):
            if batch and (len(batch) == batch_size or (len(batch) + 1) * tokens_of(batch[0]) > cap):
                yield batch
                batch = []
            batch.append(e)
        if batch:
            yield batch


def run_vllm(args, spool: Spool, ds, layer_ids) -> None:
    from kimi_eagle_host.engine import extract_vllm

    spool_.check_engine(args.engine)   # the trainer refused it before starting us; here for a host changed since
    extract_vllm.prepare_environment()
    info = {"dtype": args.dtype}
    extract_vllm.stream_native(args, ds, layer_ids, info, spool)


class Watch(threading.Thread):
    """The trainer gone (SIGKILL, a crash): stop here too, and remove the spool, which nobody else will. The spool
    removed by someone else: stop, saying so; the trainer says it too, and ends. `ending`: either came (a write
    failing now needs no report); `done`: the removal is complete (the process must not exit before)."""

    def __init__(self, parent: int, spool: str):
        super().__init__(daemon=True)
        self.parent, self.spool = parent, spool
        self.ending, self.done = threading.Event(), threading.Event()

    def run(self) -> None:
        while os.getppid() == self.parent and os.path.exists(os.path.join(self.spool, spool_.OWNER_LOCK)):
            time.sleep(PARENT_POLL_S)
        self.ending.set()
        if os.getppid() == self.parent:
            log(removed(self.spool))
        else:
            spool_.remove_spool(self.spool)
        self.done.set()
        signal.raise_signal(signal.SIGINT)
        time.sleep(spool_.STOP_GRACE_S)
        os._exit(1)


def removed(spool: str) -> str:
    return f"[engine] its buffer's folder {spool} was removed while the run used it: stopping"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spool", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--prepared-dir", required=True)
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--layer-ids", required=True)
    ap.add_argument("--seq-len", type=int, required=True)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--tp-size", type=int, default=1)
    ap.add_argument("--buffer-bytes", type=int, required=True)
    ap.add_argument("--bytes-per-token", type=int, required=True, help="a document's bytes in the spool per token")
    ap.add_argument("--parent", type=int, required=True)
    ap.add_argument("--beside-trainer", action="store_true",
                    help="the trainer shares this GPU (co-located): a vLLM engine takes only what it needs")
    ap.add_argument("--writers", type=int, default=min(16, os.cpu_count() or 1))   # as extract's
    args = ap.parse_args(argv)
    # The trainer started us with SIGTERM blocked (a stop lets it finish its step, which may need our documents):
    # we end on its SIGINT, or when it is gone.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    watch = Watch(args.parent, args.spool)
    watch.start()
    try:
        from kimi_eagle_host.data.prepared_data import PreparedDataset

        spool = Spool(args.spool, args.buffer_bytes, args.bytes_per_token)
        ds = PreparedDataset(args.prepared_dir)
        layer_ids = [int(x) for x in args.layer_ids.split(",")]
        t0 = time.monotonic()
        (run_hf if args.engine == "hf" else run_vllm)(args, spool, ds, layer_ids)
        log(f"[engine] {len(spool.entries)} documents, {spool.tokens} tokens in {time.monotonic() - t0:.1f}s "
            f"({spool.waited_s:.1f}s waiting for the trainer)")
        return 0
    except KeyboardInterrupt:
        return 1 if watch.ending.is_set() else 130
    except BaseException as e:  # noqa: BLE001 - the trainer reports it; the traceback stays in the log
        if watch.ending.is_set():   # a write failed on the spool moved away: the watch says why, if anyone
            return 1
        if not os.path.isdir(args.spool):   # ...before the watch saw it: that is the one thing to say
            log(removed(args.spool))
            return 1
        import traceback

        traceback.print_exc(file=sys.stderr)
        try:   # complete or absent: the trainer reads it as soon as it exists
            atomic_write_via(os.path.join(args.spool, spool_.ENGINE_ERROR),
                             lambda tmp: open(tmp, "w").write(f"{type(e).__name__}: {e}\n"), make_folder=False)
        except OSError:
            pass
        return 1
    finally:
        if watch.ending.is_set():   # its SIGINT is no longer needed; its removal of the spool must end first
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            watch.done.wait(spool_.STOP_GRACE_S)


if __name__ == "__main__":
    sys.exit(main())
