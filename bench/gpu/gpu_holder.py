#!/usr/bin/env python3
"""Hold N GiB of GPU memory until killed (a stand-in for a crashed vLLM worker).

Used by bench/gpu/gpu_reset_h200.sh. Writes --ready-file once the memory is allocated and
touched, so the caller knows nvidia-smi will show it.
"""

import argparse
import os
import signal
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=8.0, help="GiB to allocate on the GPU")
    p.add_argument("--device", type=int, default=0, help="CUDA device index")
    p.add_argument("--new-session", action="store_true",
                   help="call setsid() first, so pgid == pid (how the controller starts a job)")
    p.add_argument("--ignore-term", action="store_true", help="ignore SIGTERM (forces SIGKILL)")
    p.add_argument("--ready-file", required=True, help="written once the memory is held")
    args = p.parse_args()

    if args.new_session:
        try:
            os.setsid()
        except PermissionError:
            pass  # already a process-group leader: pgid == pid, which is all we need
    if args.ignore_term:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)

    import torch  # imported after setsid so the whole process lives in its new session

    n = int(args.gib * (1 << 30))
    buf = torch.empty(n, dtype=torch.uint8, device=f"cuda:{args.device}")
    buf.fill_(1)  # touch every page so the memory is really committed
    torch.cuda.synchronize()
    tmp = args.ready_file + ".tmp"
    with open(tmp, "w") as f:
        f.write(f"{os.getpid()} {os.getpgid(0)} {n}\n")
    os.replace(tmp, args.ready_file)
    print(f"holding {args.gib} GiB on cuda:{args.device} (pid {os.getpid()}, pgid {os.getpgid(0)})",
          file=sys.stderr, flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    sys.exit(main())
