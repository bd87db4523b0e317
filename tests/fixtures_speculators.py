"""Fixtures for tests/test_patch_engine.py: real speculators wheels in throwaway --target dirs; and a stand-in for
speculators' trainer (it needs CUDA) for the train step's tests.

The wheels are fetched with `pip download --no-deps` once per session (reusing
/tmp/specwheels when a previous run left them there), installed once into a golden
--target dir per version, and copied per test so every test starts from a pristine install.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE = ["-m", "kimi_eagle_host.ops.deploy_patch"]  # after a Python, with this checkout on PYTHONPATH
PATCH_DIR = REPO / "kimi_eagle_host" / "patch_sets"
WHEEL_CACHE = Path("/tmp/specwheels")
VERSIONS = ("0.3.0", "0.4.0", "0.9.0")  # 0.9.0: a release no patch set covers
TARGETS = ("speculators/data_generation/custom_worker.py",
           "speculators/data_generation/vllm_hidden_states_generator.py")


def _wheel(version: str, dest: Path) -> Path:
    for folder in (WHEEL_CACHE, dest):
        found = sorted(folder.glob(f"speculators-{version}-*.whl")) if folder.is_dir() else []
        if found:
            return found[0]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest),
                    f"speculators=={version}"], check=True)
    return sorted(dest.glob(f"speculators-{version}-*.whl"))[0]


@pytest.fixture(scope="session")
def golden_installs(tmp_path_factory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("spec")
    out = {}
    for v in VERSIONS:
        wheel = _wheel(v, base / "wheels")
        target = base / f"golden-{v}"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                        "--disable-pip-version-check", "--target", str(target), str(wheel)],
                       check=True)
        out[v] = target
    return out


@pytest.fixture
def install(golden_installs, tmp_path):
    """install(version) -> a fresh private copy of that speculators install."""
    count = iter(range(1000))

    def make(version: str) -> Path:
        dest = tmp_path / f"site-{version}-{next(count)}"
        shutil.copytree(golden_installs[version], dest)
        return dest
    return make


def run_engine(site: Path, *args: str, env: dict | None = None) -> tuple[int, dict | None, str]:
    """Run the engine as the host would: its Python, the install on PYTHONPATH."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_EAGLE")}
    full_env["PYTHONPATH"] = os.pathsep.join([str(site), str(REPO)])
    full_env.update(env or {})
    proc = subprocess.run([sys.executable, *ENGINE, *args], capture_output=True, text=True,
                          env=full_env, timeout=60)
    import json
    doc = json.loads(proc.stdout) if proc.stdout.strip() else None
    return proc.returncode, doc, proc.stderr


def tree_hashes(site: Path) -> dict[str, str]:
    """sha256 of every file under the install (pyc caches aside)."""
    return {str(p.relative_to(site)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(site.rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


def speculators_trainer_stand_in(monkeypatch, trains) -> None:
    """speculators' trainer, which needs CUDA, replaced in this process by `trains(argv)` (it writes what speculators
    writes under --save-path), with torch told a GPU is there: the train step around it runs as it does on a GPU host
    (the real trainer on the GPU machine: bench/gpu/spec_step_smoke.sh)."""
    import types

    import torch

    from kimi_eagle_host.training import spec_trainer

    cli, config = types.ModuleType("speculators.train.cli"), types.ModuleType("speculators.train.config")
    cli.main, config.TrainConfig = trains, types.SimpleNamespace(resolve=lambda argv: argv)
    for name, module in {"speculators": types.ModuleType("speculators"), "speculators.train":
                         types.ModuleType("speculators.train"), "speculators.train.cli": cli,
                         "speculators.train.config": config}.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(spec_trainer, "installed_version", lambda: "0.9.0")
    monkeypatch.setattr(spec_trainer, "known_flags", lambda: None)
    monkeypatch.setattr(spec_trainer, "write_rows", lambda files, dest: os.makedirs(dest))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 0)
