"""One host, many processes: extract and train under torchrun (gloo on CPU), launch.py's decisions, and
`kimi-eagle stop` of a torchrun job over the real sshd.

What a user would notice: 2 workers write exactly the samples 1 process writes; 2 DDP/FSDP ranks follow the
same loss curve as 1 process on the same global batch; a checkpoint of 2 ranks resumes on 1; SIGTERM saves a
checkpoint that --resume continues from; stop leaves no worker behind.
"""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_train import make_pipeline

REPO = Path(__file__).resolve().parents[1]
PAY = REPO / "kimi_eagle_host"
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error", "CUDA_VISIBLE_DEVICES": ""}
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone"]


def answer(stdout: str):
    """The step's JSON answer: exactly one document on stdout, whatever the number of ranks."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one JSON answer on stdout, got {len(lines)} lines: {stdout[-2000:]}"
    return json.loads(lines[0])


def step(script, *args, nproc=1, env=None, timeout=300):
    """A payload run: in this process when nproc is 1 (saves a torch import on a busy CI box), else torchrun."""
    if nproc == 1 and env is None:
        return in_process(script, *args)
    p = subprocess.run([*TORCHRUN, "--nproc-per-node", str(nproc), "-m", f"kimi_eagle_host.pipeline.{script[:-3]}",
                        *map(str, args)],
                       capture_output=True, text=True, env={**ENV, **(env or {})}, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def in_process(script, *args):
    spec = importlib.util.spec_from_file_location(f"kimi_eagle_{script[:-3]}", PAY / "pipeline" / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = mod.main([str(a) for a in args])
    return code, out.getvalue(), err.getvalue()


# ----------------------------------------------------------------------------------------------------
# launch.py: one process or torchrun, from the visible GPUs

def decide(*args, env):
    e = {k: v for k, v in ENV.items() if k != "CUDA_VISIBLE_DEVICES"}
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.launch", "--print", *map(str, args)],
                       capture_output=True, text=True, env={**e, **env}, timeout=60)
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout)


def test_the_split_layout_starts_one_trainer_rank_per_train_gpu(fake_gpus, tmp_path):
    """Online with engine_gpus/train_gpus: the trainer gets as many ranks as train_gpus names, not one per visible
    GPU. On two GPUs, the engine on 1 and the trainer on 0 was two trainer ranks, both narrowed to GPU 0 (the
    second's cuda:1 not there); CUDA_VISIBLE_DEVICES stays whole for the engine that rank 0 starts."""
    train = ["--", "-m", "kimi_eagle_host.pipeline.train", "--hidden-states", "online"]
    two = fake_gpus(81920, 81920)
    d = decide(*train, "--engine-gpus", "1", "--train-gpus", "0", env=two)
    assert (d["mode"], d["nproc_per_node"]) == ("single", 1), d
    assert "CUDA_VISIBLE_DEVICES" not in d["env"]
    d = decide(*train, "--engine-gpus", "3", "--train-gpus", "0,1,2", env=fake_gpus(81920, 81920, 81920, 81920))
    assert (d["mode"], d["nproc_per_node"]) == ("torchrun", 3), d
    two = fake_gpus(81920, 81920)   # the one nvidia-smi on PATH reports two again
    # the same from the job's settings.json, as a job's train reads them
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"steps": {"train": {"hidden_states": "online", "engine_gpus": [1],
                                                         "train_gpus": [0]}}}))
    d = decide("--", "-m", "kimi_eagle_host.pipeline.train", "--settings", settings, env=two)
    assert (d["mode"], d["nproc_per_node"]) == ("single", 1), d
    # offline, train_gpus means nothing (the step ignores it): one rank per GPU as before
    d = decide("--", "-m", "kimi_eagle_host.pipeline.train", "--train-gpus", "0", env=two)
    assert d["nproc_per_node"] == 2, d
    # online_engines from the settings too: a count that does not divide the ranks stops before torchrun starts
    settings.write_text(json.dumps({"steps": {"train": {"hidden_states": "online", "online_engines": 3}}}))
    e = {k: v for k, v in ENV.items() if k != "CUDA_VISIBLE_DEVICES"}
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.launch", "--", "-m",
                        "kimi_eagle_host.pipeline.train", "--settings", str(settings)],
                       capture_output=True, text=True, env={**e, **two}, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "launch.py: --online-engines 3: must divide the host's 2 trainer process(es)"], p.stderr
    # a GPU the host does not have: one line, exit 2, nothing started
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.launch", *train, "--train-gpus", "0,2"],
                       capture_output=True, text=True, env={**e, **two}, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "launch.py: --train-gpus 0,2: this host shows 2 GPU(s) (numbered from 0)"], p.stderr
    # a negative number (it picked a GPU from the end before): the step's own rule, in one line
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.launch", *train, "--train-gpus", "0,-1"],
                       capture_output=True, text=True, env={**e, **two}, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "launch.py: --train-gpus 0,-1: each GPU once, numbers from 0"], p.stderr


def test_launch_decides_processes_from_gpus_and_model_size(fake_gpus, tmp_path):
    env = fake_gpus(81920, 81920, 81920, 81920)
    d = decide("--", "-m", "kimi_eagle_host.pipeline.train", "--model", "m", env=env)
    assert d["mode"] == "torchrun" and d["nproc_per_node"] == 4 and "--standalone" in d["argv"]
    assert d["argv"][-4:] == ["-m", "kimi_eagle_host.pipeline.train", "--model", "m"]  # each worker: the module
    d = decide("--", "-m", "kimi_eagle_host.pipeline.train", env={**env, "CUDA_VISIBLE_DEVICES": "2"})
    assert d["mode"] == "single" and d["argv"][1:] == ["-m", "kimi_eagle_host.pipeline.train"]
    # CUDA_VISIBLE_DEVICES narrows what a job may use.
    assert decide("--", "pipeline/train.py", env={**env, "CUDA_VISIBLE_DEVICES": "2"})["mode"] == "single"
    # A model of 100 GiB on 80 GiB GPUs needs 2 per replica: 4 GPUs give 2 extraction processes.
    model = tmp_path / "model"
    model.mkdir()
    (model / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": 100 * 2**30}}))
    d = decide("--gpus-per-replica", "auto", "--", "pipeline/extract.py", "--model", model, env=env)
    assert (d["gpus_per_replica"], d["nproc_per_node"]) == (2, 2)
    # vLLM spreads over the GPUs itself: one process, whatever is asked.
    d = decide("--nproc-per-node", "4", "--", "pipeline/extract.py", "--backend", "hf", "--backend", "vllm", env=env)
    assert d["mode"] == "single" and "vllm" in d["reason"]
    # train's ranks are its own whatever its engine: offline it reads files (the recipe's engine, extract's, in the
    # job's settings.json: it ran as one process on a host of 4 GPUs), online each group of ranks starts its engine
    trains = tmp_path / "trains.json"
    for hidden_states in ("offline", "online"):
        trains.write_text(json.dumps({"steps": {"train": {"engine": "vllm", "hidden_states": hidden_states}}}))
        for how in (("--settings", trains), ("--engine", "vllm", "--hidden-states", hidden_states)):
            d = decide("--", "-m", "kimi_eagle_host.pipeline.train", *how, env=env)
            assert d["mode"] == "torchrun" and d["nproc_per_node"] == 4, d
    # The same from the job's settings.json (what a job's extract reads), and a flag given wins over it.
    settings = tmp_path / "settings.json"
    settings.write_text(json.dumps({"steps": {"extract": {"backend": "vllm", "model": str(model)}}}))
    d = decide("--nproc-per-node", "4", "--", "pipeline/extract.py", "--settings", settings, env=env)
    assert d["mode"] == "single" and "vllm" in d["reason"]
    d = decide("--gpus-per-replica", "auto", "--", "pipeline/extract.py", "--settings", settings, "--backend", "hf",
               env=env)
    assert (d["mode"], d["gpus_per_replica"], d["nproc_per_node"]) == ("torchrun", 2, 2), d
    # Inside a torchrun worker (a launcher put torchrun in front): never a torchrun of its own.
    d = decide("--", "pipeline/train.py", env={**env, "RANK": "1", "WORLD_SIZE": "8", "TORCHELASTIC_RUN_ID": "x"})
    assert d["mode"] == "single" and d["argv"][1:] == ["pipeline/train.py"]
    # Forced on a host without GPUs (gloo workers), and multi-node rendezvous flags.
    cpu = fake_gpus()
    assert decide("--", "x.py", env=cpu)["mode"] == "single"
    d = decide("--nproc-per-node", "2", "--nnodes", "2", "--rdzv-endpoint", "h0:29500",
               "--rdzv-id", "job-1", "--", "x.py", env=cpu)
    assert d["mode"] == "torchrun-multinode" and d["argv"][d["argv"].index("--rdzv-endpoint") + 1] == "h0:29500"
    for flags, why in ((["--nproc-per-node", "8"], "8 processes x 1 GPUs each need 8 GPUs; this host shows 4"),
                       (["--gpus", "6"], "--gpus 6 (the inventory's gpus:) but this host shows 4 GPU(s)")):
        p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.launch", *flags, "--", "x.py"],
                           capture_output=True, text=True, env={**ENV, **env, "CUDA_VISIBLE_DEVICES": "0,1,2,3"},
                           timeout=60)
        assert p.returncode == 2 and why in p.stderr, p.stderr
    d = decide("--gpus", "2", "--", "x.py", env={**env, "CUDA_VISIBLE_DEVICES": "3,1,2"})
    assert d["nproc_per_node"] == 2 and d["env"] == {"CUDA_VISIBLE_DEVICES": "3,1"}


def test_a_shard_takes_its_gpus_by_name_among_those_its_host_lets_it_see(fake_gpus):
    """--gpus N --gpu-offset O (a --shard-by gpus shard): N of the GPUs CUDA_VISIBLE_DEVICES names, from the O-th on,
    exported by name. A host reserved to GPUs 4-7 runs its second shard on 6,7 (not the machine's 2,3); UUIDs and MIG
    names go through as the host lists them."""
    env = fake_gpus(*[81920] * 8)
    for visible, flags, picked in (
            ("4,5,6,7", ("--gpus", "2", "--gpu-offset", "2"), "6,7"),
            ("4,5,6,7", ("--gpus", "2"), "4,5"),
            ("GPU-aa11,GPU-bb22,GPU-cc33", ("--gpus", "1", "--gpu-offset", "1"), "GPU-bb22"),
            ("MIG-GPU-aa11/1/0, MIG-GPU-aa11/2/0", ("--gpus", "1", "--gpu-offset", "1"), "MIG-GPU-aa11/2/0"),
            ("MIG-0f1e2d3c-aaaa-bbbb-cccc-000000000001,MIG-0f1e2d3c-aaaa-bbbb-cccc-000000000002",
             ("--gpus", "2"), "MIG-0f1e2d3c-aaaa-bbbb-cccc-000000000001,MIG-0f1e2d3c-aaaa-bbbb-cccc-000000000002"),
            (None, ("--gpus", "2", "--gpu-offset", "6"), "6,7")):    # nvidia-smi's 8, numbered as CUDA does
        e = env if visible is None else {**env, "CUDA_VISIBLE_DEVICES": visible}
        d = decide(*flags, "--", "-m", "kimi_eagle_host.pipeline.train", env=e)
        assert d["env"]["CUDA_VISIBLE_DEVICES"] == picked, (visible, flags, d)
        assert d["gpus"] == d["nproc_per_node"] == len(picked.split(",")), d
    # a slice past the GPUs the host shows: one line, exit 2, nothing started
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.pipeline.launch", "--gpus", "2", "--gpu-offset", "3",
                        "--", "x.py"], capture_output=True, text=True,
                       env={**ENV, **env, "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, timeout=60)
    assert p.returncode == 2 and p.stderr.strip().splitlines() == [
        "launch.py: --gpus 2 --gpu-offset 3 but this host shows 4 GPU(s)"], p.stderr
    # an exec shard's command (not a step the launcher starts) gets its slice the same way
    show = "import os, sys; print(os.environ['CUDA_VISIBLE_DEVICES'], sys.argv[1:])"
    p = subprocess.run([sys.executable, "-m", "kimi_eagle_host.gpus", "--gpus", "1", "--gpu-offset", "1", "--",
                        sys.executable, "-c", show, "--rank", "1"], capture_output=True, text=True,
                       env={**ENV, **env, "CUDA_VISIBLE_DEVICES": "GPU-aa11,GPU-bb22"}, timeout=60)
    assert p.returncode == 0 and p.stdout.strip() == "GPU-bb22 ['--rank', '1']", (p.stdout, p.stderr)


# ----------------------------------------------------------------------------------------------------
# extract

@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from kimi_eagle_host.pipeline import tiny_model

    root = tmp_path_factory.mktemp("tr_extract")
    model = tiny_model.build(str(root / "llama"), kind="llama", layers=8, seed=0)["out_dir"]
    code, out, err = step("prepare.py", "--model", model, "--dataset", PAY / "sample_data" / "chat.jsonl",
                          "--output-dir", root / "one", "--seq-len", 48, "--max-samples", 20)
    assert code == 0, err
    shutil.copytree(root / "one" / "prepared", root / "two" / "prepared")
    return {"root": root, "model": model}


def read_samples(d: Path) -> dict:
    from safetensors.torch import load_file

    return {p.name: load_file(str(p)) for p in sorted(d.glob("hs_*.safetensors"))}


def test_torchrun_extract_equals_one_process_and_validates_all(prepared):
    import torch

    root, model = prepared["root"], prepared["model"]
    args = ["--model", model, "--batch-size", 1, "--seq-len", 48]
    code, out, err = step("extract.py", *args, "--output-dir", root / "one")
    assert code == 0, err
    code, out, err = step("extract.py", *args, "--output-dir", root / "two", nproc=2)
    assert code == 0, err
    doc = answer(out)
    assert doc["processes"] == 2 and doc["written"] == 20 and doc["range"] == [0, 20]
    one, two = read_samples(root / "one" / "hidden_states"), read_samples(root / "two" / "hidden_states")
    assert sorted(one) == sorted(two) and len(one) == 20
    for name in one:
        for key in ("token_ids", "hidden_states", "loss_mask"):
            assert torch.equal(one[name][key], two[name][key]), (name, key)
    # Both ranks wrote samples (the work was shared), and one data_config.json describes them all.
    assert "process 1/2: wrote" in err and "process 0/2: wrote" in err
    cfg1 = json.loads((root / "one" / "hidden_states" / "data_config.json").read_text())
    cfg2 = json.loads((root / "two" / "hidden_states" / "data_config.json").read_text())
    assert {k: v for k, v in cfg1.items() if k != "prepared_dir"} == {k: v for k, v in cfg2.items() if k != "prepared_dir"}
    # no temp file left (the manifests' lock file stays: removing a lock file races its next holder)
    assert not [p for p in (root / "two" / "hidden_states").iterdir() if p.name.startswith(".")
                and p.name != ".manifest.lock"]
    assert json.loads((root / "two" / "hidden_states" / "manifest.json").read_text())["count"] == 20

    # --validate over all ranks finds a bad sample whichever rank owns it.
    bad = root / "two" / "hidden_states" / "hs_7.safetensors"
    bad.write_bytes(bad.read_bytes()[:200])
    code, out, err = step("extract.py", "--output-dir", root / "two", "--seq-len", 48, "--validate", nproc=2)
    doc = answer(out)
    assert code == 1 and doc["checked"] == 20 and [b["index"] for b in doc["bad"]] == [7]

    # Resumable per rank: only the missing samples are redone, by whichever rank owns them.
    (root / "two" / "hidden_states" / "hs_12.safetensors").unlink()
    code, out, err = step("extract.py", *args, "--output-dir", root / "two", nproc=2)
    doc = answer(out)
    assert code == 0 and doc["written"] == 2 and doc["skipped_existing"] == 18, (doc, err[-3000:])
    for name in ("hs_7.safetensors", "hs_12.safetensors"):
        again = read_samples(root / "two" / "hidden_states")[name]
        assert torch.equal(again["hidden_states"], one[name]["hidden_states"])


# ----------------------------------------------------------------------------------------------------
# train

TRAIN_ARGS = ["--device", "cpu", "--batch-size", 4, "--ttt-steps", 3, "--lr", 3e-3, "--seed", 7,
              "--log-every", 1, "--epochs", 2]


@pytest.fixture(scope="module")
def train_inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("tr_train")
    p = make_pipeline(root)
    return p


def fresh_out(p, name: str) -> Path:
    out = p["out"].parent / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(p["out"], out, ignore=shutil.ignore_patterns("draft"))
    return out


def train(p, out, *extra, nproc=1, env=None):
    code, stdout, err = step("train.py", "--model", p["target"], "--output-dir", out, *TRAIN_ARGS, *extra,
                             nproc=nproc, env=env)
    return code, answer(stdout), err


def losses(doc):
    return [h["loss"] for h in doc["history"]]


@pytest.fixture(scope="module")
def reference(train_inputs):
    """One process, the whole run: 16 samples, global batch 4, 2 epochs = 8 steps."""
    code, doc, err = train(train_inputs, fresh_out(train_inputs, "ref"))
    assert code == 0 and doc["finished"] and doc["total_steps"] == 8, err
    return doc


def test_ddp_two_ranks_same_curve_and_resume_on_one(train_inputs, reference):
    out = fresh_out(train_inputs, "ddp")
    code, a, err = train(train_inputs, out, "--stop-at-step", 4, nproc=2)
    assert code == 0 and a["world_size"] == 2 and a["parallel"] == "ddp", err
    assert a["history"][-1]["step"] == 4 and not a["finished"]
    # Each rank computed half of every global batch; their update is the global batch's.
    assert losses(a) == pytest.approx(losses(reference)[:4], rel=1e-4)
    # a forgotten --resume: every rank refuses it in one line, none is left training or waiting for rank 0
    code, again, err = train(train_inputs, out, nproc=2)
    assert code != 0 and "stopped at step 4 of 8: continue it with --resume" in again["error"], err
    # rank 1 says the same, or torchrun ends it first when rank 0 leaves; never a crash in a collective
    rank1 = [ln for ln in err.splitlines() if ln.startswith("[rank 1] result: ")]
    assert all("stopped at step 4 of 8" in ln for ln in rank1) and "Connection closed" not in err, err[-3000:]
    code, b, err = train(train_inputs, out, "--resume")
    assert code == 0 and b["world_size"] == 1 and b["resumed_from_step"] == 4 and b["finished"], err
    assert "saved by 2 rank(s), now 1" in err
    assert losses(b) == pytest.approx(losses(reference)[4:], rel=1e-4)


def test_fsdp_two_ranks_same_curve_and_export(train_inputs, reference):
    import torch
    from safetensors.torch import load_file

    out = fresh_out(train_inputs, "fsdp")
    code, a, err = train(train_inputs, out, "--parallel", "fsdp", nproc=2)
    assert code == 0 and a["parallel"] == "fsdp" and a["finished"], err
    assert losses(a) == pytest.approx(losses(reference), rel=1e-4)
    ours = load_file(str(out / "draft" / "export" / "model.safetensors"))
    ref = load_file(str(Path(reference["export_dir"]) / "model.safetensors"))
    assert ours.keys() == ref.keys()
    for k in ref:
        assert torch.allclose(ours[k].float(), ref[k].float(), atol=1e-4), k


def test_fsdp_two_ranks_train_a_two_layer_draft_as_one_process(train_inputs):
    """draft_layers 2 under FSDP: each decoder layer is a shard unit of its own, and the TTT keys/values of both
    layers pass between them; the curve is one process's."""
    one_code, one, err = train(train_inputs, fresh_out(train_inputs, "deep-ref"), "--draft-layers", 2)
    assert one_code == 0 and one["finished"], err
    out = fresh_out(train_inputs, "deep-fsdp")
    code, two, err = train(train_inputs, out, "--draft-layers", 2, "--parallel", "fsdp", nproc=2)
    assert code == 0 and two["parallel"] == "fsdp" and two["finished"], err
    assert losses(two) == pytest.approx(losses(one), rel=1e-4)
    config = json.loads((out / "draft" / "export" / "config.json").read_text())
    assert config["transformer_layer_config"]["num_hidden_layers"] == 2


@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_a_diverging_run_on_two_ranks_stops_on_both_at_the_same_step(train_inputs, parallel):
    """Every rank must take the decision to stop together, or one waits forever in a collective the other
    skipped: a NaN seen at a save step (between logging steps) ends both ranks, exit 1, nothing exported."""
    out = fresh_out(train_inputs, f"nan-{parallel}")
    code, doc, err = train(train_inputs, out, "--parallel", parallel, "--lr", "1e30", "--log-every", "100",
                           "--save-every", "1", nproc=2)
    assert code == 1 and not doc["ok"] and "not finite" in doc["error"] and "at step 2" in doc["error"], err
    assert not (out / "draft" / "export").exists()
    assert sorted(x.name for x in (out / "draft" / "checkpoints").glob("step_*")) == ["step_00000001.pt"]


def test_sigterm_saves_a_checkpoint_that_resume_continues(train_inputs, reference):
    out = fresh_out(train_inputs, "sigterm")
    cmd = [*TORCHRUN, "--nproc-per-node", "2", "-m", "kimi_eagle_host.pipeline.train", "--model",
           str(train_inputs["target"]), "--output-dir", str(out), *map(str, TRAIN_ARGS), "--epochs", "50"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env={**ENV, "KIMI_EAGLE_TEST_STEP_DELAY_S": "0.3"})
    err_lines = []
    try:
        for line in proc.stderr:
            err_lines.append(line)
            if line.startswith("step 3/"):
                break
        os.killpg(proc.pid, signal.SIGTERM)  # what `kimi-eagle stop` does to the job's process group
        stdout, rest = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    err = "".join(err_lines) + rest
    doc = answer(stdout)
    assert not doc["ok"] and "SIGTERM" in doc["error"] and not doc["finished"], err
    stopped_at = doc["step"]
    assert 3 <= stopped_at < 200 and doc["checkpoint"].endswith(f"step_{stopped_at:08d}.pt")
    assert Path(doc["checkpoint"]).is_file()
    # The next run picks it up (on 1 process) and runs the remaining steps only.
    code, b, err = train(train_inputs, out, "--epochs", "50", "--resume")
    assert code == 0 and b["resumed_from_step"] == stopped_at and b["finished"], err
    assert b["history"][0]["step"] == stopped_at + 1 and b["step"] == b["total_steps"] == 200


def processes(*files: str):
    """(pid, the fields of /proc/<pid>/stat after the command name, then the bytes of each named /proc/<pid>
    file) of every process that is still there to read."""
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            stat = Path(f"/proc/{name}/stat").read_text()
            extra = [Path(f"/proc/{name}/{f}").read_bytes() for f in files]
        except OSError:
            continue
        yield (int(name), stat[stat.rindex(")") + 2:].split(), *extra)


def held_compiler(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A g++ for torch.compile (CXX) that, for one of torch.compile's kernels (`<hash>.main.cpp` under the Inductor
    cache; the compiles before those are probes of the CPU's vector ISA, whose failure Inductor tolerates), leaves
    a mark and waits for a release file (at most 120 s) before it becomes the real g++: a signal sent once the mark
    is there lands while a compiler runs, however fast or loaded the box. Python, not sh: dash unblocks every
    signal at start, and what is tested is that the compiler inherits the trainer's blocked SIGTERM.
    Returns (the compiler, the mark, the release file)."""
    mark, release = tmp_path / "compiling", tmp_path / "compile-on"
    tool = tmp_path / "bin" / "g++"   # its name says gcc to Inductor, which picks its flags by it
    tool.parent.mkdir()
    tool.write_text(f"""#!{sys.executable}
import os, sys, time
if any(a.endswith(".main.cpp") for a in sys.argv[1:]):
    part = {str(mark)!r} + f".{{os.getpid()}}.part"   # two kernels may compile at once: a part file each
    with open(part, "w") as f:
        f.write(str(os.getpid()))
    os.replace(part, {str(mark)!r})
    deadline = time.monotonic() + 120
    while not os.path.exists({str(release)!r}) and time.monotonic() < deadline:
        time.sleep(0.02)
gxx = {shutil.which("g++") or "g++"!r}
os.execv(gxx, [gxx, *sys.argv[1:]])
""")
    tool.chmod(0o755)
    return tool, mark, release


def test_a_stop_while_the_step_compiles_still_saves_a_checkpoint(train_inputs, tmp_path):
    """`kimi-eagle stop` signals the job's whole process group, and torch.compile's compiler runs in it. A stop
    that lands while the first step compiles ends that step, saves and says so (it was a CppCompileError: the
    compiler died of the signal)."""
    out = fresh_out(train_inputs, "stop-compiling")
    cmd = [sys.executable, "-m", "kimi_eagle_host.pipeline.train", "--model", str(train_inputs["target"]),
           "--output-dir", str(out), *map(str, TRAIN_ARGS), "--epochs", "50", "--compile", "on"]
    compiler, compiling, release = held_compiler(tmp_path)
    env = {**ENV, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),   # cold: the first step compiles
           "CXX": str(compiler)}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            env=env)
    try:
        deadline = time.monotonic() + 240
        while not compiling.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)   # the mark stays: no compile can start and end between two looks
        assert proc.poll() is None and compiling.exists(), "no compiler seen in the job's group"
        compiler_pid = int(compiling.read_text())
        assert os.getpgid(compiler_pid) == proc.pid   # the compiler runs in the group the stop signals
        os.killpg(proc.pid, signal.SIGTERM)  # what `kimi-eagle stop` does
        release.touch()   # the compiler goes on, unless the signal ended it
        stdout, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    doc = answer(stdout)
    assert proc.returncode == 1 and "stopped by SIGTERM after step 1" in doc["error"], err[-3000:]
    assert Path(doc["checkpoint"]).is_file() and doc["checkpoint"].endswith("step_00000001.pt")


# ----------------------------------------------------------------------------------------------------
# the controller: a torchrun job through the CLI over the real sshd, and its stop

def job_processes(job_id: str) -> list[int]:
    """Live pids carrying the job's id in their environment: torchrun and its workers, which torchrun starts in
    sessions of their own, outside the job's process group. Our own scan, not jobctl's: the test checks jobctl."""
    marker = f"KIMI_EAGLE_JOB_ID={job_id}\0".encode()
    return [pid for pid, fields, environ in processes("environ") if fields[0] != "Z" and marker in environ + b"\0"]


def test_stop_of_a_torchrun_job_over_ssh_leaves_no_process(tmp_path, sshd, train_inputs):
    from conftest import make_env

    out = fresh_out(train_inputs, "cli")
    env = make_env(tmp_path, sshd, host_env={"KIMI_EAGLE_TEST_STEP_DELAY_S": "0.3", "OMP_NUM_THREADS": "1",
                                             "CUDA_VISIBLE_DEVICES": ""},
                   extra=f"""pipeline:
  model: {train_inputs['target']}
  output_dir: {out}
  batch_size: 4
  epochs: 1000
  nproc_per_node: 2
""")
    rendered = env.cli("render", "job", "train", "--host", "gpu", "--out", str(tmp_path / "rendered"))
    assert rendered.code == 0, rendered.stderr
    script = next((tmp_path / "rendered").rglob("job.sh")).read_text()
    assert "-m kimi_eagle_host.pipeline.launch --nproc-per-node 2 -- -m kimi_eagle_host.pipeline.train " in script

    r = env.cli("--json", "run", "train", "--host", "gpu", "--detach", "--no-preflight", "--",
                "--device", "cpu", "--log-every", "1")
    assert r.code == 0, (r.stdout, r.stderr)
    job = r.json()
    log = Path(job["log"])
    deadline = time.monotonic() + 240
    while "step 2/" not in (log.read_text(errors="replace") if log.exists() else ""):
        assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
        assert "exited with code" not in log.read_text(errors="replace"), log.read_text(errors="replace")[-3000:]
        time.sleep(0.3)
    running = job_processes(job["id"])
    # torchrun and its 2 workers (the job shell exports the id itself, so its own environ lacks it).
    assert len(running) == 3, running
    stopped = env.cli("--json", "stop", job["id"], "--host", "gpu", "--grace", "60")
    assert stopped.code == 0, (stopped.stdout, stopped.stderr)
    assert job_processes(job["id"]) == []
    status = env.cli("--json", "status", job["id"], "--host", "gpu").json()["jobs"][0]
    assert status["state"] == "stopped"
    text = log.read_text(errors="replace")
    assert "==> kimi-eagle: torchrun: 2 process(es)" in text and "SIGTERM received" in text
    # The workers saved where they stopped: a later `run train -- --resume` continues from there.
    ckpts = sorted((out / "draft" / "checkpoints").glob("step_*.pt"))
    assert ckpts, text[-3000:]
