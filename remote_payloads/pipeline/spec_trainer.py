"""`train --trainer speculators`: speculators' own EAGLE-3 trainer (0.8 and later) as the train step, on the same
inputs as ours, followed by the checks our own export passes.

Our hidden states already use speculators' file layout (hidden_states/hs_{i}.safetensors: token_ids,
hidden_states [T, L, H] with the final layer last, loss_mask) and our vocab files its convention (d2t/t2d .npy).
What its trainer needs beside them is an HF `datasets` folder with input_ids / loss_mask / seq_len, row i <->
hs_{i}: written here from the sample files themselves (so the two can never disagree), under
draft/speculators/data. It trains into draft/speculators/checkpoints/<epoch>; the last checkpoint becomes
draft/export once it passes check_export.

Its trainer moves the draft to cuda:LOCAL_RANK: it cannot run on a CPU-only host (vllm_compat's
speculators_trainer_unavailable says so, for train and for preflight).
"""
from __future__ import annotations

import json
import math
import os
import shutil
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the payload root: vllm_compat
from vllm_compat import speculators_trainer_unavailable  # noqa: E402

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


def trainer_argv(args, *, hs_dir: str, data_dir: str, vocab_dir: str, save_dir: str, aux_ids: list[int],
                 draft_vocab: int, tokens_per_step: int, holdout_fraction: float) -> list[str]:
    """speculators train's flags for our train flags: the same target, features, layers, vocabulary, TTT depth,
    learning rate, tokens per step and epochs. One checkpoint per epoch; the run stops at --max-steps."""
    argv = ["--verifier-name-or-path", args.model, "--data-path", data_dir, "--hidden-states-path", hs_dir,
            "--save-path", save_dir, "--draft-vocab-size", str(draft_vocab),
            "--d2t-path", os.path.join(vocab_dir, "d2t.npy"), "--t2d-path", os.path.join(vocab_dir, "t2d.npy"),
            "--epochs", str(max(1, math.ceil(args.epochs))), "--lr", str(args.lr),
            "--total-seq-len", str(tokens_per_step), "--ttt-steps", str(args.ttt_steps), "--on-missing", "raise",
            # speculators keeps a validation split of its own: at least 2 %, like our held-out default
            "--train-data-ratio", str(round(1.0 - max(holdout_fraction, 0.02), 6)),
            "--no-resume-from-checkpoint", "--log-dir", os.path.join(save_dir, "logs"),
            "--target-layer-ids", *[str(i) for i in aux_ids], "--optimizer", args.optimizer,
            # Its default fused Triton loss does not trace under torch 2.11's dynamo (seen on the H200: "ListVariable
            # ... is already tracked for mutation"); eager is speculators' own compatibility option.
            "--loss-implementation", "eager"]
    if args.max_steps is not None:
        argv += ["--max-steps", str(args.max_steps)]
    return argv


def latest_checkpoint(save_dir: str) -> str | None:
    """The highest-numbered epoch folder speculators wrote (config.json + model.safetensors)."""
    if not os.path.isdir(save_dir):
        return None
    nums = [int(n) for n in os.listdir(save_dir) if n.isdigit()
            and os.path.isfile(os.path.join(save_dir, n, "config.json"))]
    return os.path.join(save_dir, str(max(nums))) if nums else None


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
    return problems


def train(args, *, out: str, files: list[str], aux_ids: list[int], d2t, t2d, hidden: int, lengths: list[int],
          log) -> dict:
    """Run speculators' trainer in this process (torchrun's ranks each run it), then check and publish its last
    checkpoint as draft/export. Returns the step's result (the caller reports it)."""
    import time

    import torch

    from step_runtime import BadInput

    version = installed_version()
    why = speculators_trainer_unavailable(version, torch.cuda.is_available())
    if why:
        raise BadInput(f"--trainer speculators: {why}")
    names = [os.path.basename(p) for p in files]
    if names != [f"hs_{i}.safetensors" for i in range(len(files))]:
        raise BadInput(f"{os.path.dirname(files[0])}: --trainer speculators needs samples hs_0 .. hs_{len(files) - 1} "
                       f"without gaps (its rows are read by index)")
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    root = os.path.join(out, "draft", "speculators")
    data_dir, save_dir = os.path.join(root, "data"), os.path.join(root, "checkpoints")
    rank0 = int(os.environ.get("RANK", "0")) == 0
    # Under torchrun every rank runs this; speculators joins the process group only later, so the other ranks wait
    # for rank 0's rows by a marker naming this run (no collective exists yet).
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", str(os.getpid()))
    ready = os.path.join(data_dir, "READY")
    if rank0:
        shutil.rmtree(data_dir, ignore_errors=True)
        write_rows(files, data_dir + ".tmp")
        os.replace(data_dir + ".tmp", data_dir)
        with open(ready, "w") as f:
            f.write(run_id)
    else:
        deadline = time.time() + 3600
        while not (os.path.isfile(ready) and open(ready).read() == run_id):
            if time.time() > deadline:
                raise RuntimeError(f"rank 0 wrote no speculators rows to {data_dir} within an hour")
            time.sleep(1)
    tokens_per_step = args.tokens_per_step or max(lengths) * (args.batch_size or 8)
    argv = trainer_argv(args, hs_dir=os.path.join(out, "hidden_states"), data_dir=data_dir,
                        vocab_dir=os.path.join(out, "vocab"), save_dir=save_dir, aux_ids=aux_ids,
                        draft_vocab=int(d2t.shape[0]), tokens_per_step=tokens_per_step,
                        holdout_fraction=args.holdout_fraction)
    log(f"speculators {version} trainer: {' '.join(argv)}")
    t0 = time.time()
    spec_main(TrainConfig.resolve(argv))
    seconds = time.time() - t0
    ck = latest_checkpoint(save_dir)
    result = {"ok": True, "finished": True, "trainer": f"speculators {version}", "samples": len(files),
              "tokens_per_step": tokens_per_step,
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
    if rank0:
        tmp = export_dir + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(ck, tmp)
        shutil.rmtree(export_dir, ignore_errors=True)
        os.replace(tmp, export_dir)
        log(f"exported {export_dir} (speculators' checkpoint {ck})")
    result["export_dir"] = export_dir
    return result
