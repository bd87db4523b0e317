"""Where a host's nvidia-smi is: one rule for every step and ops payload that asks the driver; which of the GPUs a
process sees one of several shards takes. Stdlib only.

    python -m kimi_eagle_host.gpus --gpus N [--gpu-offset O] -- COMMAND [ARGS...]

runs COMMAND (an exec shard of a group job) with CUDA_VISIBLE_DEVICES naming N of the GPUs this process sees, from
the O-th on (pick_gpus: what launch.py does for the steps it starts).
"""

from __future__ import annotations

import os
import shutil
import sys

# A non-interactive SSH login may lack the driver's folder on PATH (seen on the H200: /usr/local/nvidia/bin).
NVIDIA_SMI_FALLBACKS = ("/usr/local/nvidia/bin/nvidia-smi", "/usr/bin/nvidia-smi")


def find_nvidia_smi(given: str | None = None) -> str | None:
    """The nvidia-smi to run, or None when there is none.

    `given` (a --nvidia-smi flag): a path, used when it is executable, or a name looked up on PATH. Not given:
    nvidia-smi on PATH, else the first of the driver's usual places that is executable."""
    if given:
        if os.sep in given:
            return given if os.access(given, os.X_OK) else None
        return shutil.which(given)
    return shutil.which("nvidia-smi") or next((p for p in NVIDIA_SMI_FALLBACKS if os.access(p, os.X_OK)), None)


def query_gpus(fields: str, nvidia_smi: str | None = None, timeout: float = 30,
               units: bool = False) -> list[list[str]] | None:
    """`nvidia-smi --query-gpu=FIELDS` as rows of stripped CSV cells (no header; "81559 MiB" with `units`, else
    81559), one row a GPU; None when there is no nvidia-smi or it fails (to the callers: no GPU to tell about)."""
    import subprocess

    exe = find_nvidia_smi(nvidia_smi)
    if not exe:
        return None
    try:
        res = subprocess.run([exe, f"--query-gpu={fields}", "--format=csv,noheader" + ("" if units else ",nounits")],
                             capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    if res.returncode != 0:
        return None
    return [[cell.strip() for cell in line.split(",")] for line in res.stdout.splitlines() if line.strip()]


def cuda_visible_names(environ=os.environ) -> list[str] | None:
    """The GPUs CUDA_VISIBLE_DEVICES names, in its order (indices or UUIDs); None when it is not set; [] when it
    hides every GPU (empty, or a first name starting with "-": CUDA stops reading the list there)."""
    cvd = environ.get("CUDA_VISIBLE_DEVICES")
    if cvd is None:
        return None
    names = [n.strip() for n in cvd.split(",") if n.strip()]
    if names and names[0].startswith("-"):
        return []
    return names[:next((i for i, n in enumerate(names) if n.startswith("-")), len(names))]


def gpu_numbers(given) -> list[int] | None:
    """GPU numbers a setting names (`engine_gpus`, `train_gpus`: a list, or text like "0,1"), each once and from 0;
    None when unset. ValueError says what is wrong (the caller names the setting)."""
    if given in (None, "", []):
        return None
    try:
        gpus = [int(x) for x in (given if isinstance(given, list) else str(given).split(","))]
    except ValueError:
        raise ValueError("expected GPU numbers like 0,1") from None
    if any(g < 0 for g in gpus) or len(set(gpus)) != len(gpus):
        raise ValueError("each GPU once, numbers from 0")
    return gpus


def visible_names(environ=os.environ, driver_count: int | None = None) -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES would name them: its names (indices, UUIDs or MIG
    names) when set, else the driver's indices (`driver_count` of them when the caller asked nvidia-smi already),
    else none."""
    names = cuda_visible_names(environ)
    if names is not None:
        return names
    if driver_count is None:
        driver_count = len(query_gpus("index") or [])
    return [str(i) for i in range(driver_count)]


def pick_gpus(names: list[str], count: int | None, offset: int = 0) -> list[str]:
    """names[offset:offset + count] (count None: to the end): the GPUs one shard takes among those its host's
    process sees. They are taken by name, not by number, so a host whose env reserves GPUs 4-7 (or lists UUIDs)
    keeps its shards on those. ValueError when the slice runs past them (the caller names the flags)."""
    if offset < 0 or (count is not None and count < 0):
        raise ValueError("both count from 0")
    end = len(names) if count is None else offset + count
    if end > len(names) or offset > len(names):
        raise ValueError(f"this host shows {len(names)} GPU(s)")
    return names[offset:end]


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kimi_eagle_host.gpus", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, required=True, help="how many of the visible GPUs COMMAND gets")
    ap.add_argument("--gpu-offset", type=int, default=0, help="the first of them, counted among the visible ones")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    a = ap.parse_args(argv)
    command = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not command:
        ap.error("give the command after --")
    try:
        names = pick_gpus(visible_names(), a.gpus, a.gpu_offset)
    except ValueError as e:
        print(f"gpus: --gpus {a.gpus} --gpu-offset {a.gpu_offset}: {e}", file=sys.stderr)
        return 2
    os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(names)
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"gpus: cannot run {command[0]}: {e}", file=sys.stderr)
        return 127


if __name__ == "__main__":
    sys.exit(main())
