"""Another real process holding part of this machine's memory, as another user's job does on a shared host.

vLLM's CPU build asks for 0.92 of the host's memory by default and refuses to start when less is available; with
this held, that default cannot be met here, whatever the rest of the machine is doing.
"""

from __future__ import annotations

import subprocess
import sys
from contextlib import contextmanager

VLLM_CPU_DEFAULT_SHARE = 0.92  # vLLM 0.32's gpu_memory_utilization default, of host memory on its CPU build
HOLD_SHARE = 0.15  # held, so that at most 85 % of the memory is available: below vLLM's default share

# Touches every page (bytes * n fills them), says so, then holds them until its stdin closes.
_HOLDER = "import sys; held = b'\\x01' * int(sys.argv[1]); print('held', flush=True); sys.stdin.read()"


def meminfo() -> tuple[int, int]:
    """(MemAvailable, MemTotal) in bytes, as vLLM's CPU worker reads them."""
    info = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, _, rest = line.partition(":")
            info[name] = int(rest.split()[0]) * 1024
    return info["MemAvailable"], info["MemTotal"]


@contextmanager
def memory_held(share: float = HOLD_SHARE):
    """A separate process holds `share` of the host's memory for the duration; yields (available, total) then."""
    total = meminfo()[1]
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(int(total * share))], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", "the memory holder did not start"
        yield meminfo()
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
