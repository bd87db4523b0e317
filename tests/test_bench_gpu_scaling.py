"""bench/gpu/gpu_scaling.sh, the two-GPU scaling bench, rehearsed on the CPU as its docstring says (2 gloo workers
for the 2 GPUs, tiny sizes): every phase must run through here before a scarce two-GPU session spends its minutes
on it. Bugs it met on the H200 or would have: the stop phase rendered its job from settings given as plain
attributes (pydantic is not on the GPU machine) and died with "'SimpleNamespace' object has no attribute
'model_source'" once the inventory had grown a setting; later it wrote only the job's script, not the settings.json
the script's steps read since the settings moved there, so the job exited 2 before its first step."""
from __future__ import annotations

import json
import os
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
