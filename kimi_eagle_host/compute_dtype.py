"""The compute dtype of a torch step (`dtype: auto` resolved), and why bfloat16 is not always the fast one on a CPU.

On a GPU bfloat16 is the choice. On a CPU it depends on the CPU: one with AMX or AVX512-BF16 multiplies bf16
natively (on the Intel box the CPU recipe was measured on, 5.9x float32's GFLOP/s), one without converts every
element in software (on an AVX2-only AMD EPYC box, 0.9 against float32's 88 GFLOP/s: 100x slower). `auto` stays
float32 on every CPU (safe everywhere; the tests' fp32 references rely on it); a bfloat16 asked for on a CPU
without native support is kept and said in one line, and `cpu_computes_bf16` tells a recipe or a benchmark which
to ask for. vLLM's own CPU kernels are another matter (its engines keep `vllm_dtype`).
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


def resolve(dtype: str, device_type: str, log=None, cpuinfo: str = "/proc/cpuinfo") -> str:
    """`float32` or `bfloat16` for a torch step on `device_type` ('cuda' or 'cpu'): auto is bf16 on CUDA, fp32 on
    a CPU; an explicit bfloat16 on a CPU without native support is kept, and said through `log`."""
    if dtype == "auto":
        return "bfloat16" if device_type == "cuda" else "float32"
    if dtype == "bfloat16" and device_type == "cpu" and log is not None and not cpu_computes_bf16(cpuinfo):
        log("dtype bfloat16 on a CPU without AMX or AVX512-BF16: its matrix products run in software, "
            "~100x slower than float32 on such a CPU (dtype float32 or auto: float32 here)")
    return dtype
