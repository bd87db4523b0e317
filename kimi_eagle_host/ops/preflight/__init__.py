"""Pre-flight checks for a pipeline step host side.

Catches in seconds, without loading any weights, what would otherwise fail only after a
27-minute model load: wrong package versions or an unapplied patch, a bad model path or
layer ids, too little GPU memory or disk, a malformed dataset, a GPU lock held by another job.

Each check gives {name, status: pass|warn|fail, detail, fix}. One JSON document on stdout
({checks, ok, ...}); exit 1 when any check fails, 2 on bad usage.

Run as `python -m kimi_eagle_host.ops.preflight` (__main__.py). The checks live by concern: packages (Python,
versions, compatibility, patch, serving, trainer), model (config, layer ids, size, engine memory), gpu (memory),
gpu_lock (who holds the GPUs), dataset (the data and a step's inputs), storage (disk and the storage plan);
report holds what a check returns, cli the flags and the order of the checks.
"""

from kimi_eagle_host.ops.preflight.cli import build_parser, main, run_checks
from kimi_eagle_host.ops.preflight.packages import COMPAT_TABLE, compat_row

__all__ = ["COMPAT_TABLE", "build_parser", "compat_row", "main", "run_checks"]
