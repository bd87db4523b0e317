"""A training run set up for the loop (training/loop.py): the device and ranks, the data plan, the target's head,
the draft and its optimizer, the settings a checkpoint records, the step it starts from (--resume). TrainRun is
what the loop, the checkpoints and the exports share."""
from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass, field

import torch
from torch import nn

from kimi_eagle_host import compute_dtype, cpu_threads
from kimi_eagle_host.data import online_stream  # (hidden_states online: the spool's room)
from kimi_eagle_host.draft import candidates  # (choose_checkpoints: the exports the choose step serves)
from kimi_eagle_host.draft.draft_model import Eagle3Draft
from kimi_eagle_host.step_runtime import BadInput, log, model_identity
from kimi_eagle_host.training import distributed as dist_  # (ranks, collectives, DDP/FSDP, checkpoint on SIGTERM)
from kimi_eagle_host.training.checkpoints import clear_earlier, resume
from kimi_eagle_host.training.data_plan import DataPlan, plan_data
from kimi_eagle_host.training.optim import make_optimizer
from kimi_eagle_host.training.target_head import TargetHead, document_tops, load_target_head
from kimi_eagle_host.training.train_inputs import TrainInputs


@dataclass
class TrainRun:
    args: object
    inputs: TrainInputs
    w: dist_.World
    device: torch.device
    dtype: torch.dtype           # the compute dtype (autocast)
    feat_dtype: torch.dtype      # the frozen target tensors' and the features' dtype
    flex: bool                   # flex_attention (else the math path)
    compiled: bool               # the decoder layer torch.compiled
    data: DataPlan
    head: TargetHead
    model: nn.Module             # the draft, wrapped for DDP/FSDP where it runs so
    opt: object                  # optim.Optimizers
    sharding: str                # none, ddp or fsdp
    trainable_names: list[str]
    n_trainable: int
    meta: dict                   # the settings a checkpoint records (a resume must match them)
    start: int = 0               # the first step this process runs
    resumed_from: int | None = None
    cand_steps: list[int] = field(default_factory=list)   # the steps exported for the choose step
    tops: dict | None = None     # the target's top tokens of each document, when found once

    @property
    def out(self) -> str:
        return self.inputs.out

    @property
    def ckpt_dir(self) -> str:
        return os.path.join(self.out, "draft", "checkpoints")

    @property
    def export_dir(self) -> str:
        return os.path.join(self.out, "draft", "export")

    @property
    def total(self) -> int:
        return self.data.total


def pick_device(args, w) -> torch.device:
    """--device (auto: CUDA where there is one); under torchrun this rank's own GPU."""
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
        if device.type == "cuda" and not torch.cuda.is_available():
            raise BadInput("--device cuda: no CUDA device visible")
    if device.type == "cuda" and w.distributed:
        if w.local_rank >= torch.cuda.device_count():
            raise BadInput(f"local rank {w.local_rank} has no GPU: {torch.cuda.device_count()} visible")
        device = torch.device("cuda", w.local_rank)
    return device


def build_draft(args, inputs: TrainInputs, embed, target_lm_rows, w, device, compiled: bool):
    """(the draft on `device`, wrapped as it trains; its optimizer; sharding; trainable parameter names; count)."""
    torch.manual_seed(args.seed)
    model = Eagle3Draft(inputs.draft_cfg, len(inputs.aux_ids), inputs.draft_vocab, bool(args.norm_before_residual))
    for mod in model.modules():  # Llama-style init; the RMSNorm weights start at 1
        if isinstance(mod, nn.Linear):
            nn.init.normal_(mod.weight, std=0.02)
    model.lm_head.weight.data.copy_(target_lm_rows)  # start from the target's own head (speculators)
    model.lm_head.weight.requires_grad_(bool(args.train_lm_head))
    model.to(device)
    trainable_names = [n for n, p in model.named_parameters() if p.requires_grad]
    n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    n_frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    # fp32 weight + gradient + two AdamW moments per trainable parameter, frozen fp32 weights, target tensors.
    state_bytes = 16 * n_trainable + 4 * n_frozen + embed.numel() * embed.element_size() + 4 * target_lm_rows.numel()
    sharding = dist_.choose_sharding(args.parallel, w, state_bytes, device)
    if args.optimizer == "muon" and sharding == "fsdp":
        raise BadInput("--optimizer muon: not with --parallel fsdp (Muon orthogonalises whole matrices)")
    model = dist_.wrap(model, sharding, device)  # before the optimizer: FSDP replaces the parameters
    if compiled:
        for layer in dist_.unwrap(model).layers:
            layer.compile(dynamic=False)
    opt = make_optimizer(model, args, device)
    return model, opt, sharding, trainable_names, n_trainable


def run_meta(args, inputs: TrainInputs, data: DataPlan) -> dict:
    return {"total_steps": data.total, "batch_size": data.n_rows, "pack_len": data.pack_len,
            "ttt_steps": args.ttt_steps, "lr": args.lr, "seed": args.seed, "aux_ids": inputs.aux_ids,
            "draft_vocab": inputs.draft_vocab, "n_samples": len(inputs.lengths), "holdout": len(data.held_docs),
            "optimizer": args.optimizer,
            # the draft's shape: a checkpoint of another shape cannot load (said as a setting, not a tensor error)
            "draft_shape": {k: inputs.draft_cfg[k] for k in ("num_hidden_layers", "num_attention_heads",
                                                             "num_key_value_heads", "intermediate_size")},
            # the target: resuming a checkpoint against another model's features/head must refuse
            "model": model_identity(args.model), "weights_fingerprint": inputs.weights,
            # the data: other prepared data, or another cut, gives every step other documents; another vocabulary
            # maps the draft's head rows onto other tokens
            "prepared_sha256": inputs.dc.get("prepared_sha256"), "seq_len": inputs.dc.get("seq_len"),
            "draft_vocab_sha256": hashlib.sha256(inputs.d2t.numpy().tobytes()).hexdigest()[:16]}


def find_tops(run: TrainRun) -> dict | None:
    """The target's top token over its full vocabulary, at every position: on a CPU the full head is ~40 % of a
    step (SmolLM2: 576 x 49,152 per token, 3 TTT steps of a 5 M draft) and the data is small, so each
    document's tops are found once before the first step when training sees the data more than once. On a
    GPU the head is cheap next to reading every hidden-state file a second time, so it runs in each step."""
    d = run.data
    if not (run.device.type == "cpu" and d.total * d.n_rows > len(d.plan.rows) and not run.inputs.online):
        return None
    t0 = time.time()
    tops = document_tops(run.inputs.files, d.train_docs + d.held_docs, d.pack_len, run.feat_dtype, run.head.norm,
                         run.head.full_lm_head)
    log(f"target's top tokens of {len(tops)} documents found once in {time.time() - t0:.1f}s")
    return tops


def set_up(args, inputs: TrainInputs) -> TrainRun:
    """Everything the loop needs, in this order: device, data plan, process group, target head, draft, resume."""
    w = dist_.world()
    device = pick_device(args, w)
    flex = args.attention == "flex" or (args.attention == "auto" and device.type == "cuda")
    compiled = args.compile == "on" or (args.compile == "auto" and device.type == "cuda")
    data = plan_data(args, inputs.lengths, len(inputs.layer_ids), inputs.hidden, device, flex, w.size,
                     inputs.prompt_keys)
    # gloo for CPU tensors, nccl for CUDA ones; the timeout covers rank 0 writing a big checkpoint while
    # the others wait at the barrier.
    dist_.init(w, "nccl" if device.type == "cuda" else "gloo", timeout_s=3600)
    if inputs.online:   # the spools' room on each host, before the target loads or an earlier run's files go
        refuse_together(w, w.local_rank == 0, lambda: online_stream.check_spool_room(
            args, inputs.dc, data, inputs.lengths, w, device.type))
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[compute_dtype.resolve(args.dtype, device.type, log)]
    cpu_threads.fit(inputs.hidden, device.type, log)
    # Frozen target tensors and the feature stream are kept in the compute dtype (halves memory for
    # Kimi's 163840x7168 embedding); trainable weights stay fp32 and autocast does the mixing.
    feat_dtype = dtype
    head, target_lm_rows = load_target_head(args, inputs, device, dtype, feat_dtype)
    model, opt, sharding, trainable_names, n_trainable = build_draft(args, inputs, head.embed, target_lm_rows, w,
                                                                     device, compiled)
    del target_lm_rows
    run = TrainRun(args, inputs, w, device, dtype, feat_dtype, flex, compiled, data, head, model, opt, sharding,
                   trainable_names, n_trainable, run_meta(args, inputs, data))
    if args.resume:
        run.resumed_from = resume(run.ckpt_dir, run.meta, model, opt, sharding, trainable_names, w, device, run.total,
                                  others_are_earlier=getattr(args, "restarted", False))
        run.start = run.resumed_from or 0
    run.cand_steps = candidates.steps(run.total, args.choose_checkpoints)
    if run.start == 0:  # an earlier run's checkpoints and candidates were trained otherwise
        start_afresh(run, w)
    run.tops = find_tops(run)
    return run


def start_afresh(run, w) -> None:
    """Rank 0 removes an earlier run's checkpoints and candidates, or refuses (a forgotten --resume)."""
    def clear():
        clear_earlier(run.ckpt_dir, run.meta)
        candidates.reset(run.out)

    refuse_together(w, w.main, clear)


def refuse_together(w, here: bool, act) -> None:
    """act() on the ranks where `here`; a refusal (BadInput) there is raised on every rank, instead of the others
    going on to wait in a collective for a rank that left."""
    refusal = None
    if here:
        try:
            act()
        except BadInput as e:
            refusal = str(e)
    refusals = [r for r in dist_.gather(refusal) if r]
    if refusals:
        raise BadInput(refusals[0])
