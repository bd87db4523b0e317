"""train's optimizers (AdamW, or Muon with AdamW) behind one interface, and its learning-rate schedule."""
from __future__ import annotations

import contextlib
import math

import torch

from kimi_eagle_host import compute_dtype
from kimi_eagle_host.step_runtime import BadInput


def lr_at(step: int, total: int, args) -> float:
    """LR for optimizer step `step` (0-based): linear warmup, then cosine to 10%, linear to 0, or constant."""
    if args.warmup_steps and step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    if args.lr_schedule == "constant" or total <= args.warmup_steps:
        return args.lr
    t = min((step - args.warmup_steps) / max(1, total - args.warmup_steps), 1.0)
    if args.lr_schedule == "linear":
        return args.lr * (1.0 - t)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


class Optimizers:
    """One optimizer or two (Muon on weight matrices + AdamW on the rest) behind one interface: param_groups
    for the schedule, a single state dict for checkpoints."""

    def __init__(self, named: dict):
        self.named = named
        self.params = [p for o in named.values() for g in o.param_groups for p in g["params"]]

    @property
    def param_groups(self):
        return [g for o in self.named.values() for g in o.param_groups]

    def zero_grad(self, set_to_none=True):
        for o in self.named.values():
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self.named.values():
            o.step()

    def state_dict(self):
        if list(self.named) == ["adamw"]:
            return self.named["adamw"].state_dict()   # the plain layout (FSDP's full_state reads it)
        return {name: o.state_dict() for name, o in self.named.items()}

    def load_state_dict(self, sd):
        if list(self.named) == ["adamw"]:
            return self.named["adamw"].load_state_dict(sd)
        for name, o in self.named.items():
            o.load_state_dict(sd[name])


def _newton_schulz_float32(grad, ns_coefficients, ns_steps, eps):
    """torch's Muon orthogonalization (the same quintic iteration) computed in float32 instead of bfloat16."""
    a, b, c = ns_coefficients
    x = grad.float()
    if grad.size(0) > grad.size(1):
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if grad.size(0) > grad.size(1) else x


class Float32Muon(torch.optim.Muon if hasattr(torch.optim, "Muon") else object):
    """torch.optim.Muon with its Newton-Schulz iteration in float32. torch runs it in bfloat16, which a CPU without
    AMX or AVX512-BF16 computes in software: on such a CPU (AVX2 only) one 1536x576 matrix took 4.7 s against
    0.18 s in float32, every step, for every matrix of the draft. Same update rule, state and checkpoints."""

    def step(self, closure=None):
        from torch.optim import _muon

        # Where torch names it otherwise, its own bf16 iteration runs (slow, still right).
        swap = (_swapped(_muon, "_zeropower_via_newtonschulz", _newton_schulz_float32)
                if hasattr(_muon, "_zeropower_via_newtonschulz") else contextlib.nullcontext())
        with swap:
            return super().step(closure)


@contextlib.contextmanager
def _swapped(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def make_optimizer(model, args, device):
    """AdamW (fused on CUDA), or Muon on the 2-D weights (not the lm_head) with AdamW on the rest."""
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    fused = {"fused": True} if device.type == "cuda" else {}
    adam_kw = dict(lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay, **fused)
    if args.optimizer == "adamw":
        return Optimizers({"adamw": torch.optim.AdamW([p for _, p in trainable], **adam_kw)})
    if not hasattr(torch.optim, "Muon"):
        raise BadInput(f"--optimizer muon: torch {torch.__version__} has no torch.optim.Muon (2.9 and later)")
    matrices = [p for n, p in trainable if p.ndim == 2 and "lm_head" not in n]
    rest = [p for n, p in trainable if not (p.ndim == 2 and "lm_head" not in n)]
    # match_rms_adamw scales Muon's update to AdamW's size, so one --lr serves both.
    # On a CPU that does not compute bf16 natively, Muon's orthogonalization runs in fp32 (Float32Muon).
    slow_bf16 = device.type == "cpu" and not compute_dtype.cpu_computes_bf16()
    named = {"muon": (Float32Muon if slow_bf16 else torch.optim.Muon)(
        matrices, lr=args.lr, weight_decay=args.weight_decay, adjust_lr_fn="match_rms_adamw")}
    if rest:
        named["adamw"] = torch.optim.AdamW(rest, **adam_kw)
    return Optimizers(named)
