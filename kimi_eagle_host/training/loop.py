"""train's loop over a TrainRun (training/train_run.py): one optimizer step after another, a logging step every
--log-every, a held-out evaluation every --eval-every, a checkpoint every --save-every, the candidates the choose
step serves; it stops at the end, at --stop-at-step, on SIGTERM (kimi-eagle stop: checkpoint, then out) or as soon
as the loss or a weight is no longer finite (nothing of it saved)."""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, field

import torch

from kimi_eagle_host.data import online_stream  # (hidden_states online: the engine feeds the trainer)
from kimi_eagle_host.data.step_batches import StepBatches  # (rows read ahead onto the device)
from kimi_eagle_host.step_runtime import log, progress_line
from kimi_eagle_host.training import distributed as dist_  # (ranks, collectives, DDP/FSDP, checkpoint on SIGTERM)
from kimi_eagle_host.training import ttt_loss  # (chunked KL, conditional acceptance)
from kimi_eagle_host.training.checkpoints import save_checkpoint
from kimi_eagle_host.training.exports import export_candidate
from kimi_eagle_host.training.optim import lr_at
from kimi_eagle_host.training.target_head import full_vocab_argmax
from kimi_eagle_host.training.tracker import open_tracker, tracking_dir
from kimi_eagle_host.training.train_run import TrainRun

# Test-only: seconds to sleep after each optimizer step, so a test can stop a run mid-training.
STEP_DELAY_ENV = "KIMI_EAGLE_TEST_STEP_DELAY_S"


@dataclass
class Outcome:
    """What the loop did: where it stopped and why, its figures, its last checkpoint."""
    stop: int                     # the step the loop was to end at (--stop-at-step, else the last)
    done: int                     # steps done, counted from the run's first
    source: object                # where training batches come from: the sample files, or the online stream
    files: object                 # the held-out documents' files (online: the stream's)
    history: list = field(default_factory=list)   # one entry per logging step
    evals: list = field(default_factory=list)     # one entry per held-out evaluation
    last_path: str | None = None  # the last checkpoint written
    interrupted: str | None = None   # the signal that stopped the run
    diverged: str | None = None   # what the loss or the weights turned into, once they are no longer finite
    tok_loop: int = 0             # tokens trained on, all ranks (summed at the end)
    loop_s: float = 0.0


@dataclass
class Interval:
    """Figures since the last logging step. They stay on the device until a logging step: no host sync per step."""
    losses: torch.Tensor          # [S] per TTT step
    counts: torch.Tensor          # [3S+1] acceptance counts
    loss: torch.Tensor            # the summed loss
    t0: float
    n: int = 0                    # steps
    tokens: int = 0

    @classmethod
    def start(cls, S: int, device) -> "Interval":
        t0 = time.time()
        return cls(torch.zeros(S, dtype=torch.float64, device=device),
                   torch.zeros(3 * S + 1, dtype=torch.float64, device=device),
                   torch.zeros((), dtype=torch.float64, device=device), t0)

    def add(self, loss, step_l, counts, tokens: int) -> None:
        self.loss += loss.detach().double()
        self.losses += step_l.double()
        self.counts += counts
        self.n += 1
        self.tokens += tokens

    def reset(self) -> None:
        self.losses.zero_(), self.counts.zero_(), self.loss.zero_()
        self.t0, self.tokens, self.n = time.time(), 0, 0


def nonfinite(loss_sum, params) -> str | None:
    """What is no longer finite on some rank: the losses summed since the last logging step, or a weight (this
    rank's shard of it); None when all is finite. One collective: every rank calls it at the same step."""
    shards = [p.to_local() if hasattr(p, "to_local") else p for p in params]   # FSDP2: DTensor -> this rank's part
    weights_bad = bool(torch.stack([(~torch.isfinite(x.detach())).any() for x in shards]).any()) if shards else False
    loss_bad, weights_bad = dist_.all_sum([not math.isfinite(float(loss_sum)), weights_bad])
    if loss_bad:
        return "the loss is not finite"
    return "a weight is not finite" if weights_bad else None


def steps_span(first: int, last: int) -> str:
    """Where a figure summed over steps first..last (since the last logging step) comes from, in words."""
    return f"at step {last}" if first >= last else f"in steps {first}-{last}"


def finite_or_none(value):
    """`value` with every non-finite float, also inside lists and dicts, replaced by None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: finite_or_none(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_or_none(v) for v in value]
    return value


def measure(run: TrainRun, batch, noise_gen=None, rounds=False):
    """Forward (and the loss) of one batch already on the device: (loss, per-step losses, counts); with `rounds`,
    the counts end with ttt_loss.round_counts' S + 1 for each k = 1..S tokens served a round (held-out evaluation
    only: it syncs with the host)."""
    args, h, dtype, device, S = run.args, run.head, run.dtype, run.device, run.args.ttt_steps
    with torch.no_grad():
        target_h = h.norm(batch["last"].float()).to(dtype)
        target_ids = (batch["target_ids"] if "target_ids" in batch
                      else full_vocab_argmax(batch["last"], h.norm, h.full_lm_head))
        in_vocab = h.t2d[target_ids] if args.oov_positions == "mask" else None
        scored = ttt_loss.step_masks(batch["loss_mask"], batch["doc_ids"], S)
        in_loss = ttt_loss.loss_masks(scored, in_vocab)
        denoms = torch.stack([m.sum() for m in in_loss]).float()
        dist_.all_reduce_(denoms)   # the global batch's counts; a device collective, no host sync
    aux = batch["aux"]
    if noise_gen is not None:
        aux = aux + args.feature_noise * torch.randn(aux.shape, generator=noise_gen, device=device, dtype=aux.dtype)

    def loss_fn(normed, weight):
        return ttt_loss.ttt_loss(normed, weight, target_h, h.target_rows, in_loss, denoms, args.ttt_decay, dtype)

    with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
        loss, step_l, tops = run.model(aux, batch["ids"], h.embed_fn, S, batch["positions"], batch["doc_ids"],
                                       run.flex, loss_fn=loss_fn)
    with torch.no_grad():
        counts = ttt_loss.acceptance_counts(tops, h.draft_to_target, target_ids, scored)
        if rounds:
            counts = torch.cat([counts, ttt_loss.round_counts(tops, h.draft_to_target, target_ids, scored,
                                                              range(1, S + 1))])
    return loss, step_l, counts


def evaluate(run: TrainRun, files) -> dict:
    """Loss, accuracy and conditional acceptance per position on the held-out documents (all ranks): averaged over
    every answer index, and over the rounds greedy serving would run on the same text (`served_like`, what vLLM
    counts on it: ttt_loss.round_counts) at k = S tokens a round, and its acceptance length at every k <= S
    (`served_like_by_k`: drafts trained with different TTT steps compared at the k they are served with)."""
    d, w, S = run.data, run.w, run.args.ttt_steps
    run.model.eval()
    tot_l = torch.zeros(S, dtype=torch.float64, device=run.device)
    per_index = 3 * S + 1   # acceptance_counts' figures, then round_counts' S + 1 for each k = 1..S
    tot_c = torch.zeros(per_index + S * (S + 1), dtype=torch.float64, device=run.device)
    with torch.no_grad():
        with StepBatches(d.held, 0, d.held.steps_per_epoch, w.rank, w.size, files, d.pack_len, d.aux_dim,
                         run.inputs.hidden, run.feat_dtype, run.device, 0, run.tops) as batches:
            for batch in batches:
                _, step_l, counts = measure(run, batch, rounds=True)
                tot_l += step_l.double()
                tot_c += counts
    run.model.train()
    sums = dist_.all_sum([*tot_l.tolist(), *tot_c.tolist()])
    n_batches = d.held.steps_per_epoch
    res = ttt_loss.summarize(sums[S:S + per_index], [x / n_batches for x in sums[:S]], S)
    by_k = [ttt_loss.summarize_rounds(sums[S + per_index + (k - 1) * (S + 1):S + per_index + k * (S + 1)], k)
            for k in range(1, S + 1)]
    res["served_like"] = by_k[-1]
    res["served_like_by_k"] = {str(k): f["accept_len"] for k, f in enumerate(by_k, 1)}
    res["documents"] = len(d.held_docs)
    return res


def held_out(run: TrainRun, o: Outcome, tracker=None) -> None:
    """A held-out evaluation at the step reached, logged by rank 0 (and given to the tracker)."""
    o.evals.append({"step": o.done, **evaluate(run, o.files)})
    if run.w.main:
        log(f"held-out at step {o.done}: {json.dumps(o.evals[-1])}")
        if tracker is not None:
            tracker.log(o.done, {"heldout/accept_len": o.evals[-1]["accept_len"],
                                 "heldout/served_like_accept_len": o.evals[-1]["served_like"]["accept_len"],
                                 **{f"heldout/cond_acc_{k}": a for k, a in enumerate(o.evals[-1]["cond_acc"])}})


def optimizer_step(run: TrainRun, batches, step: int, iv: Interval) -> tuple[float, int]:
    """One optimizer step on the next batch; its figures added to `iv`. (its learning rate, its tokens)."""
    args, w = run.args, run.w
    lr = lr_at(step, run.total, args)
    for g in run.opt.param_groups:
        g["lr"] = lr
    batch = next(batches)   # its copy to the GPU was queued during the step before
    noise = None
    if args.feature_noise > 0:   # seeded by (seed, step, rank): the same after a resume, no RNG state
        noise = torch.Generator(device=run.device).manual_seed(
            (args.seed * 1_000_003 + step) * 1024 + w.rank)
    loss, step_l, counts = measure(run, batch, noise)
    run.opt.zero_grad(set_to_none=True)
    # Each rank's loss is its share of the global batch's; DDP/FSDP average the gradients over the
    # ranks, so scaling by the world size makes the update exactly the global batch's.
    (loss * w.size).backward()
    if args.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(run.opt.params, args.grad_clip)
    run.opt.step()
    iv.add(loss, step_l, counts, batch["tokens"])
    return lr, batch["tokens"]


def log_interval(run: TrainRun, o: Outcome, iv: Interval, lr: float, tracker) -> bool:
    """A logging step: the interval's figures over all ranks into the history, the log, the tracker and the
    progress bar. True when the loss is no longer finite (o.diverged says since when)."""
    S, done, total = run.args.ttt_steps, o.done, run.total
    dt = max(time.time() - iv.t0, 1e-9)
    sums = dist_.all_sum([float(iv.loss), *iv.losses.tolist(), *iv.counts.tolist(), iv.tokens])
    tok_g = sums[-1]
    fig = ttt_loss.summarize(sums[1 + S:-1], [x / iv.n for x in sums[1:1 + S]], S)
    entry = {"step": done, "loss": sums[0] / iv.n, **fig, "lr": lr, "tokens_per_s": round(tok_g / dt, 1),
             "tokens": int(tok_g), "seconds": round(dt, 4)}   # the interval since the last log
    # online: the engine's tokens/s, the buffer's fill, and who waited for whom (every host's: all ranks ask)
    flow = o.source.run_figures(run.w, dist_.gather) if run.inputs.online else {}
    if run.w.main:
        acc_s = " ".join(f"acc[{k}]={a:.2f}" for k, a in enumerate(fig["acc"]))
        log(f"step {done}/{total} loss {entry['loss']:.4f} {acc_s} accept_len {fig['accept_len']:.2f} "
            f"lr {lr:.2e} tok/s {tok_g / dt:.0f}")
        # The tracker (tensorboard, ...) and the progress bar of `kimi-eagle logs`: keep both calls.
        tracker.log(done, {"train/loss": entry["loss"], "train/lr": lr, "train/tokens_per_s": tok_g / dt,
                           "train/accept_len": fig["accept_len"],
                           **{f"train/acc_{k}": a for k, a in enumerate(fig["acc"])},
                           **{f"train/cond_acc_{k}": a for k, a in enumerate(fig["cond_acc"])},
                           **{f"online/{k}": v for k, v in flow.items() if v is not None}})
        progress_line("train", done, total, every_s=0, loss=entry["loss"], acc=fig["acc"][0],
                      accept_len=fig["accept_len"], tok_s=tok_g / dt, **flow)
    o.history.append(entry)
    if not math.isfinite(entry["loss"]):
        o.diverged = f"the loss is not finite ({entry['loss']}) {steps_span(done - iv.n + 1, done)}"
        o.history[-1] = finite_or_none(entry)   # the result stays strict JSON (no NaN)
        return True
    iv.reset()
    return False


def save(run: TrainRun, o: Outcome, iv: Interval) -> bool:
    """A checkpoint of the step reached. A checkpoint is only written of finite weights reached by finite losses
    (one host sync per save): False, with o.diverged said, when they are not."""
    bad = nonfinite(iv.loss, run.opt.params)
    if bad:
        o.diverged = f"{bad} {steps_span(o.done - iv.n + 1, o.done)}"
        return False
    o.last_path = save_checkpoint(run.ckpt_dir, o.done, run.model, run.opt, run.meta, run.args.keep_checkpoints,
                                  run.sharding, run.trainable_names)
    return True


def say_start(run: TrainRun) -> None:
    i, d, w = run.inputs, run.data, run.w
    log(f"train: {len(i.lengths)} samples ({len(d.held_docs)} held out), {i.n_tokens} tokens, aux ids {i.aux_ids}, "
        f"draft vocab {i.draft_vocab}, {run.n_trainable} trainable params, {run.total} steps of {d.n_rows} x "
        f"{d.pack_len} tokens on {run.device} ({run.dtype}, {'flex' if run.flex else 'math'} attention"
        f"{', compiled' if run.compiled else ''})"
        + (f", rank {w.rank}/{w.size} ({run.sharding})" if w.distributed else ""))


def open_batches(run: TrainRun, o: Outcome, closing) -> StepBatches:
    """The training batches of steps run.start..o.stop, read ahead; online, the engine starts now, on the stream of
    the steps this run trains, and `o.files` becomes the stream's held-out documents."""
    args, i, d, w = run.args, run.inputs, run.data, run.w
    if i.online:
        o.source = closing.enter_context(online_stream.start(args, i.dc, d.plan, d.held_docs, d.held, run.start,
                                                             o.stop, i.lengths, run.device, w, dist_.gather))
        o.files = o.source.held
    return StepBatches(d.plan, run.start, o.stop, w.rank, w.size, o.source, d.pack_len, d.aux_dim, i.hidden,
                       run.feat_dtype, run.device, d.workers, run.tops)


def train_loop(run: TrainRun, closing) -> Outcome:
    """The loop, from run.start; what it opens (an online engine) is closed by `closing`, after the step."""
    args, w = run.args, run.w
    say_start(run)
    stop = run.total if args.stop_at_step is None else min(run.total, args.stop_at_step)
    o = Outcome(stop=stop, done=run.start, source=run.inputs.files, files=run.inputs.files)
    iv = Interval.start(args.ttt_steps, run.device)
    t_loop = time.time()
    step_delay = float(os.environ.get(STEP_DELAY_ENV, "0") or 0)
    run.model.train()
    batches = open_batches(run, o, closing)
    tracker = open_tracker(args.report_to, tracking_dir(run.out, args.tracking_dir), config=vars(args), main=w.main)
    progress_line("train", run.start, run.total)  # the bar's start: its ETA counts from here
    with tracker, dist_.StopRequest() as stop_request, batches:
        for step in range(run.start, stop):
            lr, tokens = optimizer_step(run, batches, step, iv)
            o.tok_loop += tokens
            o.done = done = step + 1
            if step_delay:
                time.sleep(step_delay)
            will_log = done == 1 or done % args.log_every == 0 or done == stop
            # Every rank takes the same decision, so none waits in a collective the others skipped; asked every
            # 8 steps (a collective is a host sync) and on logging steps.
            if (will_log or done % 8 == 0) and dist_.any_rank(stop_request.requested):
                o.interrupted = stop_request.received or "SIGTERM"
            if (will_log or o.interrupted) and log_interval(run, o, iv, lr, tracker):
                break
            if run.data.held is not None and args.eval_every and done % args.eval_every == 0 and done != stop:
                held_out(run, o, tracker)
                iv.t0 = time.time()
            if (done % args.save_every == 0 or done == stop or o.interrupted) and not save(run, o, iv):
                break
            if done in run.cand_steps:
                export_candidate(run, done)
            if o.interrupted:
                log(f"{o.interrupted}: stopped after step {done}/{run.total}; checkpoint {o.last_path}; "
                    f"continue with --resume")
                break
    o.loop_s = time.time() - t_loop
    o.tok_loop = int(dist_.all_sum([o.tok_loop])[0])
    return o
