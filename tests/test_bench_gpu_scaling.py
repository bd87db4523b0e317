"""The two-GPU benches (bench/gpu/gpu_scaling.sh, bench/gpu/trainer_cuda_check.sh) rehearsed on the CPU, 2 gloo
processes for the 2 GPUs, tiny sizes: every phase must run through here before a scarce two-GPU session spends its
minutes on them. What they met on the H200 or would have:
- gpu_scaling's stop phase rendered its job from settings given as plain attributes (pydantic is not on the GPU
  machine) and died with "'SimpleNamespace' object has no attribute 'model_source'" once the inventory had grown a
  setting; later it wrote only the job's script, not the settings.json the script's steps read since the settings
  moved there, so the job exited 2 before its first step;
- trainer_cuda_check's random inputs had no manifest.json since train reads exactly the samples a manifest lists:
  every run of it ended "manifest.json: missing" at once."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = {"GS_HIDDEN": "64", "GS_LAYERS": "8", "GS_VOCAB": "512", "GS_ROWS": "40", "GS_WORDS": "60", "GS_SEQ": "128",
        "GS_XBATCH": "4", "GS_TBATCH": "4", "GS_TSTEPS": "6", "GS_DRAFT_VOCAB": "128", "GS_WRITERS": "2",
        "GS_TIMEOUT_FACTOR": "4"}


def test_every_phase_of_the_scaling_bench_runs_through_on_the_cpu(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    env = {**os.environ, **TINY, "OUT": str(out), "WORK": str(work), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "gpu_scaling.sh")], env=env, capture_output=True,
                          text=True, timeout=1200)
    report = json.loads((out / "gpu_scaling.json").read_text())
    phases = report["phases"]
    assert {p: v["error"] for p, v in phases.items() if "error" in v} == {}, done.stderr[-3000:]
    assert done.returncode == 0, done.stderr[-3000:]
    assert phases["setup"]["cpu_rehearsal"] is True
    # extraction on one worker and on two writes the same files, bit for bit
    same = phases["extraction"]["same_outputs"]
    assert same["compared"] == same["bitwise_equal"] == same["files_1gpu"] > 0
    # training on two workers, stopped, resumed on one from where it stopped, to the end
    training = phases["training"]
    resumed = training["one_gpu_resumed"]
    assert training["two_gpus"]["world_size"] == 2 and resumed["world_size"] == 1 and resumed["finished"]
    assert resumed["resumed_from_step"] == training["two_gpus"]["steps"][-1] and resumed["exported"]
    # the detached torchrun job, stopped as `kimi-eagle stop` stops it: its workers saved a checkpoint, none is left
    stop = phases["stop"]
    assert stop["ok"] and stop["job_processes_while_running"] >= 2 and stop["processes_left"] == []
    assert stop["log_says_sigterm"] and stop["sigterm_checkpoint"]
    assert phases["fsdp"]["parallel"] == "fsdp" and phases["fsdp"]["world_size"] == 2


def test_the_trainer_check_runs_stops_resumes_across_world_sizes_on_the_cpu(tmp_path):
    sizes = {"RT_HIDDEN": "128", "RT_LAYERS": "8", "RT_VOCAB": "1024", "RT_DRAFT_VOCAB": "256", "RT_MIN_LEN": "64",
             "RT_MAX_LEN": "200", "TC_TOKENS_PER_STEP": "512", "TC_CPU_REHEARSAL": "1"}
    out = tmp_path / "out"
    env = {**os.environ, **sizes, "OUT": str(out), "TC_DIR": str(tmp_path / "work"), "PYTHON": sys.executable}
    done = subprocess.run(["bash", str(REPO / "bench" / "gpu" / "trainer_cuda_check.sh")], env=env,
                          capture_output=True, text=True, timeout=1200)
    said = done.stdout
    runs = ("one", "half", "half_resume", "ddp", "resume", "fsdp")
    assert dict(re.findall(r"^(\w+) rc=(\d+)$", said, re.M)) == {r: "0" for r in runs}, said + done.stderr[-2000:]

    def answer(run):
        return json.loads((out / f"{run}.json").read_text().strip().splitlines()[-1])

    # stopped at step 10 and resumed on the same world size: the straight run's final loss exactly
    assert "stopped at 10 and resumed: EQUAL" in said, said
    # stopped on 2 processes, resumed on 1: the same global batches, so the same loss but for the order of the sums
    assert "stopped on 2 at 10 and resumed on 1: CLOSE" in said, said
    ddp, resumed, fsdp = answer("ddp"), answer("resume"), answer("fsdp")
    assert (ddp["world_size"], ddp["parallel"], ddp["finished"]) == (2, "ddp", False)
    assert (resumed["world_size"], resumed["resumed_from_step"], resumed["finished"]) == (1, 10, True)
    assert (fsdp["world_size"], fsdp["parallel"], fsdp["finished"]) == (2, "fsdp", True)
    assert not (tmp_path / "work").exists()   # the bench removes its inputs and runs
