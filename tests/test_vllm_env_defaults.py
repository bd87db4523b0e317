"""vLLM engine environment on hosts without flashinfer (seen on the H200: vLLM 0.25.1's sampler
imports flashinfer's backend at engine start-up unless VLLM_USE_FLASHINFER_SAMPLER=0)."""
import importlib.util

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
