"""What a training run exports in speculators' Eagle3 format (what vLLM loads): draft/export at the end of a finished
run, and with --choose-checkpoints N the candidates the choose step serves (draft/candidates.py). Every rank calls
these (FSDP gathers the shards); rank 0 writes."""
from __future__ import annotations

import json
import os

from kimi_eagle_host.draft import candidates  # (choose_checkpoints: the exports the choose step serves)
from kimi_eagle_host.data.prepared_data import PROMPT_KEYS_FILE, write_prompt_keys
from kimi_eagle_host.draft import parity
from kimi_eagle_host.draft.draft_model import Eagle3Draft, export_speculators
from kimi_eagle_host.step_runtime import atomic_write_json, log
from kimi_eagle_host.training import distributed as dist_  # (ranks, collectives, DDP/FSDP state)
from kimi_eagle_host.training.train_run import TrainRun


def plain_copy(run: TrainRun):
    """The draft as one plain module on rank 0 (FSDP: its shards gathered, so every rank must call this)."""
    plain = dist_.unwrap(run.model)
    if run.sharding == "fsdp":
        msd, _ = dist_.full_state(run.model, run.opt, run.sharding, run.trainable_names)
        i = run.inputs
        plain = Eagle3Draft(i.draft_cfg, len(i.aux_ids), i.draft_vocab, bool(run.args.norm_before_residual))
        if run.w.main:
            plain.load_state_dict(msd)
    return plain


def export_to(run: TrainRun, folder: str, plain) -> dict:
    """`plain` (rank 0's plain_copy) exported to `folder`; its config."""
    i = run.inputs
    return export_speculators(folder, plain, i.draft_cfg, i.aux_ids, i.d2t, i.t2d, run.args, i.archs, run.head.embed,
                              run.dtype)


def export_candidate(run: TrainRun, step: int) -> None:
    """This step's weights as an export the choose step will serve (every rank calls it)."""
    plain = plain_copy(run)
    if run.w.main:
        export_to(run, candidates.folder(run.out, step), plain)
        candidates.record(run.out, run.data.held_docs, run.inputs.dc.get("prepared_sha256"), run.total)
        log(f"candidate for choose: step {step} exported to {candidates.folder(run.out, step)}")
    dist_.barrier()


def export_final(run: TrainRun, result: dict, history: list, evals: list) -> None:
    """draft/export of a finished run, with its training_info.json; checked as vLLM will read it (else not a
    success). Adds export_config and export_dir to `result`."""
    i, export_dir = run.inputs, run.export_dir
    plain = plain_copy(run)
    if run.w.main:
        # choose's record of the checkpoint it installed here earlier: not this export's (eval reports it)
        selection = os.path.join(export_dir, "selection.json")
        if os.path.exists(selection):
            os.unlink(selection)
        final = history[-1] if history else earlier_final(export_dir, run.meta)
        cfg = export_to(run, export_dir, plain)
        write_training_info(export_dir, i.dc, run.meta, run.inputs.prompt_keys, run.out,
                            final=final, heldout=evals[-1] if evals else None)
        result["export_config"] = {k: cfg[k] for k in ("eagle_aux_hidden_state_layer_ids", "draft_vocab_size")}
        parity.check_export(export_dir, i.tcfg, i.aux_ids, i.vocab_dir)   # as vLLM will read it: else not a success
        log(f"exported {export_dir}")
    result["export_dir"] = export_dir
    dist_.barrier()


def write_training_info(export_dir: str, data_config: dict, meta: dict, keys: list | None, out: str, *,
                        final=None, heldout=None, trainer: str | None = None) -> None:
    """An export's training_info.json: the data (data_config), the run's settings and size (meta: n_samples,
    holdout, total_steps are what eval reports), its last figures, and the prompts it was trained on
    (record_prompt_keys). Whichever trainer made the export (`trainer`: speculators' names itself)."""
    atomic_write_json(os.path.join(export_dir, "training_info.json"),
                      {"data_config": data_config, "meta": meta, "final": final, "heldout": heldout,
                       "prompt_keys": record_prompt_keys(export_dir, keys, out),
                       **({"trainer": trainer} if trainer else {}),
                       # which job wrote this export: `pull JOB` takes it only for that job
                       "job_id": os.environ.get("KIMI_EAGLE_JOB_ID")})


def record_prompt_keys(export_dir: str, keys: list | None, out: str) -> dict | None:
    """The prompts of the prepared data the draft was trained on (held-out documents included), as a file beside the
    export (prepared_data.write_prompt_keys): eval's seen_in_training reads it instead of every document's loss mask.
    None, and no file (an earlier run's removed), where train had no prepared data to read them from."""
    path = os.path.join(export_dir, PROMPT_KEYS_FILE)
    if keys is None:
        if os.path.exists(path):
            os.unlink(path)
        return None
    n = write_prompt_keys(export_dir, keys)
    return {"file": PROMPT_KEYS_FILE, "prompts": n, "prepared": os.path.join(out, "prepared")}


def earlier_final(export_dir: str, meta: dict):
    """The last training step's figures the export of this same run recorded, for an export again without training
    (a run resumed at its last step: a requeued job); None when there is none or it was another run's."""
    try:
        with open(os.path.join(export_dir, "training_info.json"), encoding="utf-8") as f:
            info = json.load(f)
    except (OSError, ValueError):
        return None
    return info.get("final") if isinstance(info, dict) and info.get("meta") == meta else None
