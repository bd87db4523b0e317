"""hidden_states: online: train runs the engine itself and takes its hidden states through a bounded buffer in memory.

What a user would notice, on a real tiny target (transformers on CPU) through the real steps: the online run trains
exactly what the offline run (extract, then train from the files) trains — the same losses, held-out figures and
exported weights, bit for bit, with the same engine and batch —; a run stopped mid-stream (max steps, or SIGTERM to
its process group as `kimi-eagle stop` sends) and resumed ends where a straight run ends; the engine dying is one
error, not a hang; nothing of the buffer is left behind.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import SAMPLE_CHAT, STEP_ENV, host_cmd
from kimi_eagle_host.pipeline import tiny_model

SAMPLE, ENV = SAMPLE_CHAT, STEP_ENV
LAYERS = "1,2,4"
SEQ_LEN = 64
# Two epochs of 24 documents (a quarter held out), two rows per step: 18 steps, a held-out evaluation at the end.
COMMON = ("--epochs", "2", "--batch-size", "2", "--log-every", "1", "--lr-schedule", "constant",
          "--holdout-fraction", "0.25", "--report-to", "none", "--save-every", "4")
ONLINE = ("--hidden-states", "online", "--layer-ids", LAYERS, "--seq-len", str(SEQ_LEN), "--engine-batch-size", "1")


def run(step, *args, env=None, timeout=600):
    p = subprocess.run(host_cmd(f"pipeline.{step}", *args), capture_output=True, text=True, env=env or ENV,
                       timeout=timeout)
    try:
        doc = json.loads(p.stdout)
    except ValueError:
        doc = None
    return p.returncode, doc, p.stderr


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Llama target, its prepared data and vocabulary; `offline/` also extracted (one document per forward,
    as the online engine runs here) and trained."""
    root = tmp_path_factory.mktemp("online")
    model = tiny_model.build(str(root / "model"), kind="llama", layers=4, seed=0)["out_dir"]
    off = root / "offline"
    code, _, err = run("prepare", "--model", model, "--dataset", SAMPLE, "--output-dir", off, "--seq-len", SEQ_LEN,
                       "--max-samples", 24)
    assert code == 0, err
    code, _, err = run("vocab", "--model", model, "--output-dir", off, "--draft-vocab-size", 100)
    assert code == 0, err
    code, _, err = run("extract", "--model", model, "--output-dir", off, "--seq-len", SEQ_LEN, "--batch-size", 1,
                       "--layer-ids", LAYERS)
    assert code == 0, err
    code, trained, err = run("train", "--model", model, "--output-dir", off, *COMMON)
    assert code == 0, err
    return {"root": root, "model": model, "offline": off, "trained": trained}


def online_dir(made, name: str) -> Path:
    """A pipeline root with the prepared data and vocabulary only: no hidden states."""
    out = made["root"] / name
    for part in ("prepared", "vocab"):
        shutil.copytree(made["offline"] / part, out / part)
    return out


def spool_base(made, name: str) -> Path:
    base = made["root"] / f"shm-{name}"
    base.mkdir()
    return base


def export_weights(out: Path) -> dict:
    return load_file(str(out / "draft" / "export" / "model.safetensors"))


def assert_same_training(a: dict, b: dict, out_a: Path, out_b: Path) -> None:
    assert [(h["step"], h["loss"], h["acc"], h["cond_acc"]) for h in a["history"]] == \
        [(h["step"], h["loss"], h["acc"], h["cond_acc"]) for h in b["history"]]
    assert a["heldout"] == b["heldout"]
    wa, wb = export_weights(out_a), export_weights(out_b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert wa[k].equal(wb[k]), k


def leftovers(base: Path) -> list[str]:
    return sorted(os.listdir(base))


def same_as_extracted(copied: Path, hs_dir: Path, exact: bool = True, tol: float = 0.0) -> int:
    """Every document the trainer received (copied by the test hook) against extract's file of that document:
    the same token ids and loss mask, and hidden states bit for bit (exact) or within `tol` mean relative error
    per layer. Returns the documents compared."""
    docs = set()
    for f in sorted(copied.iterdir()):
        doc = int(f.stem.rsplit("_", 1)[1])
        got, want = load_file(str(f)), load_file(str(hs_dir / f"hs_{doc}.safetensors"))
        assert got["token_ids"].equal(want["token_ids"]) and got["loss_mask"].equal(want["loss_mask"]), f.name
        a, b = got["hidden_states"].float(), want["hidden_states"].float()
        assert a.shape == b.shape, f.name
        if exact:
            assert got["hidden_states"].dtype == want["hidden_states"].dtype and a.equal(b), f.name
        else:
            err = ((a - b).abs().mean(dim=(0, 2)) / b.abs().mean(dim=(0, 2))).max().item()
            assert err <= tol, (f.name, err)
        docs.add(doc)
    return docs


def test_online_trains_exactly_what_offline_trains(made):
    out, base = online_dir(made, "online"), spool_base(made, "equal")
    copied = made["root"] / "received"
    copied.mkdir()
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                         "--online-spool-dir", base, env={**ENV, "KIMI_EAGLE_TEST_ONLINE_COPY_DIR": str(copied)})
    assert code == 0, err
    # the hidden states that reached the trainer are extract's, bit for bit: every document, held-out ones too
    assert same_as_extracted(copied, made["offline"] / "hidden_states") == set(range(24))
    assert len(list(copied.glob("s_*"))) == 36   # 18 training documents in each of 2 epochs
    assert doc["hidden_states"] == "online" and doc["finished"] and doc["target_tops"] == "every step"
    assert_same_training(made["trained"], doc, made["offline"], out)
    assert not (out / "hidden_states").exists() and leftovers(base) == []   # never a file of the run, no spool left
    assert doc["online"]["engine_tok_s"] > 0
    made["online"] = (doc, out)


def test_a_cache_in_the_trainers_memory_extracts_each_document_once_and_never_as_a_file(made):
    """online_cache_gb with one trainer process: the documents that come again stay in the trainer's memory. The
    engine extracts each training document once for two epochs (not twice), the training is offline's bit for
    bit, and the spool, a buffer of one document here, never held the cache: its peak is that of a run without."""
    out, base = online_dir(made, "memory"), spool_base(made, "memory")
    copied = made["root"] / "received-memory"
    copied.mkdir()
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                         "--online-spool-dir", base, "--online-cache-gb", "1", "--online-buffer-gb", "0.000001",
                         env={**ENV, "KIMI_EAGLE_TEST_ONLINE_COPY_DIR": str(copied)})
    assert code == 0, err
    assert "18 documents cached for later epochs (in the trainer)" in err
    assert_same_training(made["trained"], doc, made["offline"], out)
    assert doc["online"]["cached_documents"] == 18
    assert same_as_extracted(copied, made["offline"] / "hidden_states") == set(range(24))
    assert len(list(copied.glob("s_*"))) == 18   # each training document extracted once
    sizes = {int(f.stem.split("_")[1]): f.stat().st_size for f in (made["offline"] / "hidden_states").glob("hs_*")}
    held = [int(f.stem.split("_")[1]) for f in copied.glob("d_*")]
    assert len(held) == 6
    assert 0 < doc["online"]["spool_peak_bytes"] <= sum(sizes[d] for d in held) + max(sizes.values())
    assert leftovers(base) == []


def test_online_stopped_by_sigterm_resumes_exactly(made):
    """SIGTERM to the whole process group (kimi-eagle stop): the engine outlives it, the trainer finishes its step
    with the documents it needs, checkpoints and exits 1; the spool is gone; --resume ends as a straight run.
    Both runs keep the documents that come again for the second epoch (online_cache_gb): the same training."""
    out, base = online_dir(made, "stopped"), spool_base(made, "stopped")
    env = {**ENV, "KIMI_EAGLE_TEST_STEP_DELAY_S": "0.4"}
    cache = ("--online-cache-gb", "1")
    args = host_cmd("pipeline.train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                    "--online-spool-dir", base, *cache)
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    deadline = time.time() + 300
    ckpts = out / "draft" / "checkpoints"
    while time.time() < deadline and p.poll() is None and not list(ckpts.glob("step_*.pt")):
        time.sleep(0.1)   # a checkpoint at step 4: well into the stream
    os.killpg(p.pid, signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=300)
    doc = json.loads(stdout)
    assert p.returncode == 1 and "stopped by SIGTERM" in doc["error"], stderr
    assert 4 <= doc["step"] < doc["total_steps"]
    assert leftovers(base) == []
    code, rest, err = run("train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                          "--online-spool-dir", base, "--resume", *cache)
    assert code == 0 and rest["resumed_from_step"] == doc["step"], err
    assert rest["online"]["cached_documents"] > 0
    trained = made["trained"]["history"]
    assert [h["loss"] for h in rest["history"]] == [h["loss"] for h in trained if h["step"] > doc["step"]]
    assert rest["heldout"] == made["trained"]["heldout"]
    want = export_weights(made["offline"])
    got = export_weights(out)
    assert all(want[k].equal(got[k]) for k in want)


def _children(pid: int) -> list[int]:
    kids = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            kids += [int(x) for x in f.read().split()]
    return kids


def test_engine_killed_is_one_error_not_a_hang(made):
    """The engine dies (SIGKILL) while the trainer needs its documents: the trainer ends at once with one line
    naming the engine, and removes the spool."""
    out, base = online_dir(made, "killed"), spool_base(made, "killed")
    # GPUs named but none used on a CPU: the engine's CUDA_VISIBLE_DEVICES is narrowed to engine_gpus all the same.
    env = {**ENV, "KIMI_EAGLE_TEST_STEP_DELAY_S": "0.3", "CUDA_VISIBLE_DEVICES": "5,7"}
    # A buffer of one document: the engine can never run ahead of the trainer by more than that.
    args = host_cmd("pipeline.train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                    "--online-spool-dir", base, "--online-buffer-gb", "0.000001", "--engine-gpus", "1",
                    "--train-gpus", "0", "--device", "cpu")
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    deadline = time.time() + 300
    while time.time() < deadline and not list(base.glob("*/s_2_*")):
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    engine = _children(p.pid)
    assert len(engine) == 1
    with open(f"/proc/{engine[0]}/environ", "rb") as f:
        assert b"CUDA_VISIBLE_DEVICES=7" in f.read().split(b"\0")
    engine_figures = json.loads(next(base.glob("*/engine.json")).read_text())
    assert engine_figures["waited_s"] > 0   # the one-document buffer held it back: backpressure
    # ...and so the spool never held more than the held-out documents and one training document (the footprint
    # the run reports, what online saves against offline's every file)
    sizes = {int(f.stem.split("_")[1]): f.stat().st_size for f in (made["offline"] / "hidden_states").glob("hs_*")}
    held = [int(f.name.split("_")[1].split(".")[0]) for f in next(base.glob("*/held")).iterdir()
            if f.name.startswith("d_")]
    assert held and 0 < engine_figures["spool_peak_bytes"] <= sum(sizes[d] for d in held) + max(sizes.values())
    assert engine_figures["spool_peak_bytes"] < sum(sizes.values()) / 2
    os.kill(engine[0], signal.SIGKILL)
    t0 = time.time()
    stdout, stderr = p.communicate(timeout=120)
    assert time.time() - t0 < 60
    doc = json.loads(stdout)
    assert p.returncode == 1
    assert doc["error"].startswith("online: the engine (pid") and "exited with code -9" in doc["error"], doc
    assert "Traceback" not in doc["error"]
    assert leftovers(base) == []


def started_online(made, name: str, *args: str, delay: str = "0.3") -> tuple[subprocess.Popen, Path, Path]:
    """An online training running (each step held `delay` s): (its process, output folder, spool folder)."""
    out, base = online_dir(made, name), spool_base(made, name)
    cmd = host_cmd("pipeline.train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                   "--online-spool-dir", base, *args)
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**ENV, "KIMI_EAGLE_TEST_STEP_DELAY_S": delay})
    return p, out, base


def wait_for_files(p: subprocess.Popen, base: Path, pattern: str) -> Path:
    """The spool, once a file matching `pattern` is in it (the engine well into its stream)."""
    deadline = time.time() + 300
    while time.time() < deadline and not list(base.glob(f"*/{pattern}")):
        assert p.poll() is None, p.communicate()
        time.sleep(0.05)
    (spool,) = [d for d in base.iterdir() if list(d.glob(pattern))]
    return spool


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


SWEEP = "import sys; from kimi_eagle_host.data.online_stream import sweep_stale; sweep_stale(sys.argv[1])"


def test_another_runs_clean_up_leaves_a_live_runs_buffer_alone(made):
    """A second online run starting where the first run's pid means nothing, and sweeping the spool folder for dead
    runs' buffers: from another PID namespace (a container sharing /dev/shm, docker --ipc=host; here `unshare
    --pid`) and from another machine sharing the folder (another boot id). The first run's trainer holds its
    buffer's lock: its buffer stays, and it trains to its end (it lost its documents and hung for good before)."""
    p, out, base = started_online(made, "swept", "--online-buffer-gb", "0.0000001")
    try:
        spool = wait_for_files(p, base, "s_3_*")
        other_machine = [sys.executable, "-c", "from kimi_eagle_host import procfs; "
                         "procfs.boot_id = lambda: 'another machine'; " + SWEEP, str(base)]
        sweeps = [other_machine]
        if subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode == 0:
            sweeps.append(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c", SWEEP, str(base)])
        for sweep in sweeps:
            swept = subprocess.run(sweep, capture_output=True, text=True, env=ENV, timeout=60)
            assert swept.returncode == 0 and "removed" not in swept.stderr, swept.stderr
            assert spool.is_dir(), sweep
        stdout, stderr = p.communicate(timeout=300)
    finally:
        p.kill()
    assert p.returncode == 0, stderr[-3000:]
    assert json.loads(stdout)["finished"] and leftovers(base) == []


def test_a_buffer_removed_under_a_run_ends_it_in_one_line(made):
    """The buffer's folder removed while the run trains (by hand, or by a clean-up that took it for a dead run's):
    the engine does not make it again (its documents would never reach the trainer), and the trainer, which
    waits for a document that can no longer come, ends at once in one line naming the folder (before: it waited
    for ever, holding its GPUs). Nothing is left: no folder, no engine."""
    p, out, base = started_online(made, "removed", "--online-buffer-gb", "0.0000001")
    try:
        spool = wait_for_files(p, base, "s_2_*")
        (engine,) = _children(p.pid)
        deadline = time.time() + 30
        while spool.exists() and time.time() < deadline:   # a person's rm -rf, while the engine writes
            shutil.rmtree(spool, ignore_errors=True)
        t0 = time.time()
        stdout, stderr = p.communicate(timeout=120)
    finally:
        p.kill()
    assert time.time() - t0 < 60
    doc = json.loads(stdout)
    assert p.returncode == 1 and doc["error"].startswith(f"online: the buffer's folder {spool} was removed while "
                                                         "this run used it"), (doc, stderr[-3000:])
    assert "Traceback" not in stderr
    assert leftovers(base) == [] and not alive(engine)


def test_a_killed_trainer_leaves_no_buffer_behind(made):
    """The trainer killed (SIGKILL) while its engine extracts ahead: the engine removes the buffer's folder and
    exits. It moves the folder aside before deleting it, so its writer threads, still writing, cannot leave files
    (and so the folder) behind in /dev/shm: it stayed there, in the host's memory, in 5 of 8 tries before."""
    p, out, base = started_online(made, "trainer-killed", "--epochs", "40", delay="1")
    try:
        wait_for_files(p, base, "s_5_*")   # far ahead of the trainer, still extracting: the buffer is large
        (engine,) = _children(p.pid)
        p.kill()
        p.communicate(timeout=60)
        deadline = time.time() + 60
        while time.time() < deadline and alive(engine):
            time.sleep(0.1)
    finally:
        p.kill()
    assert not alive(engine)
    assert leftovers(base) == []


def test_two_trainer_processes_share_one_engine(made):
    """torchrun on one host (gloo on CPU): rank 0 starts the engine, each rank takes its rows of every step from the
    one buffer, and the global batch's update is one process's. Into the second epoch, the documents that come
    again are read from the cache in the spool, which both ranks share (a later epoch may give one to the other)."""
    out, base = online_dir(made, "ranks"), spool_base(made, "ranks")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "kimi_eagle_host.pipeline.train", "--model", made["model"], "--output-dir", str(out),
                        *COMMON, *ONLINE, "--online-spool-dir", str(base), "--max-steps", "12",
                        "--online-cache-gb", "1"],
                       capture_output=True, text=True, env={**ENV, "CUDA_VISIBLE_DEVICES": ""}, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.strip()]   # one answer, rank 0's
    doc = json.loads(line)
    assert doc["world_size"] == 2 and doc["step"] == 12, doc
    want = [h["loss"] for h in made["trained"]["history"][:12]]
    assert [h["loss"] for h in doc["history"]] == pytest.approx(want, rel=1e-4)
    assert re.search(r"\d+ documents cached for later epochs \(in the spool\)", p.stderr)
    assert p.stderr.count("online: engine hf started") == 1 and leftovers(base) == []


def test_an_engine_for_each_trainer_process(made):
    """`online_engines: 2` on a host of two trainer processes (what a host of GPUs gets by default for a target that
    fits one GPU: an engine beside each GPU's rank): two engines at once, each on its own rank's GPU and extracting
    only its rank's rows, each rank keeping its repeats in its own memory; the run trains the one-process losses
    and its answer adds both engines up. A count that does not divide the ranks is one line, exit 2."""
    out, base = online_dir(made, "per-rank"), spool_base(made, "per-rank")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "-m", "kimi_eagle_host.pipeline.train", "--model", made["model"], "--output-dir", str(out),
                *COMMON, *ONLINE, "--online-spool-dir", str(base), "--max-steps", "12", "--online-cache-gb", "1",
                "--device", "cpu"]
    env = {**ENV, "CUDA_VISIBLE_DEVICES": "5,7"}   # named, not used on a CPU: each engine is given its rank's
    p = subprocess.run([*torchrun, "--online-engines", "2"], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-4000:]
    (line,) = [ln for ln in p.stdout.splitlines() if ln.strip()]
    doc = json.loads(line)
    assert doc["world_size"] == 2 and doc["step"] == 12, doc
    want = [h["loss"] for h in made["trained"]["history"][:12]]
    assert [h["loss"] for h in doc["history"]] == pytest.approx(want, rel=1e-4)
    started = re.findall(r"online: engine hf started \(pid \d+\) for (\d+) documents \((\d+) held out\) "
                         r"on GPU\(s\) (\d+)", p.stderr)
    assert sorted(g for _, _, g in started) == ["5", "7"], p.stderr[-3000:]
    # each extracted the held-out documents its rank evaluates (together: each of them once) and its own rank's
    # row of each step, never the other's; a document that comes back to a rank in the second epoch is read from
    # that rank's memory
    helds = [int(h) for _, h, _ in started]
    assert sum(helds) == doc["heldout"]["documents"] and all(helds), helds
    counts = [int(n) - int(h) for n, h, _ in started]
    assert all(0 < c < sum(counts) for c in counts), counts
    assert p.stderr.count("(in the trainer)") == 2, p.stderr[-3000:]
    assert doc["online"]["engines"] == 2 and doc["online"]["engine_tok_s"] > 0, doc["online"]
    assert leftovers(base) == []
    # as a job starts it (launch.py, which starts the torchrun): one line before any process
    launch = [sys.executable, "-m", "kimi_eagle_host.pipeline.launch", "--nproc-per-node", "2", "--",
              *torchrun[torchrun.index("-m", 3):], "--online-engines", "3"]
    bad = subprocess.run(launch, capture_output=True, text=True, env=env, timeout=900)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines() == [
        "launch.py: --online-engines 3: must divide the host's 2 trainer process(es)"], bad.stderr[-3000:]
    # and the step itself, under a torchrun of the user's own: every rank ends on that line
    bad = subprocess.run([*torchrun, "--online-engines", "3"], capture_output=True, text=True, env=env, timeout=900)
    assert bad.returncode != 0 and "--online-engines 3: must divide the host's 2 trainer process(es)" in bad.stderr
    assert leftovers(base) == []


def test_two_hosts_each_extract_their_own_rows(made):
    """torchrun across two hosts of two trainer processes each (two_host_train; each host its own spool folder,
    standing for its memory): each host's first rank starts an engine that extracts the held-out documents and
    only the rows its host's ranks take, so two engines work at once; the run trains what one process trains
    offline, step for step. Into the second epoch each host's ranks share, in its spool, the documents that come
    back to that host."""
    rows = ("--batch-size", "4")   # one row for each of the 4 ranks
    straight = made["root"] / "hosts-offline"
    shutil.copytree(made["offline"], straight)
    code, trained, err = run("train", "--model", made["model"], "--output-dir", straight, *COMMON, *rows)
    assert code == 0, err
    bases = [spool_base(made, f"host{i}") for i in range(2)]
    ends = two_host_train(made, "hosts", bases, *COMMON, *rows, "--max-steps", "6", "--online-cache-gb", "1")
    for code, _, err in ends:
        assert code == 0, err[-4000:]
    (line,) = [ln for ln in ends[0][1].splitlines() if ln.strip()]   # one answer, rank 0's
    doc = json.loads(line)
    assert doc["world_size"] == 4 and doc["step"] == 6, doc
    assert [h["loss"] for h in doc["history"]] == pytest.approx([h["loss"] for h in trained["history"][:6]],
                                                                rel=1e-4)
    started = [re.findall(r"online: engine hf started \(pid \d+\) for (\d+) documents \((\d+) held out\)", err)
               for _, _, err in ends]
    assert [len(s) for s in started] == [1, 1], [err[-2000:] for _, _, err in ends]   # one engine a host
    # each engine extracted the held-out documents its host's ranks evaluate (each of them on one host only) and
    # its host's 2 of each step's 4 rows (one document a row here: 18 training documents, 4 steps an epoch), never
    # the other host's
    helds = [int(s[0][1]) for s in started]
    assert sum(helds) == doc["heldout"]["documents"] and all(helds), helds
    counts = [int(s[0][0]) - int(s[0][1]) for s in started]
    assert all(0 < c <= 6 * 2 for c in counts), counts
    assert all(re.search(r"\d+ documents cached for later epochs \(in the spool\)", err) for _, _, err in ends)
    assert leftovers(bases[0]) == [] and leftovers(bases[1]) == []
    # the answer and the progress points speak of both engines: their tokens/s added up
    assert doc["online"]["engines"] == 2 and doc["online"]["engine_tok_s"] > 0, doc["online"]
    points = [json.loads(ln.split(" ", 1)[1]) for ln in ends[0][2].splitlines()
              if ln.startswith("@kimi-eagle-progress")]
    flows = [p for p in points if "engine_tok_s" in p]
    assert flows and all(p["engines"] == 2 for p in flows), points[-3:]


def test_an_engine_that_cannot_start_on_one_host_fails_the_run_on_every_host(made):
    """The second host cannot make its spool (its folder takes no files): both hosts' trainers end with an
    error in one line, none waits in a collective for a host that is gone, and the first host's engine is stopped
    and its spool removed."""
    base = spool_base(made, "host-ok")
    ends = two_host_train(made, "hosts-down", [base, "/proc/1"], *COMMON, per_host=1)
    assert [code for code, _, _ in ends] == [1, 1], [err[-3000:] for _, _, err in ends]
    first, second = ends[0][2], ends[1][2]
    assert "online: the engine did not start on the host of rank 1 (its error is in that host's log)" in first
    (said,) = [json.loads(ln.split("result: ", 1)[1]) for ln in second.splitlines()
               if ln.startswith("[rank 1] result: ")]
    assert said["error"] == "online: the buffer's folder cannot be made in online_spool_dir /proc/1: No such file " \
                           "or directory", said
    assert leftovers(base) == []


def two_host_train(made, name: str, spool_dirs: list, *args: str, per_host: int = 2) -> list[tuple[int, str, str]]:
    """train under torchrun as two hosts (two agents on this machine, static rendezvous over loopback, gloo on CPU),
    per_host trainer processes each, host i's spool in spool_dirs[i]: (exit code, stdout, stderr) of each agent."""
    from sshd import free_port   # below the ephemeral range: a rendezvous port no outgoing connection takes

    port = free_port()
    out = online_dir(made, name)   # one output folder, as on a shared file system
    procs = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i),
                               "--nproc-per-node", str(per_host), "--master-addr", "127.0.0.1", "--master-port",
                               str(port), "-m", "kimi_eagle_host.pipeline.train", "--model", made["model"],
                               "--output-dir", str(out), *args, *ONLINE, "--online-spool-dir", str(spool_dirs[i])],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**ENV, "CUDA_VISIBLE_DEVICES": ""}) for i in range(2)]
    try:
        ends = [p.communicate(timeout=900) for p in procs]
        return [(p.returncode, out_, err) for p, (out_, err) in zip(procs, ends)]
    finally:
        for p in procs:
            p.kill()


def test_online_refusals(made, tmp_path):
    """Settings online cannot honour are one line, exit 2, before any engine starts."""
    out = online_dir(made, "refused")
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *ONLINE, "--online-spool-dir",
                         tmp_path / "nowhere", "--report-to", "none")
    assert code == 2 and "--online-spool-dir" in doc["error"] and "not a folder" in doc["error"]
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *ONLINE, "--layer-ids", "1,9",
                         "--report-to", "none")
    assert code == 2 and "9" in doc["error"]
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *ONLINE, "--engine-gpus", "0,0",
                         "--report-to", "none")
    # the schema's check, as the flags are read (the same words as a setting engine_gpus: [0, 0])
    assert code == 2 and "--engine-gpus: GPU 0 is listed twice" in err and "Traceback" not in err, err


def earlier_run(out: Path) -> Path:
    """A finished earlier run's checkpoint in `out`: a new run from step 0 would remove it."""
    import torch

    ckpt = out / "draft" / "checkpoints" / "step_00000018.pt"
    ckpt.parent.mkdir(parents=True)
    torch.save({"step": 18, "meta": {"total_steps": 18}}, ckpt)
    return ckpt


def test_engine_vllm_without_a_usable_vllm_is_refused_before_anything_goes(made):
    """`engine: vllm` online on a host whose vLLM cannot stream (none here, or one older than 0.18): one line, exit
    2, before the target loads or an earlier run's checkpoints are removed (before: they were removed, an engine
    started, and it failed with exit 1)."""
    from kimi_eagle_host.engine import extract_vllm

    try:
        if extract_vllm.choose_path()[0] == "native":
            pytest.skip("this environment has a vLLM >= 0.18")
    except Exception:   # noqa: BLE001 - a vLLM choose_path refuses: the run must refuse it too
        pass
    out, base = online_dir(made, "no-vllm"), spool_base(made, "no-vllm")
    ckpt = earlier_run(out)
    code, doc, err = run("train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE, "--engine", "vllm",
                         "--online-spool-dir", base)
    assert code == 2, err[-3000:]
    assert doc["error"].startswith("--engine vllm: hidden_states online needs vLLM >= 0.18 (its native "
                                   "extraction): "), doc
    assert ckpt.exists() and leftovers(base) == [] and "Traceback" not in err


def test_held_out_documents_that_would_not_fit_the_spool_folder_are_refused_before_anything_goes(made, tmp_path):
    """The held-out documents stay in the spool folder (memory: /dev/shm) for the whole run, outside the buffer's
    budget, and grow with the data. A folder too small for them (a 300 kB tmpfs here, half the documents held out):
    one line naming the folder, the bytes and the setting, exit 2, before the target loads or an earlier run's
    checkpoints go (before: the engine failed with ENOSPC once the draft was built, or hours in at scale)."""
    from kimi_eagle_host.data.spool_size import document_bytes

    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount) for a small tmpfs")
    out, small = online_dir(made, "small-spool"), tmp_path / "small"
    small.mkdir()
    ckpt = earlier_run(out)
    train = host_cmd("pipeline.train", "--model", made["model"], "--output-dir", out, *COMMON, *ONLINE,
                     "--online-spool-dir", small, "--holdout-fraction", "0.5", "--online-buffer-gb", "0.0000001")
    # a tmpfs of its own, seen only by this process (a private mount namespace), gone with it; what the run left
    # there is listed before it goes
    listing = tmp_path / "left-in-small"
    p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                        f'mount -t tmpfs -o size=300k kimi-eagle-test "{small}" && "$@"; code=$?; '
                        f'ls -A "{small}" > "{listing}"; exit $code', "sh", *train],
                       capture_output=True, text=True, env=ENV, timeout=600)
    doc = json.loads(p.stdout)
    assert p.returncode == 2, p.stderr[-3000:]
    # the buffer: one engine batch of the longest document, since one always goes (more than online_buffer_gb here)
    assert re.fullmatch(re.escape(f"online_spool_dir {small}: ") + r"this run would keep [\d.]+ kB there and it has "
                        r"307.2 kB free; 12 held-out documents [\d.]+ kB \(steps.train.holdout_max_samples, "
                        r"steps.train.holdout_fraction\), the "
                        r"buffer 50.4 kB \(one batch of steps.train.engine_batch_size, more than online_buffer_gb: one "
                        r"always goes\): lower those settings, or set online_spool_dir to a folder with room",
                        doc["error"]), doc
    assert ckpt.exists() and listing.read_text() == "" and "Traceback" not in p.stderr
    # the bytes counted are the files' (extract's sample format): never fewer, a header's rounding more
    for f in (made["offline"] / "hidden_states").glob("hs_*.safetensors"):
        tokens = len(load_file(str(f))["token_ids"])
        assert 0 <= document_bytes(tokens - 1, 3, 64, 4) - f.stat().st_size < 64, f.name


def test_preflight_and_train_agree_on_the_buffers_floor(made, tmp_path):
    """A buffer holds one engine batch at least (a batch always goes into an empty one): preflight's plan counts
    that floor as the train step's own check does (before: one sample, so preflight passed a folder the train step
    then refused). Eight documents of seq_len a batch, a 300 kB tmpfs: both refuse it, both naming the batch."""
    if subprocess.run(["unshare", "--mount", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare --mount) for a small tmpfs")
    out, small = online_dir(made, "floor"), tmp_path / "small"
    small.mkdir()
    train = dict(online_spool_dir=str(small), online_buffer_gb=1e-7, holdout_fraction=0, engine_batch_size=8)

    def in_small_tmpfs(cmd):
        p = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                            f'mount -t tmpfs -o size=300k kimi-eagle-test "{small}" && "$@"', "sh", *cmd],
                           capture_output=True, text=True, env=ENV, timeout=600)
        return p.returncode, json.loads(p.stdout), p.stderr

    code, doc, err = in_small_tmpfs(host_cmd(
        "pipeline.train", "--model", made["model"], "--output-dir", out, "--epochs", "1", "--batch-size", "2",
        "--report-to", "none", *ONLINE, *(f"--{k.replace('_', '-')}={v}" for k, v in train.items())))
    assert code == 2 and "one batch of steps.train.engine_batch_size" in doc["error"], (doc, err[-2000:])
    code, doc, err = in_small_tmpfs(host_cmd(
        "ops.preflight", "--step", "train", "--backend", "hf", "--model", made["model"], "--output-dir", out,
        "--runs-dir", tmp_path, "--seq-len", SEQ_LEN, "--layer-ids", LAYERS, "--hidden-states", "online",
        "--nvidia-smi", tmp_path / "no-smi", "--step-settings", json.dumps({"train": train})))
    storage = {c["name"]: c for c in doc["checks"]}["storage"]
    assert code == 1 and storage["status"] == "fail", storage
    assert storage["plan"]["min_buffer_bytes"] == 8 * storage["plan"]["one_sample_bytes"], storage
    assert "one batch of engine_batch_size 8 samples of seq_len 64" in storage["detail"], storage


def test_run_all_online_exports_a_draft_and_leaves_no_hidden_state_files(tmp_path):
    """`kimi-eagle run all --host local hidden_states=online` (the demo's path): no extract step, the draft is
    exported, and no hidden-state file exists afterwards, on disk or in the buffer's folder."""
    from conftest import TINY_PIPELINE, make_env

    shm = tmp_path / "shm"
    shm.mkdir()
    env = make_env(tmp_path, None, extra=TINY_PIPELINE)
    r = env.cli("run", "all", "--host", "local", "--no-preflight", "--no-gpu", "hidden_states=online",
                f"online_spool_dir={shm}", "draft_vocab_size=64", "steps.train.max_steps=3", timeout=1200)
    assert r.code == 0, (r.stdout[-3000:], r.stderr[-3000:])
    out = tmp_path / "localwork" / "out"
    assert (out / "draft" / "export" / "model.safetensors").is_file()
    assert "[extract]" not in r.stdout and "online: engine hf started" in r.stdout
    # the progress line: the engine's tokens/s, the buffer's fill and who waited for whom
    assert re.search(r"train 3/3 .* tok/s +engine [\d,]+ tok/s +buffer \d+% +waiting: trainer \S+, engine \S+",
                     r.stdout), r.stdout[-3000:]
    assert not (out / "hidden_states").exists() and os.listdir(shm) == []
    stray = [p for p in out.rglob("*.safetensors") if "draft" not in p.parts and "prepared" not in p.parts]
    assert stray == []


def disk_too_small(tmp_path):
    """A local host whose disk cannot hold the hidden states (its preflight sees 10 GiB + 1 KB free: the margin
    passes, the files would not), with a target preflight can read (the demo's is built by the job itself, so its
    storage is not planned): (env, the environment that says so)."""
    from conftest import make_env

    model = tiny_model.build(str(tmp_path / "model"), kind="llama", layers=4, seed=0)["out_dir"]
    env = make_env(tmp_path, None, extra=f"""pipeline:
  model: {model}
  dataset: "{{payloads}}/sample_data/chat.jsonl"
  engine: hf
  layer_ids: [1, 2, 4]
  seq_len: 64
  batch_size: 4
  draft_vocab_size: 64
""")
    return env, {"KIMI_EAGLE_TEST_FREE_DISK_BYTES": str((10 << 30) + 1000)}


def test_run_all_goes_online_where_offline_would_not_fit_unless_told(tmp_path):
    """`run all` on a host whose disk cannot hold the hidden states: with hidden_states left to its default, the
    job runs online and says so in one line; with hidden_states=offline given, preflight refuses and nothing
    starts."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env, full = disk_too_small(tmp_path)
    told = env.cli("run", "all", "--host", "local", "--no-gpu", "hidden_states=offline", env=full, timeout=600)
    assert told.code == 1 and "preflight failed (storage); nothing was started" in told.stderr, told
    assert "offline does not fit" in told.stdout + told.stderr
    out = tmp_path / "localwork" / "out"
    assert not (out / "draft").exists()

    r = env.cli("run", "all", "--host", "local", "--no-gpu", f"online_spool_dir={shm}", "steps.train.max_steps=3",
                env=full, timeout=1200)
    assert r.code == 0, (r.stdout[-3000:], r.stderr[-3000:])
    said = [ln for ln in (r.stdout + r.stderr).splitlines() if "hidden_states: online, since" in ln]
    assert len(said) == 1 and "offline needs" in said[0] and "set hidden_states=offline" in said[0], said
    assert "FAIL" not in r.stdout + r.stderr   # the storage verdict is the switch, not a failure printed
    assert "[extract]" not in r.stdout and "online: engine hf started" in r.stdout
    assert (out / "draft" / "export" / "model.safetensors").is_file() and not (out / "hidden_states").exists()


def test_run_all_with_a_trainer_that_reads_files_stays_offline_and_refuses(tmp_path):
    """steps.train.trainer=speculators reads hidden-state files: `run all` does not switch it online where offline
    would not fit (its train would refuse online after prepare and vocab ran); preflight refuses before anything
    starts, and its fix says why online is not offered."""
    shm = tmp_path / "shm"
    shm.mkdir()
    env, full = disk_too_small(tmp_path)
    r = env.cli("run", "all", "--host", "local", "--no-gpu", f"online_spool_dir={shm}",
                "steps.train.trainer=speculators", env=full, timeout=600)
    assert r.code == 1 and "preflight failed (storage); nothing was started" in r.stderr, (r.stdout, r.stderr)
    assert "hidden_states: online, since" not in r.stdout + r.stderr
    assert "steps.train.trainer speculators reads the hidden states as files" in r.stdout + r.stderr
    assert not (tmp_path / "localwork" / "out").exists()
