"""A tiny target computes with one thread on a CPU host: its operations last microseconds and more threads only wait on
each other (the demo's target 2.9x slower with two threads than with one on the 2-core box while another
process held a core, bench/cpu_threads.py). A larger target, a user's
OMP_NUM_THREADS and a step's own threads setting keep torch's choice."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from kimi_eagle_host import cpu_threads
from conftest import STEP_ENV


@pytest.fixture
def threads(monkeypatch):
    """torch's thread count at 2 with no OMP_NUM_THREADS set, put back after the test (the worker shares it)."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu_threads, "_explicit", False)
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_tiny_target_on_a_cpu_gets_one_thread_and_says_so(threads):
    said = []
    cpu_threads.fit(64, "cpu", said.append)
    assert torch.get_num_threads() == 1
    assert len(said) == 1 and "one thread" in said[0] and "OMP_NUM_THREADS" in said[0]


@pytest.mark.parametrize("hidden, device", [(256, "cpu"), (7168, "cpu"), (64, "cuda"), (None, "cpu")])
def test_a_larger_target_or_a_gpu_keeps_torchs_threads(threads, hidden, device):
    said = []
    cpu_threads.fit(hidden, device, said.append)
    assert torch.get_num_threads() == 2 and said == []


def test_the_users_omp_num_threads_and_the_steps_threads_setting_are_kept(threads, monkeypatch):
    said = []
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    cpu_threads.fit(64, "cpu", said.append)
    assert torch.get_num_threads() == 2 and said == []
    monkeypatch.delenv("OMP_NUM_THREADS")
    cpu_threads.set_threads(2)
    cpu_threads.fit(64, "cpu", said.append)
    assert torch.get_num_threads() == 2 and said == []


LOAD = """
import sys, torch
from transformers import LlamaConfig, LlamaForCausalLM
from kimi_eagle_host.target.hf_target import load_model
hidden = int(sys.argv[1])
LlamaForCausalLM(LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=4, vocab_size=256)).save_pretrained(sys.argv[2])
torch.set_num_threads(2)
load_model(sys.argv[2], torch.float32, "cpu", 1)
print(torch.get_num_threads())
"""


@pytest.mark.parametrize("hidden, threads_after", [(64, 1), (256, 2)])
def test_a_step_that_loads_a_target_on_the_cpu_sizes_its_threads_by_it(tmp_path, hidden, threads_after):
    env = {k: v for k, v in STEP_ENV.items() if k != "OMP_NUM_THREADS"}
    r = subprocess.run([sys.executable, "-c", LOAD, str(hidden), str(tmp_path / "model")], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert int(r.stdout.split()[-1]) == threads_after
    assert ("cpu: one thread for a target of hidden size 64" in r.stderr) == (threads_after == 1)
