"""How many threads a torch step computes with on a CPU host: one, for a tiny target.

torch starts one intra-op thread per core. A tiny target's operations (the demo's: hidden size 64, many small MoE
operations) last microseconds, and more threads only wait on each other. On the 2-core box, a forward of 4 x 100
tokens through the demo's target took 20-22 ms with one thread and 21-26 ms with two (at twice the CPU time) on the
idle box, and 67-72 ms with two against 19-20 ms with one while another process held a core: a step rarely has the
cores to itself (the controller, an engine beside a trainer, other jobs). From a hidden size of 256, more threads
win: a forward of 100 tokens through a Llama of that size took 33 ms with one thread against 25 ms with two, and at
SmolLM2-135M's shape 439 ms against 291 ms.
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
    if _explicit or device_type != "cpu" or not hidden_size or hidden_size >= SMALL_HIDDEN:
        return
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    if torch.get_num_threads() > 1:
        torch.set_num_threads(1)
        log(f"cpu: one thread for a target of hidden size {hidden_size} (below {SMALL_HIDDEN}, more threads only "
            "wait on each other; OMP_NUM_THREADS overrides)")


def hidden_size_of(config) -> int | None:
    """The text model's hidden size of a transformers config (a multimodal wrapper nests it in text_config)."""
    text = getattr(config, "text_config", None) or config
    return getattr(text, "hidden_size", None)
