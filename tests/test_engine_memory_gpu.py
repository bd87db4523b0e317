"""The vLLM engine's GPU memory share (vllm_compat.engine_memory) on a GPU that another process partly holds.

vLLM's default asks for 0.9 of the GPU and dies at start-up when less is free. The share is sized from what is free
at start instead; a value the user set wins; a GPU with too little free is one clear error. The GPU's answer
(torch.cuda.mem_get_info) is the one input that needs a GPU, so it is passed in here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "remote_payloads"))
from vllm_compat import engine_memory  # noqa: E402

GIB = 1 << 30
H200 = 141 * GIB


def test_idle_gpu_keeps_the_default_share():
    m = engine_memory(2 * GIB, gpu_free_total=(H200 - GIB // 2, H200), environ={})
    assert m["kwargs"] == {"gpu_memory_utilization": 0.9} and m["env"] == {}


def test_busy_gpu_gets_what_is_free_not_the_default():
    free = int(H200 * 0.6)  # another process holds 40 %
    m = engine_memory(2 * GIB, gpu_free_total=(free, H200), environ={})
    share = m["kwargs"]["gpu_memory_utilization"]
    assert share * H200 <= free and share == pytest.approx(0.58, abs=1e-3)
    assert "of the GPU" in m["says"] and "free at start" in m["says"]


def test_the_users_share_wins():
    m = engine_memory(2 * GIB, gpu_free_total=(H200 // 2, H200), environ={"KIMI_EAGLE_GPU_MEMORY_UTILIZATION": "0.3"})
    assert m["kwargs"] == {"gpu_memory_utilization": 0.3}


def test_too_little_free_is_one_line():
    with pytest.raises(ValueError) as e:
        engine_memory(8 * GIB, gpu_free_total=(5 * GIB, H200), environ={})
    assert "\n" not in str(e.value) and "GiB free" in str(e.value)


@pytest.mark.parametrize("value", ["half", "0", "1.5"])
def test_a_share_the_user_set_that_is_no_fraction_is_one_line(value):
    with pytest.raises(ValueError) as e:
        engine_memory(2 * GIB, gpu_free_total=(H200, H200), environ={"KIMI_EAGLE_GPU_MEMORY_UTILIZATION": value})
    assert "\n" not in str(e.value) and f"KIMI_EAGLE_GPU_MEMORY_UTILIZATION={value!r}" in str(e.value)
