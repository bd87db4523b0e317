"""vLLM engine environment on hosts without flashinfer (seen on the H200: vLLM 0.25.1's sampler
imports flashinfer's backend at engine start-up unless VLLM_USE_FLASHINFER_SAMPLER=0), and vLLM 0.32's CPU
worker meeting llvmlite's library object as it starts."""
import importlib.util
import os
import subprocess

import pytest

from kimi_eagle_host import vllm_compat


def test_without_flashinfer_the_sampler_flag_is_off(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    env = {}
    assert vllm_compat.engine_env_defaults(env) == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    assert env["VLLM_USE_FLASHINFER_SAMPLER"] == "0"


def test_a_value_the_user_set_wins_and_flashinfer_hosts_are_left_alone(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a))
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "1"}
    assert vllm_compat.engine_env_defaults(env) == {} and env["VLLM_USE_FLASHINFER_SAMPLER"] == "1"
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    env = {}
    assert vllm_compat.engine_env_defaults(env) == {} and env == {}


GUARD_SCAN = """
import sys
import numba  # noqa: F401 - what vLLM's Kimi-K2.5 image processor imports as the model's config is read
if sys.argv[1] == "guarded":
    from kimi_eagle_host.vllm_compat import engine_env_defaults
    engine_env_defaults()
from vllm.platforms import current_platform
current_platform.register_triton_kernel_overrides()  # what a CPU engine's worker runs as it starts
print("scanned")
"""


@pytest.mark.vllm
def test_a_cpu_engine_starts_with_numba_loaded():
    """vLLM 0.32's CPU worker scans every loaded module with vars() as it starts; with numba loaded (a Kimi-K2.5
    target's processor imports it) llvmlite's library object answered `__dict__` and the scan died, so eval of a
    Kimi-K2.5 target on a CPU host failed. engine_env_defaults (every engine step calls it first) prevents that."""
    from conftest import REPO
    from vllm_envs import env_python

    py = env_python("0.32.0")   # the scan is 0.32's CPU worker's, whatever KE_VLLM_VERSION says
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    bare = subprocess.run([str(py), "-c", GUARD_SCAN, "bare"], capture_output=True, text=True, env=env, timeout=300)
    guarded = subprocess.run([str(py), "-c", GUARD_SCAN, "guarded"], capture_output=True, text=True, env=env,
                             timeout=300)
    assert guarded.returncode == 0 and guarded.stdout.strip() == "scanned", guarded.stderr[-2000:]
    # the failure it prevents, as the unguarded engine met it (gone once vLLM or llvmlite fix theirs)
    assert bare.returncode == 0 or "'_lib_fn_wrapper' object has no attribute 'get'" in bare.stderr, bare.stderr[-2000:]
