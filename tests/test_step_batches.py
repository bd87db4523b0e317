"""The trainer's batches (data/step_batches.py + packing.fill_rows) on real safetensors sample files:

- the files are read through a private mapping that gives every tensor exactly as safetensors itself does
  (bf16, fp32, int64, bool); a truncated or foreign file is one error naming it;
- every step's batch equals the packed rows built independently from the files (documents after the EAGLE
  shift, padding zeros / doc -1 / position 1), with 0, 1 and 3 loader threads, in step order; buffers reused
  from a longer step carry nothing over; ranks' rows add up to the step;
- a sample that fails to read is raised by the step that needs it, and the threads are gone afterwards; a
  loader closed half-way leaves no thread behind;
- the trainer's wait it reports (online's trainer_wait_s) is the consumer's own, not its threads' waits summed.
"""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kimi_eagle_host.data import packing
from kimi_eagle_host.data.step_batches import StepBatches

H, L = 16, 4     # hidden size; three aux layers and the last
CPU = torch.device("cpu")


def write_docs(folder: Path, lengths, dtype=torch.float32, seed=0) -> list[str]:
    folder.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    files = []
    for i, T in enumerate(lengths):
        p = folder / f"hs_{i}.safetensors"
        save_file({"token_ids": torch.randint(0, 1000, (T,), generator=g),
                   "hidden_states": torch.randn(T, L, H, generator=g).to(dtype),
                   "loss_mask": (torch.rand(T, generator=g) > 0.3).long()}, str(p))
        files.append(str(p))
    return files


def expected_rows(files, rows, pack_len, dtype=torch.float32) -> dict:
    """The packed rows as the trainer must see them, built from safetensors' own reader."""
    R = len(rows)
    want = {"aux": torch.zeros(R, pack_len, (L - 1) * H, dtype=dtype), "last": torch.zeros(R, pack_len, H, dtype=dtype),
            "ids": torch.zeros(R, pack_len, dtype=torch.long), "loss_mask": torch.zeros(R, pack_len, dtype=torch.bool),
            "doc_ids": torch.full((R, pack_len), -1), "positions": torch.ones(R, pack_len, dtype=torch.long)}
    tokens = 0
    for r, docs in enumerate(rows):
        at = 0
        for d in docs:
            s = load_file(files[d])
            n = min(s["token_ids"].shape[0] - 1, pack_len - at)
            want["aux"][r, at:at + n] = s["hidden_states"][:n, :-1].reshape(n, -1).to(dtype)
            want["last"][r, at:at + n] = s["hidden_states"][1:n + 1, -1].to(dtype)
            want["ids"][r, at:at + n] = s["token_ids"][1:n + 1]
            want["loss_mask"][r, at:at + n] = s["loss_mask"][1:n + 1] != 0
            want["doc_ids"][r, at:at + n] = d
            want["positions"][r, at:at + n] = torch.arange(1, n + 1)
            at += n
        tokens += at
    want["tokens"] = tokens
    return want


def assert_batch(got: dict, want: dict):
    assert set(got) == set(want)
    assert got["tokens"] == want["tokens"]
    for k, v in want.items():
        if torch.is_tensor(v):
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), k


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_mapped_sample_equals_safetensors(tmp_path, dtype):
    [f] = write_docs(tmp_path, [37], dtype)
    save_file({"flag": torch.tensor([True, False, True]), "empty": torch.zeros(0, 4)}, str(tmp_path / "other.st"))
    mine, theirs = packing.map_sample(f), load_file(f)
    assert set(mine) == set(theirs)
    for k in theirs:
        assert mine[k].dtype == theirs[k].dtype and torch.equal(mine[k], theirs[k]), k
    other = packing.map_sample(str(tmp_path / "other.st"))
    assert other["flag"].tolist() == [True, False, True] and other["empty"].shape == (0, 4)


def test_truncated_or_foreign_file_is_one_error_naming_it(tmp_path):
    [f] = write_docs(tmp_path, [40])
    data = Path(f).read_bytes()
    Path(f).write_bytes(data[:-100])
    with pytest.raises(ValueError, match=rf"{f}: truncated"):
        packing.map_sample(f)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header....")
    with pytest.raises(ValueError, match=rf"{junk}: unreadable safetensors header"):
        packing.map_sample(str(junk))


@pytest.mark.parametrize("workers", [0, 1, 3])
def test_every_step_equals_the_rows_built_from_the_files(tmp_path, workers):
    # Lengths from 3 to 60 tokens: rows of 64, documents cut at the row's end, rows short of full, and steps
    # whose rows are shorter than the step before (a reused buffer must not show the old step's tail).
    lengths = [61, 3, 17, 40, 9, 25, 33, 5, 58, 12, 44, 21, 7, 30]
    files = write_docs(tmp_path, lengths)
    shifted = [n - 1 for n in lengths]
    plan = packing.Plan(packing.pack_rows(shifted, 64, seed=3), 2, seed=3)
    steps = 3 * plan.steps_per_epoch                 # epochs after the first reorder the rows
    got = []
    with StepBatches(plan, 1, steps, 0, 1, files, 64, (L - 1) * H, H, torch.float32, CPU, workers) as batches:
        for step, batch in zip(range(1, steps), batches):
            assert_batch(batch, expected_rows(files, plan.rank_rows(step, 0, 1), 64))
            got.append(step)
        assert next(batches, None) is None
    assert got == list(range(1, steps))


def test_ranks_rows_add_up_to_the_step_and_bf16_features(tmp_path):
    lengths = [20, 31, 12, 9, 27, 16, 22, 8]
    files = write_docs(tmp_path, lengths, torch.bfloat16)
    plan = packing.Plan(packing.pack_rows([n - 1 for n in lengths], 32, seed=0), 3, seed=0)
    for rank in (0, 1):
        with StepBatches(plan, 0, plan.steps_per_epoch, rank, 2, files, 32, (L - 1) * H, H, torch.bfloat16, CPU,
                         2) as batches:
            for step, batch in enumerate(batches):
                rows = plan.rank_rows(step, rank, 2)
                assert len(rows) == 2                      # 3 rows over 2 ranks: each gets 2, one of them padding
                assert_batch(batch, expected_rows(files, rows, 32, torch.bfloat16))


def loader_threads():
    return [t for t in threading.enumerate() if t.name.startswith("step-batches-")]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sample_that_fails_is_raised_where_its_step_is_needed(tmp_path, workers):
    lengths = [30] * 12
    files = write_docs(tmp_path, lengths)
    plan = packing.Plan(packing.pack_rows([n - 1 for n in lengths], 32, seed=0), 2, seed=0)
    bad_step = 3
    bad = plan.rank_rows(bad_step, 0, 1)[0][0]
    Path(files[bad]).write_bytes(Path(files[bad]).read_bytes()[:-100])
    batches = StepBatches(plan, 0, plan.steps_per_epoch, 0, 1, files, 32, (L - 1) * H, H, torch.float32, CPU,
                          workers)
    for _ in range(bad_step):
        next(batches)
    with pytest.raises(ValueError, match=rf"hs_{bad}\.safetensors: truncated"):
        next(batches)
    assert loader_threads() == []


def test_closed_half_way_leaves_no_thread(tmp_path):
    lengths = [30] * 20
    files = write_docs(tmp_path, lengths)
    plan = packing.Plan(packing.pack_rows([n - 1 for n in lengths], 32, seed=0), 2, seed=0)
    with StepBatches(plan, 0, 10 * plan.steps_per_epoch, 0, 1, files, 32, (L - 1) * H, H, torch.float32, CPU,
                     3) as batches:
        next(batches)
        assert len(loader_threads()) == 3
    assert loader_threads() == []


def test_a_ring_over_its_memory_cap_keeps_one_thread(tmp_path, monkeypatch):
    from kimi_eagle_host.data import step_batches

    lengths = [25, 14, 30, 9, 22, 17]
    files = write_docs(tmp_path, lengths)
    plan = packing.Plan(packing.pack_rows([n - 1 for n in lengths], 32, seed=1), 2, seed=1)
    monkeypatch.setattr(step_batches, "MAX_RING_BYTES", 1)
    with StepBatches(plan, 0, 2 * plan.steps_per_epoch, 0, 1, files, 32, (L - 1) * H, H, torch.float32, CPU,
                     4) as batches:
        assert len(batches.threads) == 1 and len(batches.slots) == 2
        for step, batch in enumerate(batches):
            assert_batch(batch, expected_rows(files, plan.rank_rows(step, 0, 1), 32))


class Arriving(list):
    """Sample files that appear `after` seconds from now, as an online engine's do once it has started; what the
    loader tells it of the trainer's waits is kept in `waited`."""

    def __init__(self, files, after: float):
        super().__init__(files)
        self.at, self.waited = time.monotonic() + after, []

    def for_step(self, step):
        return self

    def __getitem__(self, d):
        time.sleep(max(0.0, self.at - time.monotonic()))
        return list.__getitem__(self, d)

    def trainer_waited(self, seconds: float):
        self.waited.append(seconds)


def test_the_trainers_wait_is_its_own_not_its_readers_summed(tmp_path):
    """trainer_wait_s (online's "who waits for whom") is the time the trainer's loop is held for its rows. The
    filler threads' waits are not it: three of them wait at once for an engine still starting (on an H100 four
    summed 104 s where the first step, its compile included, took 95 s), and go on waiting while the trainer
    computes."""
    lengths = [30] * 24
    files = Arriving(write_docs(tmp_path, lengths), after=1.0)
    plan = packing.Plan(packing.pack_rows([n - 1 for n in lengths], 32, seed=0), 2, seed=0)
    t0 = time.monotonic()
    with StepBatches(plan, 0, plan.steps_per_epoch, 0, 1, files, 32, (L - 1) * H, H, torch.float32, CPU,
                     3) as batches:
        for _ in batches:
            time.sleep(0.1)   # the step's compute: the readers fill the next steps meanwhile
    wall = time.monotonic() - t0
    assert len(files.waited) == plan.steps_per_epoch
    assert 0.9 <= files.waited[0] <= 1.5          # the first step: the engine's start-up
    assert sum(files.waited) < 1.5 < wall        # the later steps were ready when asked for
