#!/usr/bin/env python3
"""Train an EAGLE-3 draft head on extracted hidden states; export it in speculators' Eagle3 format.

Runs on the GPU host under the host's Python (see docs/CONTRACTS.md): one JSON document on stdout,
progress on stderr, exit 0 ok / 1 failed / 2 bad usage or input.

Inputs (all under --output-dir):
  hidden_states/hs_{i}.safetensors  token_ids [T] int, hidden_states [T, L, H], loss_mask [T]
  hidden_states/data_config.json    layer_ids (vLLM convention, last one == num_layers), hidden_size, ...
  vocab/d2t.npy, vocab/t2d.npy      d2t[i] = target_id - i (int64 [K]); t2d bool [target_vocab]
and --model: the target (only its embedding table, final norm and lm_head are read, by tensor name).
With --hidden-states online there is no hidden_states/: the target runs here, in an engine the step starts, and
its hidden states reach the loop through a bounded buffer in memory (data/online_stream.py).

Outputs:
  draft/checkpoints/step_XXXXXXXX.pt  model + optimizer + step + rng (atomic), resumable with --resume
  draft/export/config.json + model.safetensors   speculators Eagle3 format (what vLLM loads)
  draft/candidates/step_XXXXXXXX/ + candidates.json   with --choose-checkpoints N: N exports spread over the run and
                                    the held-out documents, for the choose step to serve (draft/candidates.py)

The draft model and its export format live in draft_model.py; the pieces of a run in training/: train_inputs (the
inputs, checked), data_plan (held-out split, packed rows, steps), target_head (the target's frozen head),
train_run (the run set up: device, ranks, draft, optimizer, --resume), loop (the loop), checkpoints, exports. This
file is the step: those pieces in order, and its result.

Under torchrun (pipeline/launch.py starts it so on a host with several GPUs) every rank takes its share of each
global batch (--batch-size counts all ranks) and the update equals one process's: DDP, or FSDP2 for a draft
whose training state does not fit one GPU (--parallel). Rank 0 writes full checkpoints, so --resume works on any
world size. SIGTERM (kimi-eagle stop) ends the current step, saves a checkpoint and exits 1.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time

import torch

from kimi_eagle_host.draft import candidates  # (choose_checkpoints: the exports the choose step serves)
from kimi_eagle_host.draft import parity
from kimi_eagle_host.data import online_stream  # (hidden_states online: the engine feeds the trainer)
from kimi_eagle_host.step_runtime import BadInput, log, parse_step_args, restart_count
from kimi_eagle_host.training import spec_trainer  # (--trainer speculators)
from kimi_eagle_host.training import distributed as dist_  # (ranks, collectives, DDP/FSDP, checkpoint on SIGTERM)
from kimi_eagle_host.training.checkpoints import latest_checkpoint
from kimi_eagle_host.training.exports import export_final, write_training_info
from kimi_eagle_host.training.loop import Outcome, held_out, train_loop
from kimi_eagle_host.training.train_inputs import TrainInputs, check_flags, read_inputs
from kimi_eagle_host.training.train_run import TrainRun, set_up


def train(args) -> dict:
    """The step: what _train does, with whatever it opened (an online engine and its buffer) closed at the end."""
    online_stream.split_gpus(args)   # engine_gpus / train_gpus, before anything initialises CUDA
    with contextlib.ExitStack() as closing:
        return _train(args, closing)


def _train(args, closing: contextlib.ExitStack) -> dict:
    """The inputs checked, the run set up, the loop, the last held-out evaluation and the export: (result, code)."""
    t_start = time.time()
    out = os.path.abspath(args.output_dir)
    check_flags(args)
    inputs = read_inputs(args, out)
    if args.trainer == "speculators":   # same inputs, checked above; its own process group and loop
        return with_speculators(args, inputs)
    run = set_up(args, inputs)
    o = train_loop(run, closing)
    result = result_of(run, o, t_start)
    if run.data.held is not None and o.done == o.stop and not o.diverged:
        held_out(run, o)
    if o.evals:
        result["heldout"] = o.evals[-1]
        result["heldout_history"] = o.evals
    if run.cand_steps:
        result["candidates"] = candidates.folder(out)
    if result["finished"]:
        export_final(run, result, o.history, o.evals)
    return (result, 0) if result["ok"] else (result, 1)


def with_speculators(args, inputs: TrainInputs):
    """--trainer speculators: speculators' own trainer on the same inputs; its export checked as ours is."""
    if args.choose_checkpoints:
        raise BadInput("--choose-checkpoints: only with --trainer ours (speculators' trainer exports the last)")
    i = inputs
    result = spec_trainer.train(args, out=i.out, files=i.files, aux_ids=i.aux_ids, d2t=i.d2t.numpy(),
                                t2d=i.t2d.numpy(), hidden=i.hidden, lengths=i.lengths, log=log, keys=i.prompt_keys)
    parity.check_export(result["export_dir"], i.tcfg, i.aux_ids, i.vocab_dir)
    if int(os.environ.get("RANK", "0")) == 0:   # what eval reports of the draft, as for ours
        meta = {"n_samples": result["samples"], "holdout": result["heldout_documents"], "total_steps": result["step"],
                "aux_ids": i.aux_ids, "draft_vocab": result["draft_vocab_size"], "seed": args.seed,
                "prepared_sha256": i.dc.get("prepared_sha256"), "seq_len": i.dc.get("seq_len")}
        write_training_info(result["export_dir"], i.dc, meta, i.prompt_keys, i.out, trainer=result["trainer"])
    return result, 0


def result_of(run: TrainRun, o: Outcome, t_start: float) -> dict:
    """The step's result (before the last held-out evaluation and the export)."""
    args, d, i = run.args, run.data, run.inputs
    done, interrupted, diverged, history = o.done, o.interrupted, o.diverged, o.history
    finished = done == run.total and not interrupted and not diverged
    result = {"ok": not (interrupted or diverged), "finished": finished, "step": max(done, run.start),
              "total_steps": run.total, "resumed_from_step": run.resumed_from, "samples": len(i.lengths),
              "tokens": i.n_tokens, "aux_layer_ids": i.aux_ids, "draft_vocab_size": i.draft_vocab,
              "device": str(run.device), "dtype": str(run.dtype), "world_size": run.w.size, "parallel": run.sharding,
              "rows_per_step": d.n_rows, "pack_len": d.pack_len, "attention": "flex" if run.flex else "math",
              "compiled": run.compiled, "optimizer": args.optimizer,
              "target_tops": "once" if run.tops is not None else "every step",
              "checkpoint": o.last_path or latest_checkpoint(run.ckpt_dir), "history": history,
              "train_tokens": o.tok_loop, "train_seconds": round(o.loop_s, 3),
              "train_tokens_per_s": round(o.tok_loop / o.loop_s, 1) if o.loop_s > 0 and o.tok_loop else None,
              "elapsed_s": round(time.time() - t_start, 2), "hidden_states": args.hidden_states}
    if i.online:
        result["online"] = {**o.source.run_figures(run.w, dist_.gather), "cached_documents": len(o.source.cached)}
    if interrupted:
        result["error"] = f"stopped by {interrupted} after step {done}; checkpoint saved, continue with --resume"
    if diverged:
        kept = o.last_path or latest_checkpoint(run.ckpt_dir)
        result["error"] = (f"{diverged}: stopped there, nothing exported and no checkpoint of it written (last "
                           f"checkpoint: {kept or 'none'}); start again with a lower --lr (now {args.lr:g}), "
                           f"--warmup-steps or --grad-clip")
        if run.w.main:
            log(f"train: {result['error']}")
    if run.device.type == "cuda":
        result["cuda_peak_mem_gb"] = round(torch.cuda.max_memory_allocated(run.device) / 2**30, 2)
    if history:
        result["final_loss"], result["final_acc"] = history[-1]["loss"], history[-1]["acc"]
        result["final_cond_acc"] = history[-1]["cond_acc"]
    return result


def resume_after_a_restart(args) -> None:
    """A job the scheduler started again (a Slurm requeue after a preemption) runs train again with the settings it
    had: without --resume its own checkpoints, stopped early, would be refused as a forgotten --resume, and one that
    had finished would be trained again from step 0. So it resumes them: where there is none it starts from scratch,
    and at the last step it exports again without training. `restarted` marks the resume as implied, not asked for:
    checkpoints made with other settings are then an earlier run's, cleared as by a run from step 0 (train_run)."""
    args.restarted = restart_count() > 0 and not args.resume
    if args.restarted:
        args.resume = True
        log(f"train: this job was started again by its scheduler ({restart_count()} time(s)): resuming its checkpoints")


def main(argv=None) -> int:
    args = parse_step_args("train", argv, __doc__)
    resume_after_a_restart(args)
    # Our loop compiles in processes of the job's group; speculators' trainer is stopped by the signal itself.
    spared = dist_.sparing_children() if args.trainer == "ours" else contextlib.nullcontext()
    with spared:
        return dist_.run_step_then_leave("train", train, args)


if __name__ == "__main__":
    sys.exit(main())
