"""A tiny DDP training run for the multi-node tests: gloo on CPU, ranks from torchrun's environment.

Each rank trains a small linear model on its own slice of a fixed random dataset; DDP averages the
gradients, so every rank ends with the same weights. Prints world size, rank and a checksum of the weights.
Writes `ddp-rank{RANK}.json` into --out when given.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--out")
    ap.add_argument("--sleep", type=float, default=0.0, help="seconds per step (to have time to stop it)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ["LOCAL_RANK"])
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(8, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64 * world, 8, generator=g)
    y = x.sum(dim=1, keepdim=True)
    mine = slice(rank * 64, (rank + 1) * 64)
    for step in range(args.steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()
        opt.step()
        if args.sleep:
            time.sleep(args.sleep)
    checksum = float(sum(p.detach().double().sum() for p in model.parameters()))
    print(f"ddp rank {rank}/{world} local {local} loss {loss.item():.4f} checksum {checksum:.10f}", flush=True)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, f"ddp-rank{rank}.json"), "w") as f:
            json.dump({"rank": rank, "world": world, "checksum": checksum, "loss": loss.item()}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
