"""Each step's packed rows on the training device, read ahead: loader threads write the rows straight from the
sample files' pages into a small ring of host buffers (page-locked on a GPU), and each batch is copied to the
GPU on a side stream while the step before it computes.

Why this shape: a step of a 1 B target's features is ~200 MB (16 KB a token at hidden 2048, three aux layers and
the last). torch's DataLoader copied it four times on the host (the file into a worker's tensors, those into a
packed row, the row into shared memory, then into page-locked memory in one pin thread) and topped out at
~115 k tokens/s on an H200 host, below what the GPU trains at; without pinning, the copies to the GPU stalled
the step instead. Here a document reaches its page-locked row in one copy (packing.fill_rows), the buffers are
allocated once, and torch's copies release the GIL, so threads run them side by side.

A batch handed out stays valid until the next one is asked for (on a CPU it is the host buffer itself).
"""
from __future__ import annotations

import os
import threading
import time

import torch

from kimi_eagle_host.data import packing

MAX_RING_BYTES = 8 << 30   # page-locked host memory per rank for the ring (Kimi-K2.5: ~57 KB a token of a step)


def default_workers(device: torch.device) -> int:
    """Loader threads per rank: none on a CPU (the step itself is the bottleneck), on a GPU up to 4 of this
    rank's share of the cores."""
    if device.type != "cuda":
        return 0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(4, cores // max(1, local_ranks) - 1))


class StepBatches:
    """The batches of steps first .. last-1 of one rank, in order, on `device`. Iterate it; close() (or leave
    the `with`) stops the threads. An error while reading a sample is raised by the next() that needs it.
    `files`: the sample files by document index, or an online source whose for_step(step) gives them."""

    def __init__(self, data_plan: packing.Plan, first: int, last: int, rank: int, world: int, files: list[str],
                 pack_len: int, aux_dim: int, hidden: int, feat_dtype, device: torch.device, workers: int,
                 tops=None):
        self.plan, self.rank, self.world, self.files, self.tops = data_plan, rank, world, files, tops
        self.device, self.cuda = device, device.type == "cuda"
        self.next_step, self.last = first, last
        rows = len(data_plan.rank_rows(first, rank, world)) if first < last else 0
        slot_bytes = rows * pack_len * ((aux_dim + hidden) * torch.finfo(feat_dtype).bits // 8 + 8 * 4)
        # Buffers: one per thread filling, plus on a GPU one ready ahead and one whose copy may still run, on a
        # CPU the one handed out. Fewer threads when the ring would pass MAX_RING_BYTES, but one stays.
        spare = 2 if self.cuda else 1
        workers = min(workers, max(1, MAX_RING_BYTES // max(slot_bytes, 1) - spare))
        n_slots = workers + spare
        self.slots = [packing.new_slot(rows, pack_len, aux_dim, hidden, feat_dtype, tops is not None, pin=self.cuda)
                      for _ in range(n_slots if first < last else 0)]
        self.free = list(range(len(self.slots)))   # slot indices a filler may take
        self.copied = {}                           # slot -> the CUDA event after which its host buffer is free
        self.ready = {}                            # step -> (slot, tokens) or the exception its filler raised
        self.to_fill = first                       # the next step a filler takes
        self.held = None                           # CPU: the slot handed out last (valid until the next call)
        self.prefetched = None                     # CUDA: (device batch, event) of the next step, copied ahead
        self.closed = False
        self.cond = threading.Condition()
        self.copy_stream = torch.cuda.Stream(device) if self.cuda else None
        self.threads = [threading.Thread(target=self._filler, name=f"step-batches-{i}", daemon=True)
                        for i in range(workers)]
        for t in self.threads:
            t.start()

    # --- producers ------------------------------------------------------------------------------------
    def _claim(self, block: bool):
        """A free slot and the next step to fill into it (the slot first: every claimed step then has a slot,
        so the step the consumer waits for is always being filled). None when there is nothing left to do."""
        with self.cond:
            while not self.closed and self.to_fill < self.last and not self.free:
                if not block:
                    return None
                self.cond.wait()
            if self.closed or self.to_fill >= self.last:
                return None
            slot, step = self.free.pop(0), self.to_fill
            self.to_fill += 1
            event = self.copied.pop(slot, None)
        if event is not None:
            event.synchronize()   # the last copy out of this buffer has finished
        return slot, step

    def _fill(self, slot: int, step: int) -> None:
        try:
            rows = self.plan.rank_rows(step, self.rank, self.world)
            # Online (online_stream.Source): the step's documents, waited for as the engine writes them.
            files = self.files.for_step(step) if hasattr(self.files, "for_step") else self.files
            done = (slot, packing.fill_rows(self.slots[slot], files, rows, self.tops, getattr(files, "done", None)))
        except Exception as e:   # handed to the consumer, raised where it waits for this step
            done = e
        with self.cond:
            self.ready[step] = done
            self.cond.notify_all()

    def _filler(self) -> None:
        while (claim := self._claim(block=True)) is not None:
            self._fill(*claim)

    # --- consumer -------------------------------------------------------------------------------------
    def _take(self, step: int) -> tuple[int, int]:
        """(slot, tokens) of `step`, filled here when no thread does it. The time the consumer is held here is the
        trainer's wait for its data: told to files.trainer_waited where it has one (online: the progress line's
        trainer_wait_s). Not the filler threads' waits: several wait at once, and while the trainer computes (on
        an H100 four of them summed 104 s where the first step, its compile included, took 95 s)."""
        t0 = time.monotonic()
        try:
            return self._take_unmeasured(step)
        finally:
            note = getattr(self.files, "trainer_waited", None)
            if note is not None:
                note(time.monotonic() - t0)

    def _take_unmeasured(self, step: int) -> tuple[int, int]:
        with self.cond:
            while step not in self.ready and self.threads:
                self.cond.wait()
        if not self.threads:   # filled here, in order: a slot is always free (see __init__'s count)
            claim = self._claim(block=False)
            if claim is None or claim[1] != step:
                raise RuntimeError(f"step batches: step {step} has no free buffer ({claim})")
            self._fill(*claim)
        with self.cond:
            done = self.ready.pop(step)
        if isinstance(done, Exception):
            self.close()
            raise done
        return done

    def _release(self, slot: int, event=None) -> None:
        with self.cond:
            if event is not None:
                self.copied[slot] = event
            self.free.append(slot)
            self.cond.notify_all()

    def _to_device(self, step: int):
        """Queue the copy of `step`'s rows on the side stream; (device batch, event)."""
        slot, tokens = self._take(step)
        with torch.cuda.stream(self.copy_stream):
            batch = {k: v.to(self.device, non_blocking=True) for k, v in self.slots[slot].items()}
            event = torch.cuda.Event()
            event.record(self.copy_stream)
        self._release(slot, event)
        batch["tokens"] = tokens
        return batch, event

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        step = self.next_step
        if step >= self.last or self.closed:
            self.close()
            raise StopIteration
        self.next_step += 1
        if not self.cuda:
            if self.held is not None:
                self._release(self.held)
            self.held, tokens = self._take(step)
            return {**self.slots[self.held], "tokens": tokens}
        batch, event = self.prefetched or self._to_device(step)
        self.prefetched = None
        compute = torch.cuda.current_stream(self.device)
        compute.wait_event(event)
        for v in batch.values():
            if torch.is_tensor(v):
                v.record_stream(compute)   # its memory is not reused before the step's kernels have read it
        # The next step's copy starts now if its rows are ready, so it overlaps this step's compute.
        if self.next_step < self.last:
            with self.cond:
                ready = self.next_step in self.ready or not self.threads
            if ready:
                self.prefetched = self._to_device(self.next_step)
        return batch

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.cond.notify_all()
        # Online: a reader ahead may wait for a document the engine will not write now (online_stream.Source).
        abandon = getattr(self.files, "abandon_steps", None)
        if abandon is not None:
            abandon()
        for t in self.threads:
            if t is not threading.current_thread():
                t.join()
        self.threads = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
