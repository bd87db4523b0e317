"""speculators' own EAGLE-3 trainer (0.9, `speculators.train`) on the hidden states our extract wrote, timed the
way bench/gpu/side_by_side.py times ours: tokens/s between optimizer steps (data loading included, the first
--warmup steps left out) and peak CUDA memory.

    python bench/gpu/spec_train_bench.py --pipeline DIR --model TARGET --steps 60 --total-seq-len 16384 \
        --save-path DIR/spec_draft [-- more speculators train flags]

DIR is one of our pipeline roots: prepared/ (token ids + loss masks), hidden_states/hs_{i}.safetensors
(token_ids, hidden_states [T, L, H] with the final layer last: exactly speculators' FileTransfer format) and
vocab/d2t.npy + t2d.npy (speculators' convention). What speculators needs beside those, an HF `datasets`
folder with input_ids / loss_mask / seq_len and the vocab files next to it, is written to DIR/spec_data.
The draft shape is speculators' default EAGLE-3 (one Llama layer, the target's hidden size), the aux layer ids
are ours (data_config.json), the draft vocab is ours; batch = --total-seq-len tokens packed per step,
TTT steps --ttt-steps. Everything else is speculators' default (muon optimizer, KL loss, flex attention,
torch.compile), except the loss implementation (eager: the fused one fails to compile, see below).
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's kimi_eagle_host


def write_spec_data(pipeline: Path, dest: Path, seq_len: int) -> int:
    """speculators' ArrowDataset rows, row i <-> hidden_states/hs_{i}.safetensors; returns the row count."""
    import hashlib

    import pyarrow as pa
    from datasets import Dataset
    from kimi_eagle_host.data.prepared_data import PreparedDataset

    ds = PreparedDataset(str(pipeline / "prepared"))
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(len(ds)):
        ids, mask = ds[i]
        ids, mask = ids[:seq_len], mask[:seq_len]
        rows["input_ids"].append([int(t) for t in ids])
        rows["loss_mask"].append([int(m) for m in mask])
        rows["seq_len"].append(len(ids))
    if dest.exists():
        shutil.rmtree(dest)
    # An explicit fingerprint: datasets would otherwise hash the whole Arrow table with dill, which fails
    # on some pyarrow/dill pairs (seen: "Can't pickle <class 'MonthDayNano'>").
    fp = hashlib.sha256(json.dumps(rows["seq_len"]).encode()).hexdigest()[:16]
    Dataset(pa.Table.from_pydict(rows), fingerprint=fp).with_format("torch").save_to_disk(str(dest))
    for name in ("d2t.npy", "t2d.npy"):
        shutil.copy(pipeline / "vocab" / name, dest / name)
    return len(rows["seq_len"])


def main() -> None:
    argv = sys.argv[1:]
    extra = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pipeline", type=Path, required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--steps", type=int, required=True, help="optimizer steps (speculators' --max-steps)")
    ap.add_argument("--epochs", type=int, default=1)
    ap.add_argument("--total-seq-len", type=int, default=16384, help="tokens packed into one step")
    ap.add_argument("--ttt-steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of tokens/s (compilation)")
    ap.add_argument("--save-path", type=Path, required=True)
    ap.add_argument("--num-workers", type=int, default=8)
    a = ap.parse_args(argv)

    import numpy as np
    import torch

    dc = json.loads((a.pipeline / "hidden_states" / "data_config.json").read_text())
    t0 = time.time()
    data = a.pipeline / "spec_data"
    n_rows = write_spec_data(a.pipeline, data, int(dc.get("seq_len", 2048)))
    prep_s = time.time() - t0
    k = int(np.load(a.pipeline / "vocab" / "d2t.npy").shape[0])

    from speculators.train import trainer as trainer_mod
    from speculators.train.cli import main as spec_main
    from speculators.train.config import TrainConfig

    # Timing hooks only: a timestamp after every optimizer step (synchronised) and the real tokens of each
    # batch (document_ids != -1, what speculators itself counts). The training code is untouched.
    marks: list[tuple[float, int]] = []
    pending = {"tokens": 0}
    orig_step = trainer_mod.Trainer._optimizers_step
    orig_init = trainer_mod.Trainer.__init__

    def timed_step(self, *args, **kw):
        out = orig_step(self, *args, **kw)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        marks.append((time.perf_counter(), pending["tokens"]))
        return out

    def hooked_init(self, model, *args, **kw):
        orig_init(self, model, *args, **kw)

        def count(_mod, _args, kwargs):
            d = kwargs.get("document_ids")
            if d is not None:
                pending["tokens"] = int((d != -1).sum().item())
        model.register_forward_pre_hook(count, with_kwargs=True)

    trainer_mod.Trainer._optimizers_step = timed_step
    trainer_mod.Trainer.__init__ = hooked_init

    layer_ids = [int(i) for i in dc["layer_ids"]]
    args = ["--verifier-name-or-path", a.model, "--data-path", str(data),
            "--hidden-states-path", str(a.pipeline / "hidden_states"), "--save-path", str(a.save_path),
            "--draft-vocab-size", str(k), "--d2t-path", str(data / "d2t.npy"), "--t2d-path", str(data / "t2d.npy"), "--epochs", str(a.epochs), "--max-steps", str(a.steps),
            "--total-seq-len", str(a.total_seq_len), "--ttt-steps", str(a.ttt_steps), "--on-missing", "raise",
            "--num-workers", str(a.num_workers), "--log-freq", "1000000", "--train-data-ratio", "0.98",
            "--no-resume-from-checkpoint", "--log-dir", str(a.save_path / "logs"),
            # The default fused Triton loss does not trace under torch 2.11's dynamo (seen on the H200:
            # "ListVariable ... is already tracked for mutation" in losses/fused.py); eager is speculators'
            # own compatibility option, and the rest of the forward stays compiled.
            "--loss-implementation", "eager",
            "--target-layer-ids", *[str(i) for i in layer_ids[:-1]], *extra]
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    t1 = time.time()
    spec_main(TrainConfig.resolve(args))
    wall = time.time() - t1
    steady = marks[a.warmup:]
    tps = None
    if len(steady) >= 2:
        tokens = sum(t for _, t in steady[1:])
        tps = tokens / (steady[-1][0] - steady[0][0])
    per_step = [marks[i][1] / (marks[i][0] - marks[i - 1][0]) for i in range(max(1, a.warmup), len(marks))]
    ckpts = sorted(p for p in a.save_path.iterdir() if p.is_dir() and p.name.isdigit()) if a.save_path.exists() else []
    from importlib.metadata import version

    print(json.dumps({
        "trainer": f"speculators {version('speculators')}", "rows": n_rows,
        "steps": len(marks), "warmup_steps_excluded": a.warmup, "total_seq_len": a.total_seq_len,
        "ttt_steps": a.ttt_steps, "draft_vocab_size": k, "aux_layer_ids": layer_ids[:-1],
        "tokens_per_s": round(tps, 1) if tps else None,
        "tokens_per_s_median_step": round(statistics.median(per_step), 1) if per_step else None,
        "mean_tokens_per_step": round(statistics.mean(t for _, t in marks), 1) if marks else None,
        "cuda_peak_mem_gb": round(torch.cuda.max_memory_allocated() / 2**30, 2) if torch.cuda.is_available() else None,
        "wall_s": round(wall, 1), "data_prep_s": round(prep_s, 1),
        "export_dir": str(ckpts[-1]) if ckpts else None}))


if __name__ == "__main__":
    main()
