"""The compute dtype of a torch step (`dtype: auto` resolved), and why bfloat16 is not always the fast one on a CPU.

On a GPU bfloat16 is the choice. On a CPU it depends on the CPU: one with AMX or AVX512-BF16 multiplies bf16
natively (on the Intel box the CPU recipe was measured on, 5.9x float32's GFLOP/s), one without converts every
element in software (on an AVX2-only AMD EPYC box, 0.9 against float32's 88 GFLOP/s: 100x slower). `auto` stays
float32 on every CPU (safe everywhere; the tests' fp32 references rely on it); a bfloat16 asked for on a CPU
without native support is kept and said in one line, and `cpu_computes_bf16` tells a recipe or a benchmark which
to ask for.

vLLM's serving engines (regenerate, eval, choose: `vllm_dtype`) follow the same rule through `for_vllm`: `auto` is
bfloat16, except on a CPU without a bf16 matrix instruction, where it is float32. On the AVX2 box vLLM 0.32's CPU
kernels answered 26.0 tokens/s in bfloat16 against 112.4 in float32 (SmolLM2-135M, 64 ShareGPT first turns, two
threads; bench/vllm_cpu_dtype.py): CI's box turned out to be such a CPU, and the quality test's regenerate ran out
of its 20 minutes. Extraction keeps bfloat16 in vLLM everywhere: its hidden states are the training data, stored as
a GPU run would store them.
"""
from __future__ import annotations

NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def cpu_computes_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU has a bfloat16 matrix instruction (AMX or AVX512-BF16), from the kernel's flags."""
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("flags"):
                    return any(flag in line.split() for flag in NATIVE_BF16_FLAGS)
    except OSError:
        pass
    return False


def resolve(dtype: str, device_type: str, log=None, cpuinfo: str = "/proc/cpuinfo", name: str = "dtype") -> str:
    """`float32` or `bfloat16` for a torch step on `device_type` ('cuda' or 'cpu'): auto is bf16 on CUDA, fp32 on
    a CPU; an explicit bfloat16 on a CPU without native support is kept, and said through `log` (`name`: the
    setting, in that line)."""
    if dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    if dtype == "bfloat16" and device_type == "cpu" and log is not None and not cpu_computes_bf16(cpuinfo):
        log(f"{name} bfloat16 on a CPU without AMX or AVX512-BF16: its matrix products run in software, several "
            f"times slower than float32 (torch's ~100x, vLLM's ~4.3x; {name} float32 or auto: float32 here)")
    return dtype


def for_vllm(dtype: str, log=None, cpuinfo: str = "/proc/cpuinfo") -> str:
    """The dtype a serving vLLM engine is started with, from `vllm_dtype`: auto is bfloat16 on a GPU and on a CPU
    that multiplies bf16 natively, float32 on any other CPU; anything else is vLLM's to read, kept (bfloat16 on a
    CPU without native support said through `log`). The engine's device is torch's: vLLM's CPU build has no CUDA."""
    import torch

    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        return "bfloat16" if device_type == "cuda" or cpu_computes_bf16(cpuinfo) else "float32"
    return resolve(dtype, device_type, log, cpuinfo, name="vllm_dtype")
