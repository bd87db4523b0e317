"""How many threads a torch step computes with on a CPU host: one, for a tiny target.

torch starts one intra-op thread per core. A tiny target's operations (the demo's: hidden size 64, many small MoE
operations) last microseconds, and more threads only wait on each other. On the 2-core box (bench/cpu_threads.py, a
forward of 4 x 100 tokens) two threads took 1.15x the time of one through the demo's target, at 2.3x the CPU time,
and 2.89x while another process held a core, as the controller, an engine beside a trainer or another job do. From a
hidden size of 256 a second thread pays on an idle box (a Llama of that size 0.55x, SmolLM2-135M's shape 0.91x), so
larger targets keep torch's choice.
An OMP_NUM_THREADS the user set, or a step's own threads setting, is kept.
"""
from __future__ import annotations

import os

SMALL_HIDDEN = 256
_explicit = False


def set_threads(n: int) -> None:
    """A step's own threads setting (0: torch's default): kept, whatever `fit` would choose."""
    global _explicit
    if n:
        import torch

        torch.set_num_threads(n)
        _explicit = True


def fit(hidden_size, device_type: str, log) -> None:
    """One thread on a CPU for a target whose hidden size is below SMALL_HIDDEN, said in one line."""
    if _explicit or device_type != "cpu" or not isinstance(hidden_size, int) or hidden_size >= SMALL_HIDDEN:
        return
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    if torch.get_num_threads() > 1:
        torch.set_num_threads(1)
        log(f"cpu: one thread for a target of hidden size {hidden_size} (below {SMALL_HIDDEN}, more threads only "
            "wait on each other; OMP_NUM_THREADS overrides)")
