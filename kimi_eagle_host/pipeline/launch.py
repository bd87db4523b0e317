#!/usr/bin/env python3
"""Start a pipeline step as one process, or as torchrun workers (one per GPU, or per group of GPUs).

    launch.py [--gpus N [--gpu-offset O]] [--nproc-per-node N|auto] [--gpus-per-replica N|auto]
              [--nnodes N --rdzv-endpoint HOST:PORT --rdzv-id ID [--rdzv-conf K=V]
               [--max-restarts N]] -- -m STEP_MODULE [STEP ARGS...]

The job script runs every multi-GPU-capable step through this wrapper (stdlib only, so it costs no
import time). It decides how many processes the step gets on this host, then *replaces itself* (exec)
with either `python -m STEP ARGS` or `python -m torch.distributed.run ... -m STEP ARGS`, so the job's
process group, signals and exit code are the step's or torchrun's own.

- GPUs: those CUDA_VISIBLE_DEVICES names when set, else the ones `nvidia-smi` lists, else none. --gpus N
  (the inventory's `gpus:`) takes the first N of them and narrows CUDA_VISIBLE_DEVICES to those (their names:
  indices, UUIDs or MIG names as given). --gpu-offset O (a --shard-by gpus shard) takes them from the O-th on.
- --gpus-per-replica (extract): GPUs one model copy is spread over. auto = the smallest count whose
  memory holds the step's --model weights with 25% headroom (its safetensors size); 1 when unknown.
- --nproc-per-node: auto = GPUs // gpus-per-replica (at least 1; 1 on a host without GPUs). A number
  forces it (on CPU too: gloo workers, e.g. for tests). An online train's GPUs are its `train_gpus` when set
  (the split layout: the engine on the others).
- One process on one node: no torchrun at all. Else `--standalone` on one node (a free port per job, so
  two jobs on one host never collide), or c10d rendezvous at --rdzv-endpoint across --nnodes hosts.
- A step that cannot use ranks runs as one process whatever is asked: extract with --engine vllm (vLLM
  spreads over the GPUs itself). So does a step started inside a torchrun worker (RANK set): the outer
  torchrun already owns the ranks. A train gets its ranks whatever its engine setting: online, each group of
  them starts its engine of tp_size GPUs beside them (online_stream.ranks_per_engine).

--print prints the decision as JSON instead of running (for tests and `render`).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from kimi_eagle_host.gpus import cuda_visible_names, gpu_numbers, pick_gpus, query_gpus, visible_names
from kimi_eagle_host.model_size import model_weight_bytes

HEADROOM = 1.25  # weights * this must fit one replica's GPUs (activations, CUDA context, allocator slack)


class LaunchError(ValueError):
    """Bad flags for this host (exit 2, one line naming the flag)."""


def visible_gpus(environ=None) -> list[int]:
    """GPU memory sizes in bytes (or 0 when unknown), one entry per GPU this process may use."""
    env = os.environ if environ is None else environ
    sizes = _nvidia_smi_sizes()
    names = cuda_visible_names(env)
    if names is not None:
        # Sizes by index when the names are indices; UUIDs keep an unknown size.
        return [sizes[int(n)] if n.isdigit() and int(n) < len(sizes) else 0 for n in names]
    return sizes


def _nvidia_smi_sizes() -> list[int]:
    sizes = []
    for total, *_ in query_gpus("memory.total") or []:
        sizes.append(int(float(total)) * 2**20 if total.replace(".", "").isdigit() else 0)
    return sizes


def model_bytes(model: str | None) -> int | None:
    """Size of a local model's weights (as stored, else from its config's dims), None if unknown."""
    if not model or not os.path.isdir(model):
        return None
    return model_weight_bytes(model)[0] or None


def replica_size(setting: str, gpus: list[int], model: str | None) -> int:
    if setting != "auto":
        return int(setting)
    need = model_bytes(model)
    if not gpus or need is None or not all(gpus):
        return 1
    per_gpu = min(gpus)
    return max(1, math.ceil(need * HEADROOM / per_gpu))


def step_flags(argv: list[str], step: str = "extract") -> argparse.Namespace:
    """The step's own --model, --engine, --hidden-states, --train-gpus and --online-engines (argparse rules: the last
    value wins), from its section of the job's settings.json (--settings) where not given as flags."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model")
    p.add_argument("--engine")
    p.add_argument("--backend", dest="engine")  # its old name (the step says so)
    p.add_argument("--hidden-states")
    p.add_argument("--train-gpus")
    p.add_argument("--online-engines", type=int)
    p.add_argument("--settings")
    flags = p.parse_known_args(argv)[0]
    if flags.settings:
        try:
            with open(flags.settings, encoding="utf-8") as f:
                section = json.load(f).get("steps", {}).get(step, {})
        except (OSError, ValueError) as e:
            raise LaunchError(f"--settings {flags.settings}: {e}") from None
        flags.model = flags.model or section.get("model")
        flags.engine = flags.engine or section.get("engine") or section.get("backend")  # a job rendered before
        flags.hidden_states = flags.hidden_states or section.get("hidden_states")
        if flags.train_gpus is None:
            flags.train_gpus = section.get("train_gpus")
        if flags.online_engines is None:
            flags.online_engines = section.get("online_engines")
    return flags


def trainer_gpus(train_gpus, gpus: list[int]) -> list[int] | None:
    """The GPUs an online run's trainer ranks get: `train_gpus` (indices among the visible ones; the split layout,
    the engine on others), None when unset. Only counted here: CUDA_VISIBLE_DEVICES stays whole, since rank 0
    starts the engine on its own GPUs from it and each rank then narrows itself (online_stream.split_gpus)."""
    text = ",".join(map(str, train_gpus)) if isinstance(train_gpus, list) else train_gpus
    try:
        picked = gpu_numbers(train_gpus)
    except ValueError as e:
        raise LaunchError(f"--train-gpus {text}: {e}") from None
    if picked is None:
        return None
    if gpus and max(picked) >= len(gpus):
        raise LaunchError(f"--train-gpus {text}: this host shows {len(gpus)} GPU(s) (numbered from 0)")
    return [gpus[i] for i in picked] if gpus else []


def narrow_gpus(a, gpus: list[int], env) -> tuple[list[int], dict]:
    """(the GPUs the step gets, the env that says so): --gpus N from the --gpu-offset-th on, taken by name among the
    visible ones (a host's CUDA_VISIBLE_DEVICES may reserve GPUs 4-7, or list UUIDs or MIG names: the step gets those
    names, never numbers counted from the machine's first GPU); all of them, env untouched, without either flag."""
    if a.gpus is None and not a.gpu_offset:
        return gpus, {}
    try:
        picked = pick_gpus(visible_names(env, driver_count=len(gpus)), a.gpus, a.gpu_offset)
    except ValueError as e:
        given = f"--gpus {a.gpus}" if a.gpus is not None else ""
        given += f" --gpu-offset {a.gpu_offset}" if a.gpu_offset else " (the inventory's gpus:)"
        raise LaunchError(f"{given.strip()} but {e}") from None
    return gpus[a.gpu_offset:a.gpu_offset + len(picked)], {"CUDA_VISIBLE_DEVICES": ",".join(picked)}


def decide(a, environ=None) -> dict:
    env = os.environ if environ is None else environ
    # The step: `-m MODULE ARGS` (how kimi-eagle starts steps), or a script path `SCRIPT ARGS`.
    n = 2 if a.command[0] in ("-m", "--module") else 1
    script, step_args = a.command[:n], a.command[n:]
    if len(script) < n:
        raise LaunchError("-m needs the step's module after it")
    step = script[-1].rsplit(".", 1)[-1] if n == 2 else os.path.basename(script[0]).removesuffix(".py")
    flags = step_flags(step_args, step)
    gpus, set_env = narrow_gpus(a, visible_gpus(env), env)
    where = f"this host shows {len(gpus)}"
    online_train = step == "train" and flags.hidden_states == "online"
    # the split layout: the trainer's ranks on train_gpus only, not one per visible GPU (two ranks would share the
    # one trainer GPU, the second's cuda:1 not there)
    split = trainer_gpus(flags.train_gpus, gpus) if online_train else None
    if split is not None:
        gpus, where = split, f"--train-gpus gives the trainer {len(split)}"
    single_reason = None
    if flags.engine == "vllm" and step != "train":   # a train's ranks are its own whatever its engine (above)
        single_reason = "--engine vllm: vLLM spreads over the GPUs itself"
    elif "TORCHELASTIC_RUN_ID" in env or "RANK" in env:
        # Already a torchrun worker (a launcher put torchrun in front of us): the outer torchrun owns the
        # ranks; starting another one here would nest process groups.
        single_reason = "already a torchrun worker (RANK is set)"
    per_replica = replica_size(a.gpus_per_replica, gpus, flags.model)
    if per_replica < 1:
        raise LaunchError(f"--gpus-per-replica must be >= 1, got {per_replica}")
    if a.nproc_per_node == "auto":
        nproc = max(1, len(gpus) // per_replica) if gpus else 1
    else:
        nproc = int(a.nproc_per_node)
        if nproc < 1:
            raise LaunchError(f"--nproc-per-node must be >= 1, got {nproc}")
        if gpus and nproc * per_replica > len(gpus):
            raise LaunchError(f"{nproc} processes x {per_replica} GPUs each need {nproc * per_replica} "
                             f"GPUs; {where}")
    if single_reason:
        nproc, nnodes = 1, 1
    else:
        nnodes = a.nnodes
    engines = flags.online_engines
    if online_train and engines and nproc % engines:
        # the step says the same, but from inside torchrun, whose own exit is 1
        raise LaunchError(f"--online-engines {engines}: must divide the host's {nproc} trainer process(es)")
    cmd = [sys.executable]
    if nproc == 1 and nnodes == 1:
        cmd += [*script, *step_args]
        mode = "single"
    else:
        cmd += ["-m", "torch.distributed.run", "--nproc-per-node", str(nproc)]
        if nnodes == 1:
            cmd += ["--standalone"]
            mode = "torchrun"
        else:
            if not a.rdzv_endpoint:
                raise LaunchError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT")
            # No --node-rank: c10d gives node ranks in the rendezvous (is_host=true in --rdzv-conf marks the store).
            cmd += ["--nnodes", str(nnodes), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", a.rdzv_endpoint, "--rdzv-id", a.rdzv_id or "kimi-eagle"]
            cmd += [x for conf in a.rdzv_conf for x in ("--rdzv-conf", conf)]
            mode = "torchrun-multinode"
        if a.max_restarts is not None:
            cmd += ["--max-restarts", str(a.max_restarts)]
        cmd += [*script, *step_args]  # torchrun takes -m MODULE too: each worker runs the step as a module
        if "OMP_NUM_THREADS" not in env:
            # torchrun would give every worker 1 thread; give each its share of the cores instead (batch
            # assembly and tensor copies on the CPU), like the one process it replaces had all of them.
            set_env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    return {"mode": mode, "nproc_per_node": nproc, "nnodes": nnodes, "gpus": len(gpus),
            "gpus_per_replica": per_replica, "reason": single_reason, "env": set_env, "argv": cmd}


def _narrowed(d: dict) -> str:
    """Which GPUs the step got, when launch chose them (the log then says where each shard ran)."""
    cvd = d["env"].get("CUDA_VISIBLE_DEVICES")
    return "" if cvd is None else f", CUDA_VISIBLE_DEVICES={cvd}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=None, help="use N of the visible GPUs (default: all)")
    ap.add_argument("--gpu-offset", type=int, default=0,
                    help="the first of them, counted among the visible ones (a shard's slice; default 0)")
    ap.add_argument("--nproc-per-node", default="auto", help="processes on this host, or auto (default)")
    ap.add_argument("--gpus-per-replica", default="1", help="GPUs per process (extract: auto sizes by the model)")
    ap.add_argument("--nnodes", type=int, default=1)
    ap.add_argument("--rdzv-endpoint", default=None)
    ap.add_argument("--rdzv-id", default=None)
    ap.add_argument("--rdzv-conf", action="append", default=[], help="passed to torchrun (e.g. is_host=true)")
    ap.add_argument("--max-restarts", type=int, default=None)
    ap.add_argument("--print", action="store_true", help="print the decision as JSON, run nothing")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- -m STEP_MODULE [ARGS...] (or a script path)")
    a = ap.parse_args(argv)
    if a.command and a.command[0] == "--":
        a.command = a.command[1:]
    if not a.command:
        ap.error("give the step after --, e.g. launch -- -m kimi_eagle_host.pipeline.train --model M --output-dir OUT")
    for name in ("nproc_per_node", "gpus_per_replica"):
        v = getattr(a, name)
        if v != "auto" and not (v.isascii() and v.isdigit()):
            ap.error(f"--{name.replace('_', '-')}: a number or auto, got {v!r}")
    try:
        d = decide(a)
    except LaunchError as e:
        print(f"launch.py: {e}", file=sys.stderr)
        return 2
    if a.print:
        print(json.dumps(d))
        return 0
    print(f"==> kimi-eagle: {d['mode']}: {d['nproc_per_node']} process(es) per node x {d['nnodes']} node(s), "
          f"{d['gpus_per_replica']} GPU(s) each ({d['gpus']} visible)" + _narrowed(d)
          + (f"; {d['reason']}" if d["reason"] else ""),
          file=sys.stderr, flush=True)
    os.environ.update(d["env"])
    os.execv(d["argv"][0], d["argv"])
    return 127  # not reached


if __name__ == "__main__":
    sys.exit(main())
