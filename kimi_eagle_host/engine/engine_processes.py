"""Several engines at once on one host: a step runs as N processes of itself, each a rank answering its shard.

Why: a small target's vLLM engine is bound by one CPU core (scheduling, sampling and detokenising ~1,000 sequences a
step), not by its GPU: SmolLM2-135M on an H200 kept the GPU 23 % busy with its engine core at ~110 % of a core
(docs/benchmarks.md, "The data at scale"). The host's other cores can drive more engines on the same GPU.

Each process gets the step's own arguments with `--rank R --world-size W` appended (argparse keeps the last), where
this process's shard (rank r of w) is split again: R = r * N + i, W = w * N, so the chunks a process owns are exactly
the ones r owned. GPUs are dealt round-robin (CUDA_VISIBLE_DEVICES names one per process) and, unless the user set
KIMI_EAGLE_GPU_MEMORY_UTILIZATION, each engine on a GPU takes an equal part of vLLM's 0.9. The processes share
stderr (the job's log); each one's stdout is its result. ENGINE_OF_ENV tells a process it is one of several, so
that the parent alone writes what needs every shard (regenerate's chat.jsonl).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from kimi_eagle_host.gpus import cuda_visible_names
from kimi_eagle_host.vllm_compat import ENGINE_OF_ENV, GPU_SHARE_ENV, shared_gpu_share


def gpu_names(environ=os.environ) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them (none on a CPU host)."""
    names = cuda_visible_names(environ)
    if names is not None:
        return names
    try:
        import torch

        return [str(i) for i in range(torch.cuda.device_count())]
    except ImportError:
        return []


def process_env(i: int, n: int, gpus: list[str], environ=os.environ) -> dict:
    env = dict(environ)
    env[ENGINE_OF_ENV] = f"{i}/{n}"
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        if GPU_SHARE_ENV not in environ:
            env[GPU_SHARE_ENV] = f"{shared_gpu_share(n, len(gpus)):.3f}"
    return env


def run_ranks(module: str, argv: list[str], n: int, rank: int, world_size: int, environ=os.environ) -> list[dict]:
    """Run `python -m module argv` as n processes (ranks rank*n+i of world_size*n) at once; their results, in order.
    A process that fails gives {"ok": False, "error": ..., "exit_code": ...}; the others run to their end (what they
    finish is kept: the step resumes from it)."""
    gpus = gpu_names(environ)
    procs = []
    for i in range(n):
        cmd = [sys.executable, "-m", module, *argv, "--rank", str(rank * n + i), "--world-size", str(world_size * n)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=process_env(i, n, gpus, environ)))
    results = []
    for p in procs:
        out, _ = p.communicate()
        res = None
        for line in reversed(out.strip().split("\n")):
            if line.startswith("{"):
                try:
                    res = json.loads(line)
                    break
                except ValueError:
                    continue
        if p.returncode != 0 or not isinstance(res, dict):
            res = {"ok": False, "exit_code": p.returncode, **({"error": res.get("error")} if isinstance(res, dict) else
                                                               {"error": "no result on stdout"})}
        results.append(res)
    return results


def one_of_several(environ=os.environ) -> bool:
    return bool(environ.get(ENGINE_OF_ENV))
