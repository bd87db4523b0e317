"""Shared fixtures: a real sshd on 127.0.0.1, inventories pointing at it, and a CLI runner."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(REPO))  # this checkout's kimi_eagle and kimi_eagle_host, not an installed copy
# Every subprocess of a test finds them too: the host package runs as `python -m kimi_eagle_host.<module>`.
os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
HOST_PACKAGE = REPO / "kimi_eagle_host"
# One OpenMP thread per process (torch's intra-op threads): the suite runs several processes at once (xdist workers,
# a job's ranks, an engine beside its trainer) on a few cores, and the threads of a process whose cores are taken
# spin waiting for each other. A tiny model's training steps took 15x the CPU time with 2 threads than with 1 on the
# busy 2-core box (and 8x the wall time). The sshd gives its sessions the same (tests/sshd.py); a test that wants
# more threads says so (the quality run's SmolLM2 steps).
os.environ.setdefault("OMP_NUM_THREADS", "1")
# vLLM's CPU build pins an engine's threads to cores it picks (on 2 cores: the same one for every engine, the other
# kept for its front end), so engines started by several workers at once would share one core; unpinned, they follow
# OMP_NUM_THREADS like the rest.
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import spread  # noqa: E402
from levels import INTEGRATION, MISFILED, UNIT, level_of  # noqa: E402
# Fixtures of several modules, defined here once: a session-scoped fixture that modules import by name is set up
# again in each of them (pytest keeps one per definition site).
from fixtures_speculators import golden_installs, install  # noqa: E402,F401
from sshd import Sshd  # noqa: E402


def pytest_configure(config):
    global _CONFIG
    _CONFIG = config
    # The machine's claims and GPU lock (ops/machine_claims.py) live per user, in ~/.cache; a test session keeps
    # its own, so that it neither sees nor blocks another session's jobs. Local hosts and the CLI inherit it;
    # the sshd sets the same for its sessions (tests/sshd.py).
    import tempfile

    # Under pytest-xdist each worker is a session of its own (its jobs and GPU claims must not meet another
    # worker's), so the controller, which runs no test, makes none: the workers would inherit it.
    xdist_controller = getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")
    if "KIMI_EAGLE_MACHINE_DIR" not in os.environ and not xdist_controller:
        config._kimi_eagle_machine_dir = os.environ["KIMI_EAGLE_MACHINE_DIR"] = tempfile.mkdtemp(
            prefix="kimi-eagle-machine-")


def pytest_unconfigure(config):
    import shutil

    made = getattr(config, "_kimi_eagle_machine_dir", None)
    if made:
        shutil.rmtree(made, ignore_errors=True)


# A test slower than this says so as it ends, with the time since the session began: a CI log cut off by its time
# limit still shows where the time went (pytest's --durations prints only at the end).
SLOW_TEST_S = 60.0
_SESSION_START = time.monotonic()
_CONFIG = None


def pytest_runtest_logreport(report):
    reporter = _CONFIG and _CONFIG.pluginmanager.get_plugin("terminalreporter")
    if report.when == "teardown" or report.duration < SLOW_TEST_S or not reporter:
        return
    reporter.write_line(f"\n[slow] {report.nodeid} ({report.when}): {report.duration:.0f} s "
                         f"(at {(time.monotonic() - _SESSION_START) / 60:.1f} min)")


@pytest.fixture(scope="session")
def trained(tmp_path_factory):
    """One full training run on the plain target (test_train.train_once), read by test_train and test_spec_trainer."""
    from test_train import train_once

    return train_once(tmp_path_factory)


@pytest.fixture(scope="session")
def speculators_site(tmp_path_factory):
    """speculators 0.9.0 in a throwaway --target dir (test_train.install_speculators_09)."""
    from test_train import install_speculators_09

    return install_speculators_09(tmp_path_factory)


def host_cmd(module: str, *args, python=None) -> list[str]:
    """Run a module of the host package as a host does: `python -m kimi_eagle_host.<module> ARGS`."""
    return [str(python or sys.executable), "-m", f"kimi_eagle_host.{module}", *map(str, args)]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    return spread.make_scheduler(config, log) if config.option.dist == "loadgroup" else None


def pytest_collection_modifyitems(config, items):
    """Marks every test `unit`, `integration` or `e2e` from tests/levels.py (tests/test_levels.py fails for a test
    file that has no level there). A test the table calls unit but that starts the sshd runs as integration, so the
    unit run stays fast, and tests/test_levels.py names it (levels.MISFILED)."""
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        level = level_of(Path(str(item.fspath)).name, getattr(item, "originalname", item.name), markers)
        if level is None:
            continue
        if level == UNIT and "sshd" in item.fixturenames:
            MISFILED.append(item.nodeid)
            level = INTEGRATION
        item.add_marker(getattr(pytest.mark, level))


@pytest.fixture(scope="session")
def sshd(tmp_path_factory):
    server = Sshd(tmp_path_factory.mktemp("sshd")).start()
    yield server
    server.stop()


# The pipeline on a tiny random Kimi-style model and the bundled sample chats (CPU, seconds per step).
# The sample chats, and the environment a host step runs in when a test starts it directly (quiet, offline, one
# thread each: the box has 2 cores).
SAMPLE_CHAT = os.path.join(REPO, "kimi_eagle_host", "sample_data", "chat.jsonl")
STEP_ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_VERBOSITY": "error", "PYTHONPATH": str(REPO)}


TINY_PIPELINE = """pipeline:
  tiny_model: kimi
  model: "{workdir}/models/tiny"
  dataset: "{payloads}/sample_data/chat.jsonl"
  backend: hf
  seq_len: 64
  batch_size: 4
"""


@dataclass
class CLIResult:
    code: int
    stdout: str
    stderr: str

    def json(self):
        return json.loads(self.stdout)


@dataclass
class Env:
    """One test's world: a client HOME, an inventory file, a workdir on the (loopback) host."""

    root: Path
    home: Path
    inventory: Path
    workdir: Path
    sshd: Sshd | None = None

    def cli(self, *args, timeout=300, env=None, input=None, under_bash=False) -> CLIResult:
        """under_bash: the CLI as a child of a bash, as at a prompt (what Typer's shell detection looks for)."""
        e = {**os.environ, "HOME": str(self.home), "NO_COLOR": "1", "COLUMNS": "200", "PYTHONPATH": str(REPO)}
        e.pop("KIMI_EAGLE_INVENTORY", None)
        e.update(env or {})
        argv = [sys.executable, "-m", "kimi_eagle", "--inventory", str(self.inventory), *args]
        p = subprocess.run(
            ["bash", "-c", '"$@"; exit $?', "bash", *argv] if under_bash else argv,
            capture_output=True, text=True, env=e, timeout=timeout, input=input, cwd=self.root,
        )
        return CLIResult(p.returncode, p.stdout, p.stderr)

    def write_inventory(self, text: str) -> Path:
        self.inventory.write_text(textwrap.dedent(text))
        return self.inventory


def make_env(tmp_path: Path, sshd: Sshd | None, *, trusted: bool = True, host_env: dict | None = None, extra: str = "",
             python: str | None = None) -> Env:
    """python: the ssh host's interpreter (default: this one), e.g. a vLLM env from tests/vllm_envs.py."""
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    workdir = tmp_path / "hostwork"
    env = Env(tmp_path, home, tmp_path / "inventory.yaml", workdir, sshd)
    known = tmp_path / "known_hosts"
    known.write_text(sshd.host_key_line() if (sshd and trusted) else "")
    host_env = host_env or {}
    ssh_host = ""
    if sshd:
        ssh_host = f"""
  gpu:
    address: 127.0.0.1
    port: {sshd.port}
    user: root
    identity_file: {sshd.client_key}
    python: {python or sys.executable}
    workdir: {workdir}
    known_hosts: {known}
    env: {json.dumps({"PYTHONPATH": str(REPO), **host_env})}"""
    env.write_inventory(
        f"""hosts:{ssh_host}
  local:
    transport: local
    python: {sys.executable}
    workdir: {tmp_path / "localwork"}
{extra}"""
    )
    return env


@pytest.fixture
def fake_gpus(tmp_path):
    """An nvidia-smi on PATH that reports GPUs of the given sizes (MiB), like the real one: {"PATH": ...} for the
    environment of a launch (kimi_eagle_host.pipeline.launch) that should see them."""
    def make(*mib):
        bin_dir = tmp_path / "bin"
        bin_dir.mkdir(exist_ok=True)
        tool = bin_dir / "nvidia-smi"
        tool.write_text("#!/bin/sh\n" + "".join(f"echo {m}\n" for m in mib))
        tool.chmod(0o755)
        return {"PATH": f"{bin_dir}:{os.environ['PATH']}"}
    return make


@pytest.fixture
def env(tmp_path, sshd):
    return make_env(tmp_path, sshd)


def add_workdir_host(env: Env, name: str, workdir: Path) -> Env:
    """Another host entry for the same sshd (same machine, same user) with its own workdir."""
    text = env.inventory.read_text()
    block = text[text.index("\n  gpu:\n"):text.index("\n  local:\n")]
    clone = block.replace("\n  gpu:\n", f"\n  {name}:\n").replace(f"workdir: {env.workdir}", f"workdir: {workdir}")
    env.inventory.write_text(text.replace("\n  local:\n", clone + "\n  local:\n", 1))
    return env


def one_line_usage_error(r: CLIResult) -> str:
    """Bad input: exit 2 and exactly one line on stderr, no traceback. Returns the line."""
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.code == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (r.code, r.stdout, r.stderr)
    return lines[0]


def write_fake_export(env: Env, model: str, size: int = 64) -> Path:
    """A stand-in draft export under the env's output dir (config.json naming `model`, a zero-filled safetensors
    file): enough for what `run train|all` prints at the end, nothing that loads."""
    import json

    export = env.workdir / "out" / "draft" / "export"
    export.mkdir(parents=True)
    (export / "config.json").write_text(json.dumps({
        "architectures": ["Eagle3DraftModel"], "draft_vocab_size": 256, "eagle_aux_hidden_state_layer_ids": [2, 4, 5],
        "speculators_config": {"verifier": {"name_or_path": model}}}))
    (export / "model.safetensors").write_bytes(b"\0" * size)
    return export


def touch_weights(model: Path) -> None:
    """The same weights with a new mtime: what a download again, or a copy without -p, leaves."""
    weights = next(Path(model).glob("*.safetensors"))
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
