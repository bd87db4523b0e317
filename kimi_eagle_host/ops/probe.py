#!/usr/bin/env python3
"""What a host has: Python, torch (and its CUDA), transformers, vllm, speculators, GPUs.

Runs under the host's own Python with the stdlib only and imports none of those packages
(importing vLLM takes seconds and may fail): versions come from package metadata.
Prints one JSON document on stdout.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import subprocess
import sys
from importlib import metadata

from kimi_eagle_host.gpus import find_nvidia_smi

PACKAGES = ("torch", "transformers", "safetensors", "vllm", "speculators")


def package_versions():
    out = {}
    for name in PACKAGES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def torch_cuda():
    """torch's CUDA version, read from torch/version.py without importing torch."""
    try:
        dist = metadata.distribution("torch")
        text = open(dist.locate_file("torch/version.py")).read()
    except Exception:
        return None
    m = re.search(r"^cuda\s*(?::\s*\S+)?\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    return m.group(1) if m else None


def gpus(nvidia_smi=None):
    exe = find_nvidia_smi(nvidia_smi)
    if not exe:
        return None, "nvidia-smi not found"
    try:
        res = subprocess.run(
            [exe, "--query-gpu=index,name,memory.used,memory.total,driver_version", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=20,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"nvidia-smi failed: {e}"
    if res.returncode != 0:
        return None, (res.stderr.strip() or res.stdout.strip() or f"nvidia-smi exited {res.returncode}").splitlines()[-1]
    found = []
    for line in res.stdout.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) >= 5 and parts[0].isdigit():
            found.append({"index": int(parts[0]), "name": parts[1], "memory_used_mib": mib(parts[2]),
                          "memory_total_mib": mib(parts[3]), "driver": parts[4]})
    return found, None


def mib(cell: str) -> int | None:
    """A memory cell of nvidia-smi, None where it has no figure: `[N/A]` or `[Not Supported]` on GPUs that share
    the host's memory (GB10, Grace Hopper); the GPU is there all the same."""
    try:
        return int(float(cell))
    except ValueError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvidia-smi", default=None,
                    help="nvidia-smi binary (default: from PATH, else the driver's usual folders)")
    args = ap.parse_args(argv)
    found, note = gpus(args.nvidia_smi)
    result = {
        "python": platform.python_version(),
        "executable": sys.executable,
        "platform": platform.platform(),
        "packages": package_versions(),
        "torch_cuda": torch_cuda(),
        "gpus": found,
        "gpu_note": note,
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
