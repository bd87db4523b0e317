"""The online stream's rules, in-process: what the engine extracts and in which order, what the cache keeps, and which
GPUs the engine and the trainer see (the split layout's plumbing, checkable without a GPU)."""
from __future__ import annotations

import os

import pytest

from kimi_eagle_host import settings
from kimi_eagle_host.data import online_stream, packing
from kimi_eagle_host.step_runtime import BadInput


def plan_of(n_docs: int, rows_per_step: int = 2, seed: int = 0) -> packing.Plan:
    lengths = [10 + (7 * d) % 30 for d in range(n_docs)]
    return packing.Plan(packing.pack_rows(lengths, 40, seed), rows_per_step, seed)


def stream(plan, first, last, held=(), budget=0.0, size=100):
    (kinds, steps, docs), cached = online_stream.stream_entries(plan, first, last, list(held), lambda d: size, budget)
    return list(zip(kinds, steps, docs)), cached


def test_the_stream_is_the_trainers_order_held_out_documents_first():
    plan = plan_of(12)
    entries, cached = stream(plan, 0, 2 * plan.steps_per_epoch, held=[20, 21])
    assert entries[:2] == [(online_stream.HELD, 0, 20), (online_stream.HELD, 0, 21)] and cached == set()
    want = [(online_stream.SPOOLED, s, d) for s in range(2 * plan.steps_per_epoch)
            for row in plan.step_rows(s) for d in row]
    assert entries[2:] == want   # every document of every step, in the order StepBatches packs them
    names = {online_stream.entry_name(*e) for e in entries}
    assert len(names) == len(entries)   # a document of two epochs is two files, never one overwritten


def test_a_resumed_stream_starts_at_the_checkpoints_step():
    plan = plan_of(12)
    whole, _ = stream(plan, 0, 6)
    resumed, _ = stream(plan, 3, 6)
    assert resumed == [e for e in whole if e[1] >= 3]


def test_the_cache_keeps_the_first_documents_that_come_again_within_its_budget():
    plan = plan_of(12)
    steps = 2 * plan.steps_per_epoch
    entries, cached = stream(plan, 0, steps, budget=450, size=100)   # room for 4 documents of 100 bytes
    assert len(cached) == 4
    first_epoch = [d for s in range(plan.steps_per_epoch) for row in plan.step_rows(s) for d in row]
    assert cached == set(first_epoch[:4])
    for d in cached:   # extracted once, as a cache entry, at its first position
        mine = [e for e in entries if e[2] == d]
        assert len(mine) == 1 and mine[0][0] == online_stream.CACHED and mine[0][1] < plan.steps_per_epoch
    assert sum(1 for e in entries if e[0] == online_stream.SPOOLED) == 2 * 12 - 2 * 4
    # kept by the trainer instead: the same documents, at the same positions, as the trainer's own kind
    kept = online_stream.stream_entries(plan, 0, steps, [], lambda d: 100, 450, online_stream.KEPT)
    assert kept[1] == cached
    assert list(zip(*kept[0])) == [(online_stream.KEPT if k == online_stream.CACHED else k, s, d)
                                   for k, s, d in entries]
    # one epoch: nothing comes again, so nothing is kept whatever the budget
    _, cached = stream(plan, 0, plan.steps_per_epoch, budget=1e12)
    assert cached == set()


def test_engine_and_trainer_gpus_are_narrowed_among_the_visible_ones():
    assert online_stream.gpu_env({"CUDA_VISIBLE_DEVICES": "5,7"}, [1], "engine_gpus")["CUDA_VISIBLE_DEVICES"] == "7"
    assert online_stream.gpu_env({}, [0, 2], "train_gpus")["CUDA_VISIBLE_DEVICES"] == "0,2"
    with pytest.raises(BadInput, match=r"engine_gpus \[2\]: only 2 GPU\(s\) visible"):
        online_stream.gpu_env({"CUDA_VISIBLE_DEVICES": "5,7"}, [2], "engine_gpus")


def test_every_reader_of_cuda_visible_devices_takes_the_names_cuda_does():
    """One reading of CUDA_VISIBLE_DEVICES for launch, the engines of a step and the online split: names in order,
    blanks dropped, nothing after a name CUDA stops at ("-1"), none at all for "" or a leading "-1"."""
    from kimi_eagle_host.engine.engine_processes import gpu_names
    from kimi_eagle_host.gpus import cuda_visible_names
    from kimi_eagle_host.pipeline.launch import visible_gpus

    assert cuda_visible_names({}) is None
    assert cuda_visible_names({"CUDA_VISIBLE_DEVICES": " 3, ,1 "}) == ["3", "1"]
    assert cuda_visible_names({"CUDA_VISIBLE_DEVICES": "2,-1,0"}) == ["2"]
    assert cuda_visible_names({"CUDA_VISIBLE_DEVICES": "-1"}) == [] == cuda_visible_names({"CUDA_VISIBLE_DEVICES": ""})
    assert gpu_names({"CUDA_VISIBLE_DEVICES": "2,-1,0"}) == ["2"]
    assert len(visible_gpus({"CUDA_VISIBLE_DEVICES": "2,-1,0"})) == 1 and visible_gpus({"CUDA_VISIBLE_DEVICES": "-1"}) == []
    assert online_stream.gpu_env({"CUDA_VISIBLE_DEVICES": "GPU-a,GPU-b"}, [1], "engine_gpus")["CUDA_VISIBLE_DEVICES"] == "GPU-b"


def test_the_online_settings_are_checked_like_every_setting():
    hs = settings.SETTINGS["hidden_states"]
    assert settings.check(hs, "online") == "online" and hs.default == "offline"
    with pytest.raises(settings.SettingError, match="expected one of offline, online"):
        settings.check(hs, "streaming")
    with pytest.raises(settings.SettingError, match="GPU 0 is listed twice"):
        settings.check(settings.SETTINGS["engine_gpus"], "0,0")
    with pytest.raises(settings.SettingError, match="greater than 0"):
        settings.check(settings.SETTINGS["online_buffer_gb"], 0)
    assert settings.check(settings.SETTINGS["train_gpus"], [0, 1]) == [0, 1]


def test_the_engine_may_produce_a_stretch_longest_first_and_never_deadlocks(tmp_path):
    """The hf engine takes the stream in stretches of at most half the buffer and runs each longest first, in
    batches of at most 3 documents and `cap` padded positions (little padding). Its batches played out against a
    trainer that takes documents strictly in stream order and an engine that waits while the buffer is full (the
    batch before handed to the writers first): every document is produced once, the buffer never passes its
    budget, nobody is left waiting for the other."""
    import numpy as np

    from kimi_eagle_host.engine.stream_producer import Spool, batches, padded_tokens_cap

    plan = plan_of(40)
    entries, _ = stream(plan, 0, 3 * plan.steps_per_epoch, held=[0, 1])
    np.save(tmp_path / online_stream.STREAM, np.array(entries, dtype=np.int64))
    lengths = {d: 10 + (7 * d) % 30 for d in range(40)}
    budget = 200
    spool = Spool(str(tmp_path), budget, bytes_per_token=1)
    tokens_of = lambda e: lengths[e[2]]  # noqa: E731
    windows = list(spool.windows(tokens_of))
    assert [e for w in windows for e in w] == [list(e) for e in entries]
    assert all(sum(tokens_of(e) for e in w if e[0] == online_stream.SPOOLED) <= budget // 2 for w in windows)

    cap = padded_tokens_cap(3, 64, [tokens_of(e) for e in entries])
    assert cap == max(64, int(3 * np.mean([tokens_of(e) for e in entries])))
    made = list(batches(spool, tokens_of, 3, cap))
    assert sorted(tuple(e) for b in made for e in b) == sorted(tuple(e) for e in entries)   # each once
    for b in made:
        lengths_b = [tokens_of(e) for e in b]
        assert lengths_b == sorted(lengths_b, reverse=True) and len(b) <= 3 and len(b) * lengths_b[0] <= cap

    wanted = [tuple(e) for e in entries if e[0] == online_stream.SPOOLED]   # the trainer's order
    taken, ready, buffered = 0, set(), 0
    for batch in made:
        batch = [tuple(e) for e in batch if e[0] == online_stream.SPOOLED]
        if batch:
            need = sum(tokens_of(e) for e in batch)
            while buffered and buffered + need > budget:   # the engine waits: the trainer must be able to go on
                assert wanted[taken] in ready, "deadlock: the trainer waits for a document the engine cannot make"
                ready.discard(wanted[taken])
                buffered -= tokens_of(wanted[taken])
                taken += 1
            ready |= set(batch)
            buffered += need
            assert buffered <= max(budget, need)
    assert ready | set(wanted[:taken]) == set(wanted)


def test_a_document_taken_between_two_looks_of_the_engine_is_not_waited_for(tmp_path, monkeypatch):
    """vLLM's connector writes a document in a worker and the engine then looks for the file; the trainer may read
    and delete it in between (seen on vLLM 0.32's CPU build: the engine waited its 600 s and the run failed). The
    trainer leaves a tombstone, the engine counts it as written, and the buffer's accounting removes it."""
    import types

    import numpy as np

    from kimi_eagle_host.engine import extract_vllm
    from kimi_eagle_host.engine.stream_producer import Spool

    entry = (online_stream.SPOOLED, 0, 3)
    np.save(tmp_path / online_stream.STREAM, np.array([entry], dtype=np.int64))
    spool = Spool(str(tmp_path), 10**6, bytes_per_token=1)
    path = spool.file(entry)
    spool.wait_room([entry], lambda e: 5)
    with open(path, "wb") as f:   # the connector's write...
        f.write(b"x")
    online_stream.StepFiles(types.SimpleNamespace(spool=str(tmp_path), cached=set()), 0).done(3)   # ...taken at once
    assert not os.path.exists(path)
    monkeypatch.setattr(extract_vllm, "WRITE_WAIT_S", 1.0)
    extract_vllm._wait_for_samples([path])   # returns: before the tombstone it raised "never appeared"
    spool.produced(5)
    assert spool.used() == 0   # taken: no longer in the buffer, and its tombstone is gone
    assert sorted(os.listdir(tmp_path)) == sorted([online_stream.STREAM, online_stream.ENGINE_FIGURES])


def test_a_cache_in_memory_the_host_cannot_hold_is_refused_in_one_line():
    online_stream.check_memory_cache(8 * 10**9, 100, 16 * 10**9)   # fits
    online_stream.check_memory_cache(8 * 10**9, 100, None)         # unknown: nothing to check against
    with pytest.raises(BadInput) as e:
        online_stream.check_memory_cache(14 * 10**9, 1200, 16 * 10**9)
    assert str(e.value) == ("--online-cache-gb: the 1200 documents it keeps need 14.0 GB of the trainer's memory, "
                            "and the host has 16.0 GB available (at most 80% of it for the cache): lower "
                            "online_cache_gb")


def test_a_host_of_gpus_gets_an_engine_per_tp_size_gpus():
    """How many of a host's trainer ranks one engine serves: on CUDA one engine per tp_size GPUs (one beside each
    GPU's rank for a target that fits one GPU), one for the host on a CPU, in the split layout, or where tp_size does
    not divide the ranks; `online_engines` says it outright."""
    from types import SimpleNamespace

    def group(local_size, device="cuda", tp=1, engines=None, engine_gpus=None):
        args = SimpleNamespace(online_engines=engines, engine_gpus=engine_gpus, tp_size=tp)
        return online_stream.ranks_per_engine(args, local_size, device)

    assert [group(1), group(2), group(8)] == [1, 1, 1]           # 8 GPUs: 8 engines
    assert [group(8, tp=8), group(4, tp=2), group(4, tp=3)] == [8, 2, 4]
    assert [group(2, device="cpu"), group(2, engine_gpus="1")] == [2, 2]
    assert [group(4, engines=2), group(4, device="cpu", engines=4)] == [2, 1]
    with pytest.raises(BadInput, match="must divide the host's 4 trainer process"):
        group(4, engines=3)
    with pytest.raises(BadInput, match="the split layout"):
        group(2, engines=2, engine_gpus="1")


def test_each_engine_extracts_only_the_held_out_documents_its_ranks_evaluate():
    """Several engines: the held-out pass's documents are shared out as its rows are among the ranks, so each is
    extracted by the one engine whose ranks evaluate it (before, every engine extracted all of them); one engine
    (no torchrun) extracts them all, in the plan's order of held-out documents."""
    held_docs = list(range(30, 46))
    held = plan_of(46, rows_per_step=4)
    held = packing.Plan([[d for d in row if d in held_docs] for row in held.rows if any(d in held_docs for d in row)],
                        4, 0)
    world = 4
    groups = [online_stream.group_held(held_docs, held, (first, 2, world)) for first in (0, 2)]
    assert sorted(groups[0] + groups[1]) == held_docs and all(groups)
    for first, mine in zip((0, 2), groups):   # exactly the documents of the rows ranks first, first + 1 read
        read = {d for s in range(held.steps_per_epoch) for r in (first, first + 1)
                for row in held.rank_rows(s, r, world) for d in row}
        assert set(mine) == read and mine == sorted(mine)
    assert online_stream.group_held(held_docs, held, None) == held_docs
    assert online_stream.group_held([], None, (0, 1, 2)) == []


def test_closing_a_ranks_batches_ends_its_readers_waiting_for_documents_not_yet_written(tmp_path, monkeypatch):
    """The loop stops (a stop, a divergence) while loader threads wait for later steps' documents. With ranks that
    share an engine, the engine may never write them (it writes in stream order, and the other ranks no longer take
    theirs, so the buffer stays full): closing the batches must not wait for them. The held-out documents, which
    the evaluation after the loop reads, are still handed out."""
    import threading
    import types

    import torch

    from kimi_eagle_host.data.step_batches import StepBatches

    def engine_that_writes_nothing_yet(self, dc, device_type, local_rank, local_size):
        self.engine_pid = os.getpid()   # alive, and holding back (its buffer full of another rank's documents)

    monkeypatch.setattr(online_stream.Source, "_start_engine", engine_that_writes_nothing_yet)
    plan = plan_of(12)
    args = types.SimpleNamespace(online_engines=None, engine_gpus=None, tp_size=1, online_buffer_gb=1,
                                 online_cache_gb=0, online_spool_dir=str(tmp_path))
    dc = {"dtype": "float32", "layer_ids": [1, 2, 4], "hidden_size": 4}
    world = types.SimpleNamespace(rank=0, size=1, local_rank=0, local_size=1, distributed=False)
    lengths = [10 + (7 * d) % 30 for d in range(12)]
    source = online_stream.Source(args, dc, plan, [11], None, 0, plan.steps_per_epoch, lengths, "cpu", world,
                                  lambda mine: [mine])
    try:
        batches = StepBatches(plan, 0, plan.steps_per_epoch, 0, 1, source, 40, 2 * 4, 4, torch.float32,
                              torch.device("cpu"), workers=2)
        closer = threading.Thread(target=batches.close, daemon=True)
        closer.start()
        closer.join(20)
        assert not closer.is_alive(), "close() waits for a reader of a document the engine has not written"
        held = os.path.join(source.spool, online_stream.entry_name(online_stream.HELD, 0, 11))
        open(held, "wb").close()
        assert source.held[11] == held
    finally:
        source.close()


def test_a_dead_runs_buffer_is_removed_even_where_its_pid_now_names_another_process(tmp_path):
    import json
    import subprocess
    import sys

    from kimi_eagle_host import procfs

    def spool(name, owner):
        path = tmp_path / (online_stream.SPOOL_PREFIX + name)
        path.mkdir()
        (path / online_stream.OWNER).write_text(json.dumps(owner))
        return path

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = procfs.stat(os.getpid())
        boot = procfs.boot_id()
        live = spool("live", {"pid": os.getpid(), "boot_id": boot, "start_ticks": mine.start_ticks})
        # the dead trainer's pid was given to a later process (here `other`, which started after it)
        reused = spool("reused", {"pid": other.pid, "boot_id": boot, "start_ticks": mine.start_ticks - 1})
        older = spool("older", {"pid": other.pid, "boot_id": boot})   # a record from before start times were kept
        online_stream.sweep_stale(str(tmp_path))
        assert live.exists() and older.exists()
        assert not reused.exists()
    finally:
        other.kill()
        other.wait()


def test_a_spool_is_removed_only_once_its_trainers_lock_is_free(tmp_path):
    """The trainer holds its spool's lock (owner.lock, flock) for its whole life; a sweep removes a spool only where
    it can take that lock: never a live trainer's, whatever its pid or boot id say here (another container's or
    machine's), and a dead one's at once, with what a removal left (<spool>.gone-*). A spool still being made (no
    lock yet, less than a minute old) is left alone."""
    import subprocess
    import sys

    def spool(name):
        path = tmp_path / (online_stream.SPOOL_PREFIX + name)
        path.mkdir()
        (path / "s_0_1.safetensors").write_bytes(b"x")
        return path

    live, dead, gone, new = spool("live"), spool("dead"), spool("dead.gone-123"), spool("new")
    for path in (dead, gone):
        os.close(online_stream.hold_lock(str(path)))   # its trainer gone: the lock file, nobody holding it
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from kimi_eagle_host.data import "
                               "online_stream; online_stream.hold_lock(sys.argv[1]); print(flush=True); "
                               "time.sleep(60)", str(live)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(__file__))})
    try:
        holder.stdout.readline()   # the lock is held
        online_stream.sweep_stale(str(tmp_path))
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, new.name])
        holder.kill()
        holder.wait()
        online_stream.sweep_stale(str(tmp_path))
        assert [p.name for p in tmp_path.iterdir()] == [new.name]
    finally:
        holder.kill()
        holder.wait()


def test_what_an_online_run_keeps_in_its_spool_folder():
    """spool_size.spool_bytes: the held-out documents (positions x bytes a position, a header each), the cache and the
    buffer: the figure train checks against the folder's free space, and the one a planner can estimate."""
    from kimi_eagle_host.data import spool_size

    per = spool_size.token_bytes(3, 64, 4)
    assert per == 3 * 64 * 4 + 16
    assert spool_size.document_bytes(44, 3, 64, 4) == 45 * per + 256
    need = spool_size.spool_bytes(45 + 30, 2, per, 1e6, 2e9)
    assert need == {"held": 75 * per + 512, "cache": 10**6, "buffer": 2 * 10**9,
                    "total": 75 * per + 512 + 10**6 + 2 * 10**9}
