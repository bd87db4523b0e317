"""Several engines at once on one host: a step runs as N processes of itself that share its shard's work.

Why: a small target's vLLM engine is bound by one CPU core (scheduling, sampling and detokenising ~1,000 sequences a
step), not by its GPU: SmolLM2-135M on an H200 kept the GPU 23 % busy with its engine core at ~110 % of a core
(docs/benchmarks.md, "The data at scale"). The host's other cores can drive more engines on the same GPU.

Each process gets the step's own arguments (its rank and world size unchanged) and ENGINE_OF_ENV = "i/N". The work is
not dealt out in advance: each process claims the next unit nobody holds (Claims: a flock per unit, released when the
unit is written or when its process dies), so an engine that starts late, runs slow or dies leaves its work to the
others, and a resumed run spreads what is left over every engine. The engines start one at a time (start_turn): vLLM
sizes its KV cache from the GPU memory it sees in use while it profiles, and another engine allocating its cache at
that moment made one of four starting at once on an H200 find no room at all (twenty-second session). GPUs are dealt
round-robin (CUDA_VISIBLE_DEVICES names one per process) and, unless the user set KIMI_EAGLE_GPU_MEMORY_UTILIZATION,
each engine on a GPU takes an equal part of what was free there before the first (at most vLLM's 0.9): start_turn
tells each how many of its GPU's engines are up (GPU_ENGINES_ENV), and it sizes itself from what those left free. The
processes share stderr (the job's log); each one's stdout
is its result. ENGINE_OF_ENV tells a process it is one of several, so that the parent alone writes what needs every
unit (regenerate's chat.jsonl).
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import sys
import tempfile
import time

from kimi_eagle_host.gpus import cuda_visible_names
from kimi_eagle_host.vllm_compat import (ENGINE_OF_ENV, GPU_ENGINES_ENV, GPU_SHARE_ENV, engines_on_gpu,
                                         engines_sharing_gpu)


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


# In each process's environment: the file (unique to one run_engines call) that lists the GPU of each of its engines
# that is up, one a line (start_turn reads and appends it). Another call's engines on the same GPUs (another rank of
# the step on this host) hold memory too: each engine sees that as memory not free.
ENGINES_UP_ENV = "KIMI_EAGLE_ENGINES_UP"


def process_env(i: int, n: int, gpus: list[str], environ=os.environ, up_record: str | None = None) -> dict:
    env = dict(environ)
    env[ENGINE_OF_ENV] = f"{i}/{n}"
    if up_record:
        env[ENGINES_UP_ENV] = up_record
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = gpus[i % len(gpus)]
        if GPU_SHARE_ENV not in environ:
            env[GPU_ENGINES_ENV] = f"0/{engines_sharing_gpu(i, n, len(gpus))}"   # how many are up: start_turn
    return env


def run_engines(module: str, argv: list[str], n: int, environ=os.environ) -> list[dict]:
    """Run `python -m module argv` as n processes at once, sharing the work (Claims); their results, in order.
    A process that fails gives {"ok": False, "error": ..., "exit_code": ...}; the others run to their end and take
    what it left (what they finish is kept: the step resumes from it)."""
    gpus = gpu_names(environ)
    with tempfile.TemporaryDirectory(prefix="kimi-eagle-engines-") as folder:
        up_record = os.path.join(folder, "up")
        procs = [subprocess.Popen([sys.executable, "-m", module, *argv], stdout=subprocess.PIPE, text=True,
                                  env=process_env(i, n, gpus, environ, up_record)) for i in range(n)]
        outs = [p.communicate()[0] for p in procs]
    results = []
    for p, out in zip(procs, outs):
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


def engine_index(environ=os.environ) -> tuple[int, int]:
    """(i, N) of a process run_engines started; (0, 1) otherwise."""
    i, _, n = environ.get(ENGINE_OF_ENV, "0/1").partition("/")
    return int(i), int(n)


@contextlib.contextmanager
def start_turn(lock_path: str, environ=os.environ):
    """Held while one engine of several starts (every engine of the step waits for the one before to be up): see the
    module's docstring. Inside, GPU_ENGINES_ENV says how many engines of this run on this GPU are up (they hold their
    share of it); an engine that started is recorded as up (ENGINES_UP_ENV) when the block ends without error. Yields
    the seconds waited. Released when the block ends or the process dies."""
    t0 = time.time()
    gpu, record = environ.get("CUDA_VISIBLE_DEVICES"), environ.get(ENGINES_UP_ENV)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            if gpu and record and GPU_ENGINES_ENV in environ:
                try:
                    with open(record) as r:
                        up = sum(line.strip() == gpu for line in r)
                except FileNotFoundError:
                    up = 0
                environ[GPU_ENGINES_ENV] = f"{up}/{engines_on_gpu(environ)[1]}"
            yield time.time() - t0
            if gpu and record:
                with open(record, "a") as r:
                    r.write(gpu + "\n")
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class Claims:
    """Units of work (ints) shared by several processes through `folder`: claim(u) holds u's flock until done(u) or
    the process ends, so no unit is worked on twice at once and a dead process's units are free again."""

    def __init__(self, folder: str):
        self.folder, self.held = folder, {}
        os.makedirs(folder, exist_ok=True)

    def claim(self, unit: int, wait: bool = False) -> bool:
        """Hold `unit`'s lock: at once or not at all, or (wait) once whoever holds it lets go."""
        fd = os.open(os.path.join(self.folder, f"{unit:08d}.lock"), os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            return False
        self.held[unit] = fd
        return True

    def done(self, unit: int) -> None:
        fd = self.held.pop(unit, None)
        if fd is not None:
            os.close(fd)

    def next_free(self, units, finished, first: int = 0):
        """Claim and yield, one at a time as asked, each unit of `units` not `finished(u)` (looked at again after its
        claim: another process may have written it meanwhile) and not held elsewhere; starting at index `first` of
        the list and wrapping, so that engines starting together begin apart."""
        units = list(units)
        order = units[first % len(units):] + units[:first % len(units)] if units else []
        return self._claimed(order, finished, wait=False)

    def take_over(self, units, finished):
        """After next_free's pass: claim and yield, one at a time, each unit of `units` still not `finished(u)` once
        whoever holds it lets go. A unit held elsewhere when next_free passed it is nobody's if its holder then dies
        (no pass comes back to it): here it is waited for, finished by its holder or left by a dead one. Draw the
        next only after done(u): a process waits holding nothing, so no two wait on each other."""
        return self._claimed(units, finished, wait=True)

    def _claimed(self, order, finished, wait: bool):
        for u in order:
            if finished(u) or not self.claim(u, wait):
                continue
            if finished(u):
                self.done(u)
                continue
            yield u
