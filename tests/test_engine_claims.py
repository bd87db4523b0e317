"""Several engines of one step on one host (kimi_eagle_host/engine/engine_processes.py): they start one at a time
(start_turn) and share the work by claims that a dead process gives up (Claims), with real processes."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kimi_eagle_host.engine.engine_processes import Claims, run_engines, start_turn

REPO = Path(__file__).resolve().parents[1]


def python(code: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)], cwd=REPO)


def wait_for(path: Path, proc: subprocess.Popen) -> None:
    while not path.exists():
        assert proc.poll() is None, "the other process ended early"
        time.sleep(0.01)


def test_an_engine_starts_only_when_the_one_before_is_up(tmp_path):
    """While this process holds the turn, another that asks for it does not get in; it does once the turn is
    released (the lock also goes with a process that dies: the kernel drops a flock with its file)."""
    lock, asking, inside = tmp_path / "start.lock", tmp_path / "asking", tmp_path / "inside"
    code = ("import sys, pathlib; from kimi_eagle_host.engine.engine_processes import start_turn\n"
            "pathlib.Path(sys.argv[2]).touch()\n"
            "with start_turn(sys.argv[1]):\n    pathlib.Path(sys.argv[3]).touch()\n")
    with start_turn(str(lock)) as waited:
        assert waited < 60
        other = python(code, lock, asking, inside)
        wait_for(asking, other)
        time.sleep(0.3)   # time enough to get in if nothing kept it out
        assert not inside.exists()
    assert other.wait(timeout=60) == 0 and inside.exists()


ENGINE = """\
import json, os, sys
from kimi_eagle_host.engine.engine_processes import start_turn
from kimi_eagle_host.vllm_compat import GPU_ENGINES_ENV
i = int(os.environ["KIMI_EAGLE_ENGINE_OF"].split("/")[0])
try:
    with start_turn(sys.argv[1]):
        seen = os.environ[GPU_ENGINES_ENV]
        if i == int(sys.argv[2]):
            raise RuntimeError("this engine does not start")
except RuntimeError as e:
    print(json.dumps({"ok": False, "error": str(e), "seen": seen}))
    sys.exit(1)
print(json.dumps({"ok": True, "gpu": os.environ["CUDA_VISIBLE_DEVICES"], "seen": seen,
                  "record": os.environ["KIMI_EAGLE_ENGINES_UP"]}))
"""


def test_each_engine_on_a_gpu_is_told_how_many_of_its_gpu_are_up(tmp_path):
    """regenerate --engines 5 over 2 GPUs: three engines on GPU 0, two on GPU 1. Each sizes itself from what the
    engines up before it on its GPU left free, so it must know how many those are: 0, 1, 2 on GPU 0 in whatever
    order they get their turn, 0, 1 on GPU 1. An engine that fails to start holds nothing and is not counted. Two
    ranks of the step on one host at once share the start lock (one engine starts at a time) but each counts its
    own engines (the others' memory is simply not free). Real processes, several rounds."""
    import threading

    (tmp_path / "fake_engine.py").write_text(ENGINE)
    lock = str(tmp_path / ".engine_start.lock")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0,1",
           "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])}
    env.pop("KIMI_EAGLE_GPU_MEMORY_UTILIZATION", None)

    def seen_on(results):
        return {gpu: sorted(r["seen"] for i, r in enumerate(results) if i % 2 == int(gpu) and r["ok"])
                for gpu in ("0", "1")}

    for failing in (-1, 2, 0):
        results = run_engines("fake_engine", [lock, str(failing)], 5, environ=env)
        assert [r["ok"] for r in results] == [i != failing for i in range(5)], results
        seen = seen_on(results)
        assert seen["1"] == ["0/2", "1/2"], results
        assert seen["0"] == (["0/3", "1/3", "2/3"] if failing < 0 else ["0/3", "1/3"]), (failing, results)
    ranks: dict = {}
    threads = [threading.Thread(target=lambda r=r: ranks.__setitem__(r, run_engines("fake_engine", [lock, "-1"], 5,
                                                                                      environ=env)))
               for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for rank in range(2):
        assert seen_on(ranks[rank]) == {"0": ["0/3", "1/3", "2/3"], "1": ["0/2", "1/2"]}, (rank, ranks[rank])
    records = {r["record"] for rank in ranks.values() for r in rank}
    assert len(records) == 2 and not any(Path(r).parent.exists() for r in records)   # one a call, gone with it


def test_a_unit_is_claimed_once_and_freed_by_its_writer_or_its_death(tmp_path):
    folder = tmp_path / "claims"
    mine, theirs = Claims(str(folder)), Claims(str(folder))
    assert mine.claim(3) and not theirs.claim(3)      # held: nobody else works on it
    mine.done(3)
    assert theirs.claim(3)
    theirs.done(3)
    # another process claims 5 and dies without a word: 5 is free again
    ready = tmp_path / "ready"
    holder = python("import sys, time, pathlib; from kimi_eagle_host.engine.engine_processes import Claims\n"
                    "c = Claims(sys.argv[1]); assert c.claim(5); pathlib.Path(sys.argv[2]).touch(); time.sleep(600)\n",
                    folder, ready)
    wait_for(ready, holder)
    assert not mine.claim(5)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait(timeout=60)
    assert mine.claim(5)
    mine.done(5)


def test_next_free_skips_what_is_written_or_held_and_starts_where_told(tmp_path):
    folder = tmp_path / "claims"
    written = {2}
    other = Claims(str(folder))
    assert other.claim(4)
    mine = Claims(str(folder))
    units = mine.next_free(range(6), written.__contains__, first=3)
    assert next(units) == 3
    written.add(5)                       # written by another engine before this one came to it
    assert list(units) == [0, 1]         # 4 held, 5 written, wrapped round to 0 and 1, 2 written
    assert sorted(mine.held) == [0, 1, 3]


class Words:   # a token budget counting words; every prompt fits
    per_message = 1

    def count(self, texts):
        return [len(t.split()) for t in texts]

    def fits(self, used):
        return True

    def reply(self, text):
        return {"role": "assistant", "content": text}


class OneAStep:   # a streaming engine that finishes the oldest request each step
    streams, tokens = True, 0

    def __init__(self):
        self.queue = []

    def start(self, rid, chat, seed):
        self.queue.append((rid, chat))

    def finished(self):
        rid, chat = self.queue.pop(0)
        return [(rid, f"answer to {chat[-1]['content']}", 3)]


def test_a_stream_takes_the_next_chunk_only_when_the_engine_has_room():
    """answering.Stream asks for a chunk when it can start its conversations, not before: an engine sharing chunks
    with others claims each as late as it can. Every conversation still gets each of its turns answered in order."""
    from kimi_eagle_host.data.answering import Stream
    from kimi_eagle_host.data.prompts import Conversation

    events = []

    def chunks():
        for c in range(3):
            events.append(("pull", c))
            convs = [Conversation(id=f"{c}.{k}", line=0, user_turns=[f"q{c}{k}a", f"q{c}{k}b"]) for k in range(2)]
            yield c, convs, 0

    answers = {}

    def done(c, got, cut):
        events.append(("done", c))
        answers[c] = got

    Stream(OneAStep(), Words(), 0, window=2).run(chunks(), done)
    assert events.index(("pull", 1)) > 0 and events.index(("pull", 2)) > events.index(("done", 0)), events
    assert sorted(answers) == [0, 1, 2]
    assert [[a["content"] for a in conv] for conv in answers[1]] == [["answer to q10a", "answer to q10b"],
                                                                       ["answer to q11a", "answer to q11b"]]


def test_answer_chunks_draws_each_claim_as_the_stream_needs_it(tmp_path):
    """regenerate's answer_chunks hands the stream its claims one at a time: with several engines, `todo` claims a
    chunk each time it is drawn, so drawing them all up front left the first engine up holding every free chunk
    (seen on the H200: 95 of 98 chunks on one engine, the three others ended after their first)."""
    import argparse

    from kimi_eagle_host.data.prompts import Conversation
    from kimi_eagle_host.pipeline.regenerate import answer_chunks

    events = []

    class Engine:
        gen = OneAStep()

        def get(self):
            return self.gen

    def claims():
        for c in range(4):
            events.append(("claim", c))
            yield c

    convs = [Conversation(id=f"{i}", line=0, user_turns=[f"q{i}"]) for i in range(8)]
    args = argparse.Namespace(chunk_size=2, batching="auto", max_turns=0, seed=0)
    answered, _, batching, written = answer_chunks(args, Engine(), convs, Words(), str(tmp_path), claims(), total=4,
                                                   written=lambda c: events.append(("written", c)))
    assert (answered, batching, written) == (8, "stream", 4)
    # the window holds two chunks' conversations (2 x chunk_size): a chunk is claimed as a conversation ends, so the
    # last claim comes after the first chunk is written (drawn all at once, every claim came first)
    assert events[:2] == [("claim", 0), ("claim", 1)], events
    assert events.index(("claim", 3)) > events.index(("written", 0)), events
