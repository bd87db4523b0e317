"""`train --trainer speculators`: speculators' own EAGLE-3 trainer (0.8 and later) as the train step, on the same
inputs as ours, followed by the checks our own export passes.

Our hidden states already use speculators' file layout (hidden_states/hs_{i}.safetensors: token_ids,
hidden_states [T, L, H] with the final layer last, loss_mask) and our vocab files its convention (d2t/t2d .npy).
What its trainer needs beside them is an HF `datasets` folder with input_ids / loss_mask / seq_len, row i <->
hs_{i}: written here from the sample files themselves (so the two can never disagree), under
draft/speculators/data, and draft/speculators/hidden_states/hs_{i}.safetensors, a link to row i's sample file. The
rows are in our own order: the documents our trainer trains on first, the ones it holds out last (split_rows), since
speculators validates on the last rows. It trains into draft/speculators/checkpoints/<epoch>; the last checkpoint
becomes draft/export once it passes check_export.

Its trainer moves the draft to cuda:LOCAL_RANK: it cannot run on a CPU-only host (vllm_compat's
speculators_trainer_unavailable says so, for train and for preflight).
"""
from __future__ import annotations

import json
import math
import os
import shutil

from kimi_eagle_host.vllm_compat import speculators_trainer_unavailable

def installed_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("speculators")
    except metadata.PackageNotFoundError:
        return None


def write_rows(files: list[str], dest: str) -> int:
    """speculators' dataset rows from the sample files (row i = hs_{i}); returns the row count."""
    import hashlib

    import pyarrow as pa
    from datasets import Dataset
    from safetensors import safe_open

    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    shutil.rmtree(dest, ignore_errors=True)
    for p in files:
        with safe_open(p, "pt") as f:
            ids, mask = f.get_tensor("token_ids"), f.get_tensor("loss_mask")
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(int(ids.shape[0]))
    # An explicit fingerprint: datasets would otherwise hash the whole Arrow table with dill, which fails on some
    # pyarrow/dill pairs (seen: "Can't pickle <class 'MonthDayNano'>").
    fp = hashlib.sha256(json.dumps(rows["seq_len"]).encode()).hexdigest()[:16]
    Dataset(pa.Table.from_pydict(rows), fingerprint=fp).with_format("torch").save_to_disk(dest)
    return len(files)


def link_samples(files: list[str], dest: str) -> None:
    """dest/hs_{i}.safetensors, a link to files[i]: speculators reads row i's hidden states from hs_{i} of one folder,
    so rows in another order than the samples' need a folder of their own (links: nothing copied)."""
    tmp = dest + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for i, f in enumerate(files):
        os.symlink(os.path.abspath(f), os.path.join(tmp, f"hs_{i}.safetensors"))
    shutil.rmtree(dest, ignore_errors=True)   # the links only, never what they point to
    os.replace(tmp, dest)


def split_rows(args, n: int, keys: list | None) -> tuple[list[int], int, bool]:
    """(the documents in speculators' row order, how many it holds out, whether ours holds out none): our trainer's
    split (data_plan.split_holdout: the same seed, prompt groups, --holdout-fraction and --holdout-max-samples), the
    held-out documents last, since speculators validates on the rows from int(rows * --train-data-ratio) on
    (train_ratio). It refuses an empty validation split: where ours holds none out, the last document is its one."""
    from kimi_eagle_host.training.data_plan import split_holdout

    train_docs, held = split_holdout(n, args.holdout_fraction, args.seed, keys, args.holdout_max_samples)
    none = not held
    if none and len(train_docs) > 1:
        held = [train_docs.pop()]
    return train_docs + held, len(held), none


def train_ratio(rows: int, held: int) -> float:
    """speculators' --train-data-ratio for `held` validation rows of `rows`: its split is int(rows * ratio), so the
    ratio is half a row above rows - held (a float product never rounds down past it), and always below 1."""
    return (rows - held + 0.5) / rows


def known_flags() -> set[str] | None:
    """The flags the installed speculators' `train` parser takes, or None where it cannot be asked (then only the
    flags every trainer version has are handed over)."""
    try:
        from speculators.train.config.resolution import build_parser
    except Exception:  # noqa: BLE001 - another layout: fall back to the base flags
        return None
    return set(build_parser()._option_string_actions)


def plan_epochs(lengths: list[int], tokens_per_step: int, train_ratio: float, max_steps: int | None, epochs: float,
                world_size: int = 1, seed: int = 0) -> dict:
    """How many epochs speculators' trainer must be given so that it stops at `max_steps`, and what it will train.

    Its loop runs every epoch it is given even after --max-steps: each later epoch trains one more step, writes a
    checkpoint and validates (--epochs 1000 with --max-steps wrote ~980 checkpoints on the H200). So the epochs are
    counted here with its own packing (seeded permutation per epoch, its bin-packing sampler over the training split,
    the first int(n * ratio) rows): the fewest epochs whose batches reach max_steps, capped by `epochs`. Returns
    {"epochs", "steps", "tokens" (real tokens those steps hold), "batches_per_epoch", "exact"}; exact is False where
    speculators' sampler cannot be imported (then batches are estimated from the token count)."""
    import numpy as np

    train = np.clip(np.asarray(lengths[:int(len(lengths) * train_ratio)], dtype=np.int64), 0, tokens_per_step)
    cap = max(1, math.ceil(epochs))
    try:
        from speculators.train.distributed_batch_sampler import _assign_to_packed_batches
        exact = True
    except Exception:  # noqa: BLE001 - not installed here, or another layout
        _assign_to_packed_batches, exact = None, False
    per_epoch, steps, tokens, n_epochs = [], 0, 0, 0
    for epoch in range(cap):
        if _assign_to_packed_batches is not None:
            shuffled = train[np.random.default_rng(seed=seed + epoch).permutation(len(train))]
            # a step's tokens over all ranks: every rank's batch of it
            ranks = [_assign_to_packed_batches(shuffled, tokens_per_step, r, world_size) for r in range(world_size)]
            batch_tokens = [int(sum(int(shuffled[r[b]].sum()) for r in ranks)) for b in range(len(ranks[0]))]
        else:
            n = max(1, math.ceil(int(train.sum()) / (tokens_per_step * world_size)))
            batch_tokens = [int(train.sum()) // n] * n
        n_epochs += 1
        per_epoch.append(len(batch_tokens))
        take = batch_tokens if max_steps is None else batch_tokens[:max(0, max_steps - steps)]
        steps += len(take)
        tokens += sum(take)
        if max_steps is not None and steps >= max_steps:
            break
    return {"epochs": n_epochs, "steps": steps, "tokens": tokens, "batches_per_epoch": per_epoch, "exact": exact}


LR_SCHEDULES = {"cosine": "cosine", "linear": "linear", "constant": "none"}

# speculators pads every packed batch to --total-seq-len and extends its flex-attention block mask for each TTT step
# assuming total_seq_len // 128 query blocks (128: flex attention's block size). Any other length fails at the first
# step ("block_mask was created for block_mask.shape=(1, 1, 1280, 2560) but got q_len=1208", seen on the H200).
FLEX_BLOCK = 128


def spec_tokens_per_step(requested: int) -> int:
    """The tokens per step speculators' trainer can take: `requested` rounded up to a whole number of flex blocks."""
    return -(-max(1, requested) // FLEX_BLOCK) * FLEX_BLOCK


def trainer_argv(args, *, hs_dir: str, data_dir: str, vocab_dir: str, save_dir: str, aux_ids: list[int],
                 draft_vocab: int, tokens_per_step: int, train_ratio: float, epochs: int | None = None,
                 flags: set[str] | None = None) -> list[str]:
    """speculators train's flags for our train flags: the same target, features, layers, vocabulary, TTT depth,
    learning rate and schedule, seed, tokens per step and epochs (`epochs`: planned by plan_epochs, else --epochs
    rounded up); `train_ratio`: its --train-data-ratio (the function train_ratio). The run stops at --max-steps.
    Checkpoints: speculators always writes the first epoch's; with --checkpoint-freq = epochs the only other is the
    last. `flags`: what the installed parser takes (known_flags);
    the optional flags it lacks are left out, all of them when it cannot be asked (None)."""
    n_epochs = epochs if epochs is not None else max(1, math.ceil(args.epochs))
    argv = ["--verifier-name-or-path", args.model, "--data-path", data_dir, "--hidden-states-path", hs_dir,
            "--save-path", save_dir, "--draft-vocab-size", str(draft_vocab),
            "--d2t-path", os.path.join(vocab_dir, "d2t.npy"), "--t2d-path", os.path.join(vocab_dir, "t2d.npy"),
            "--epochs", str(n_epochs), "--lr", str(args.lr),
            "--total-seq-len", str(tokens_per_step), "--ttt-steps", str(args.ttt_steps), "--on-missing", "raise",
            # its validation split: the last rows, our held-out documents (split_rows); repr: every digit counts
            "--train-data-ratio", repr(train_ratio),
            "--no-resume-from-checkpoint", "--log-dir", os.path.join(save_dir, "logs"),
            "--target-layer-ids", *[str(i) for i in aux_ids], "--optimizer", args.optimizer,
            # Its default fused Triton loss does not trace under torch 2.11's dynamo (seen on the H200: "ListVariable
            # ... is already tracked for mutation"); eager is speculators' own compatibility option.
            "--loss-implementation", "eager"]
    if args.max_steps is not None:
        argv += ["--max-steps", str(args.max_steps)]
    optional = [("--seed", str(getattr(args, "seed", 0))),
                ("--checkpoint-freq", str(n_epochs)),
                # ours: cosine to 10 % / linear to 0 / constant after a linear warm-up; speculators' cosine ends at 0
                ("--scheduler-type", LR_SCHEDULES[getattr(args, "lr_schedule", "cosine")]),
                ("--scheduler-warmup-steps", str(getattr(args, "warmup_steps", 0) or 0)),
                # metrics (a host sync) every N steps, like our --log-every, not every step
                ("--log-freq", str(getattr(args, "log_every", 10)))]
    for flag, value in optional:
        if flags is not None and flag in flags:
            argv += [flag, value]
    return argv


def latest_checkpoint(save_dir: str) -> str | None:
    """The highest-numbered epoch folder speculators wrote (config.json + model.safetensors)."""
    if not os.path.isdir(save_dir):
        return None
    nums = [int(n) for n in os.listdir(save_dir) if n.isdigit()
            and os.path.isfile(os.path.join(save_dir, n, "config.json"))]
    return os.path.join(save_dir, str(max(nums))) if nums else None


def trained_steps(checkpoint: str | None) -> int | None:
    """The optimizer steps speculators had taken when it wrote `checkpoint` (its training_state.json)."""
    try:
        with open(os.path.join(checkpoint, "training_state.json")) as f:
            return int(json.load(f)["global_step"])
    except (TypeError, OSError, ValueError, KeyError):
        return None


def check_export(export_dir: str, aux_ids: list[int], d2t, t2d, hidden: int) -> list[str]:
    """What vLLM needs of an Eagle3 export, checked against our inputs: the problems found (empty: good)."""
    import numpy as np
    from safetensors import safe_open

    problems = []
    cfg_path, st_path = os.path.join(export_dir, "config.json"), os.path.join(export_dir, "model.safetensors")
    if not (os.path.isfile(cfg_path) and os.path.isfile(st_path)):
        return [f"{export_dir}: config.json or model.safetensors missing"]
    with open(cfg_path) as f:
        cfg = json.load(f)
    if cfg.get("speculators_model_type") != "eagle3":
        problems.append(f"speculators_model_type {cfg.get('speculators_model_type')!r} is not 'eagle3'")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if ids is not None and [int(i) for i in ids] != [int(i) for i in aux_ids]:
        problems.append(f"eagle_aux_hidden_state_layer_ids {ids} != the features' aux layers {aux_ids}")
    K = int(d2t.shape[0])
    if cfg.get("draft_vocab_size") != K:
        problems.append(f"draft_vocab_size {cfg.get('draft_vocab_size')} != {K} (vocab/d2t.npy)")
    with safe_open(st_path, "np") as f:
        names = set(f.keys())
        for need in ("fc.weight", "lm_head.weight"):
            if need not in names:
                problems.append(f"tensor {need} missing")
        if "lm_head.weight" in names and tuple(f.get_slice("lm_head.weight").get_shape()) != (K, hidden):
            problems.append(f"lm_head.weight {f.get_slice('lm_head.weight').get_shape()} != [{K}, {hidden}]")
        if "fc.weight" in names and tuple(f.get_slice("fc.weight").get_shape()) != (hidden, len(aux_ids) * hidden):
            problems.append(f"fc.weight {f.get_slice('fc.weight').get_shape()} != [{hidden}, {len(aux_ids) * hidden}]")
        if K != int(t2d.shape[0]):   # a reduced vocabulary: the mapping must be ours
            for name, want in (("d2t", d2t), ("t2d", t2d)):
                if name not in names:
                    problems.append(f"tensor {name} missing")
                elif not np.array_equal(f.get_tensor(name).astype(want.dtype), want):
                    problems.append(f"tensor {name} differs from vocab/{name}.npy")
    from kimi_eagle_host.draft.draft_model import nonfinite_weights

    problems += nonfinite_weights(st_path)
    return problems


def share_rows(files: list[str], data_dir: str, hs_dir: str, save_dir: str, rank0: bool) -> None:
    """speculators' rows of `files` in data_dir and their links in hs_dir (link_samples), written by rank 0, and its
    checkpoint folder emptied. Under
    torchrun every rank runs this; speculators joins the process group only later, so the other ranks wait for
    rank 0's rows by a marker naming this run (no collective exists yet)."""
    import time

    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    ready = os.path.join(data_dir, "READY")
    if rank0:
        # Each run starts from scratch (--no-resume-from-checkpoint), and speculators overwrites the epoch folders
        # it writes but never removes the others: an earlier run of more epochs would leave a higher-numbered
        # folder, which would be taken for this run's last and published as its export.
        shutil.rmtree(save_dir, ignore_errors=True)
        shutil.rmtree(data_dir, ignore_errors=True)
        write_rows(files, data_dir + ".tmp")
        link_samples(files, hs_dir)
        os.replace(data_dir + ".tmp", data_dir)
        with open(ready, "w") as f:
            f.write(run_id)
    else:
        deadline = time.time() + 3600
        while not (os.path.isfile(ready) and open(ready).read() == run_id):
            if time.time() > deadline:
                raise RuntimeError(f"rank 0 wrote no speculators rows to {data_dir} within an hour")
            time.sleep(1)


def publish_export(ck: str, export_dir: str, rank0: bool, log) -> None:
    """speculators' checkpoint `ck` copied to export_dir (by rank 0), replacing it whole."""
    if rank0:
        tmp = export_dir + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(ck, tmp)
        shutil.rmtree(export_dir, ignore_errors=True)
        os.replace(tmp, export_dir)
        log(f"exported {export_dir} (speculators' checkpoint {ck})")


def train(args, *, out: str, files: list[str], aux_ids: list[int], d2t, t2d, hidden: int, lengths: list[int],
          log, keys: list | None = None) -> dict:
    """Run speculators' trainer in this process (torchrun's ranks each run it), then check and publish its last
    checkpoint as draft/export. `keys`: each document's prompt (split_rows). Returns the step's result (the caller
    reports it)."""
    import time

    import torch

    from kimi_eagle_host.step_runtime import BadInput

    version = installed_version()
    why = speculators_trainer_unavailable(version, torch.cuda.is_available())
    if why:
        raise BadInput(f"--trainer speculators: {why}")
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    root = os.path.join(out, "draft", "speculators")
    data_dir, save_dir = os.path.join(root, "data"), os.path.join(root, "checkpoints")
    hs_dir = os.path.join(root, "hidden_states")   # links to the samples, in the rows' order
    rank0 = int(os.environ.get("RANK", "0")) == 0
    order, held, none = split_rows(args, len(files), keys)
    files, lengths = [files[d] for d in order], [lengths[d] for d in order]
    ratio = train_ratio(len(files), held)
    log(f"speculators validates on {held} of {len(files)} samples: "
        + ("our trainer would hold out none, speculators needs one" if none else "the documents our trainer holds out")
        + f" (--holdout-fraction {args.holdout_fraction:g}, at most --holdout-max-samples {args.holdout_max_samples})")
    share_rows(files, data_dir, hs_dir, save_dir, rank0)
    requested = args.tokens_per_step or max(lengths) * (args.batch_size or 8)
    tokens_per_step = spec_tokens_per_step(requested)
    if tokens_per_step != requested:
        log(f"tokens per step {requested} -> {tokens_per_step}: speculators' trainer takes whole blocks of {FLEX_BLOCK}")
    plan = plan_epochs(lengths, tokens_per_step, ratio, args.max_steps, args.epochs,
                       world_size=int(os.environ.get("WORLD_SIZE", "1")), seed=args.seed)
    argv = trainer_argv(args, hs_dir=hs_dir, data_dir=data_dir,
                        vocab_dir=os.path.join(out, "vocab"), save_dir=save_dir, aux_ids=aux_ids,
                        draft_vocab=int(d2t.shape[0]), tokens_per_step=tokens_per_step,
                        train_ratio=ratio, epochs=plan["epochs"], flags=known_flags())
    log(f"speculators' plan: {plan['epochs']} epoch(s), {plan['steps']} steps, {plan['tokens']} tokens"
        f"{'' if plan['exact'] else ' (estimated: its sampler could not be imported)'}")
    log(f"speculators {version} trainer: {' '.join(argv)}")
    t0 = time.time()
    spec_main(TrainConfig.resolve(argv))
    seconds = time.time() - t0
    ck = latest_checkpoint(save_dir)
    result = {"ok": True, "finished": True, "trainer": f"speculators {version}", "samples": len(files),
              "heldout_documents": held,
              "tokens_per_step": tokens_per_step, "step": plan["steps"], "epochs": plan["epochs"],
              "train_tokens": plan["tokens"], "plan_exact": plan["exact"],
              "checkpoints": sorted(n for n in os.listdir(save_dir) if n.isdigit()) if os.path.isdir(save_dir) else [],
              "steps_done": trained_steps(ck),
              "tokens": sum(lengths), "aux_layer_ids": aux_ids, "draft_vocab_size": int(d2t.shape[0]),
              "speculators_argv": argv, "train_seconds": round(seconds, 2), "checkpoint": ck}
    if torch.cuda.is_available():
        result["cuda_peak_mem_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    if ck is None:
        raise RuntimeError(f"speculators' trainer wrote no checkpoint under {save_dir}")
    problems = check_export(ck, aux_ids, d2t, t2d, hidden)
    if problems:
        raise RuntimeError(f"{ck}: speculators' checkpoint fails our export checks: {'; '.join(problems)}")
    export_dir = os.path.join(out, "draft", "export")
    publish_export(ck, export_dir, rank0, log)
    result["export_dir"] = export_dir
    return result
