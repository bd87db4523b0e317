"""Train/serve parity of an EAGLE-3 draft: what vLLM will feed and read must be what the draft was trained on.

Each mismatch here costs acceptance silently (the engine serves the draft, it just rarely accepts): aux layer
ids differing between extraction and serving, a draft `max_position_embeddings` below the serving context, RoPE
settings that are not the target's (or not those the draft was trained with), and vocabulary maps (d2t/t2d)
that do not round-trip against the target's lm_head. The same checks run before training (train's inputs) and on
the exported folder (config.json + model.safetensors as vLLM reads them); each problem is one line naming it.

Run on an export: python -m kimi_eagle_host.draft.parity --model TARGET --export OUT/draft/export
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from kimi_eagle_host.step_runtime import BadInput, Refused, run_step
from kimi_eagle_host.target.model_layers import engine_default_aux_ids
from kimi_eagle_host.model_size import text_config_of

# What vLLM's model runner does (0.16 and 0.32 alike): the draft config's eagle_aux_hidden_state_layer_ids when
# the list is non-empty, else the target model's default (2, N//2, N-3); 0.32 then sorts and de-duplicates them.


def engine_aux_ids(draft_config: dict, num_layers: int) -> tuple[list[int], str]:
    """(the aux layer ids vLLM will capture for this draft, where they come from)."""
    ids = draft_config.get("eagle_aux_hidden_state_layer_ids")
    if ids:
        return sorted({int(i) for i in ids}), "its eagle_aux_hidden_state_layer_ids"
    return sorted(set(engine_default_aux_ids(num_layers))), "vLLM's default: the config has no eagle_aux_hidden_state_layer_ids"


def aux_ids_problem(draft_config: dict, num_layers: int, extracted: list[int], where: str) -> str | None:
    served, why = engine_aux_ids(draft_config, num_layers)
    if served != [int(i) for i in extracted]:
        return (f"aux layer ids: vLLM will feed the draft layers {served} ({why}) but the hidden states were "
                f"extracted from {list(extracted)} ({where})")
    return None


def serving_context(target_text: dict, max_model_len: int | None = None) -> int:
    """The longest context the engine will serve: --max-model-len where one is set, else the target's own."""
    return int(max_model_len or target_text.get("max_position_embeddings") or 0)


def context_problem(draft_layer: dict, context: int, where: str) -> str | None:
    mpe = draft_layer.get("max_position_embeddings")
    if not isinstance(mpe, int) or mpe < context:
        return (f"max_position_embeddings: the draft's {mpe!r} ({where}) is below the serving context {context}: "
                f"vLLM limits or mis-positions the draft past it")
    return None


def rope_of(cfg: dict) -> dict:
    """A config's RoPE as one dict {rope_type, rope_theta, scaling fields...}, whichever way it is written
    (transformers 5 `rope_parameters`, transformers 4 `rope_theta` + `rope_scaling`)."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params.pop("type")
    params.setdefault("rope_type", "default")
    theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
    params["rope_theta"] = float(theta)
    return params


def rope_problem(draft_layer: dict, target_text: dict, trained: dict, where: str) -> str | None:
    """The draft's RoPE must carry the target's theta and be exactly what the draft was trained with (a plain
    RoPE at the target's theta: see draft_layer_config), in every form a serving transformers reads."""
    want_theta = rope_of(target_text)["rope_theta"]
    forms = {"rope_parameters": draft_layer.get("rope_parameters"), "rope_theta": draft_layer.get("rope_theta")}
    got = rope_of(draft_layer)
    if got["rope_theta"] != want_theta or forms["rope_theta"] not in (None, want_theta):
        return (f"rope: the draft's rope_theta {forms['rope_theta'] or got['rope_theta']} ({where}) is not the "
                f"target's {want_theta}")
    if got != rope_of(trained):
        return f"rope: the draft's rope settings {got} ({where}) are not those it was trained with {rope_of(trained)}"
    # transformers 4 (vLLM <= 0.16 hosts) reads rope_theta + rope_scaling and never rope_parameters: that form too
    if draft_layer.get("rope_scaling") is not None:
        old_form = rope_of({"rope_theta": draft_layer.get("rope_theta", got["rope_theta"]),
                            "rope_scaling": draft_layer["rope_scaling"]})
        if old_form != rope_of(trained):
            return (f"rope: the draft's rope_scaling {draft_layer['rope_scaling']} ({where}), which transformers 4 "
                    f"serving reads, is not what it was trained with {rope_of(trained)}")
    return None


def vocab_problem(d2t, t2d, target_vocab: int, lm_head_rows: int | None, where: str) -> str | None:
    """d2t[i] + i is draft token i's target id; t2d marks the target ids the draft has. Every draft id must map
    into the target's vocabulary (= its lm_head rows), no two onto one, and back through t2d."""
    import numpy as np

    d2t, t2d = np.asarray(d2t).astype(np.int64).reshape(-1), np.asarray(t2d).astype(bool).reshape(-1)
    K = int(d2t.shape[0])
    if lm_head_rows is not None and lm_head_rows != target_vocab:
        return f"vocabulary: the target's lm_head has {lm_head_rows} rows but its vocab_size is {target_vocab}"
    if t2d.shape[0] != target_vocab:
        return f"vocabulary: t2d has {t2d.shape[0]} entries ({where}) but the target's vocabulary {target_vocab}"
    targets = d2t + np.arange(K)
    out = np.nonzero((targets < 0) | (targets >= target_vocab))[0]
    if out.size:
        i = int(out[0])
        return (f"vocabulary: d2t maps draft token {i} to target id {int(targets[i])}, outside the target's "
                f"0..{target_vocab - 1} ({where})")
    uniq, counts = np.unique(targets, return_counts=True)
    if (counts > 1).any():
        return f"vocabulary: d2t maps {int(counts.max())} draft tokens onto target id {int(uniq[counts.argmax()])} ({where})"
    lost = np.nonzero(~t2d[targets])[0]
    if lost.size:
        i = int(lost[0])
        return (f"vocabulary: draft token {i} -> target id {int(targets[i])} does not map back (t2d false there; "
                f"{where})")
    if int(t2d.sum()) != K:
        return f"vocabulary: t2d marks {int(t2d.sum())} target ids but d2t has {K} draft tokens ({where})"
    return None


def lm_head_problem(lm_head, d2t, t2d, where: str) -> str | None:
    """The round trip through the maps against the target's lm_head itself: train starts the draft's lm_head from
    the target's rows that t2d marks, in order, and vLLM reads draft token i as target id d2t[i] + i; both must be
    the same rows of this lm_head (a head with more or fewer rows than t2d has entries, or maps in another order,
    would start each draft token from another token's row)."""
    import torch

    rows = int(lm_head.shape[0])
    if rows != int(t2d.shape[0]):
        return (f"vocabulary: the target's lm_head has {rows} rows but t2d has {int(t2d.shape[0])} entries "
                f"({where}): the maps do not index this head")
    served = torch.as_tensor(d2t, dtype=torch.long) + torch.arange(int(d2t.shape[0]))
    started = torch.nonzero(torch.as_tensor(t2d, dtype=torch.bool)).squeeze(1)
    differ = torch.nonzero(started != served).squeeze(1) if started.shape == served.shape else torch.tensor([0])
    if differ.numel() or not torch.equal(lm_head[started], lm_head[served]):
        i = int(differ[0]) if differ.numel() else 0
        return (f"vocabulary: draft token {i} would start from the target's lm_head row {int(started[i])} (t2d) but "
                f"serve as target id {int(served[i])} (d2t) ({where})")
    return None


def refuse_first(problems, exc=BadInput) -> None:
    problems = [p for p in problems if p]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise exc(f"train/serve parity: {problems[0]}{more}")


def check_before_training(target_text: dict, draft_layer: dict, aux_ids: list[int], dc_path: str,
                          d2t, t2d, vocab_dir: str, lm_head_rows: int | None = None) -> None:
    """Train's inputs against what serving will do with the export it writes (BadInput on the first problem)."""
    N = int(target_text["num_hidden_layers"])
    would_write = {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}
    trained_rope = {"rope_type": "default", "rope_theta": draft_layer["rope_theta"]}
    refuse_first([
        aux_ids_problem(would_write, N, aux_ids, dc_path),
        context_problem(draft_layer, serving_context(target_text), "from the target's config"),
        rope_problem(draft_layer, target_text, trained_rope, "the draft's layer config"),
        vocab_problem(d2t, t2d, int(target_text["vocab_size"]), lm_head_rows, vocab_dir),
    ])


def export_problems(export_dir: str, target_text: dict, extracted_aux: list[int] | None, vocab_dir: str | None,
                    max_model_len: int | None = None) -> list[str]:
    """The exported folder as vLLM reads it, against the target, the extraction's layer ids (training_info.json,
    else `extracted_aux`) and the vocab step's maps (vocab_dir, when given)."""
    import numpy as np
    from safetensors import safe_open

    cfg_path, st_path = os.path.join(export_dir, "config.json"), os.path.join(export_dir, "model.safetensors")
    if not (os.path.isfile(cfg_path) and os.path.isfile(st_path)):
        return [f"{export_dir}: config.json or model.safetensors missing"]
    with open(cfg_path) as f:
        cfg = json.load(f)
    layer = cfg.get("transformer_layer_config") or {}
    info_path = os.path.join(export_dir, "training_info.json")
    where = f"{export_dir}/training_info.json"
    if os.path.isfile(info_path):
        with open(info_path) as f:
            extracted_aux = (json.load(f).get("data_config") or {}).get("layer_ids", [None])[:-1] or extracted_aux
    else:
        where = "the extraction's data_config.json"
    problems = []
    if extracted_aux:
        problems.append(aux_ids_problem(cfg, int(target_text["num_hidden_layers"]), extracted_aux, where))
    problems.append(context_problem(layer, serving_context(target_text, max_model_len), cfg_path))
    trained_rope = {"rope_type": "default", "rope_theta": rope_of(target_text)["rope_theta"]}
    problems.append(rope_problem(layer, target_text, trained_rope, cfg_path))
    V, K = int(target_text["vocab_size"]), cfg.get("draft_vocab_size")
    with safe_open(st_path, "np") as f:
        names = set(f.keys())
        rows = f.get_slice("lm_head.weight").get_shape()[0] if "lm_head.weight" in names else None
        if rows != K:
            problems.append(f"vocabulary: the draft's lm_head has {rows} rows but draft_vocab_size is {K} ({cfg_path})")
        if {"d2t", "t2d"} <= names:
            d2t, t2d = f.get_tensor("d2t"), f.get_tensor("t2d")
        elif K == V:
            d2t, t2d = np.zeros(V, np.int64), np.ones(V, bool)   # identity: vLLM needs no maps
        else:
            return [p for p in problems if p] + [f"vocabulary: {st_path} has no d2t/t2d for a draft vocabulary of "
                                                 f"{K} < the target's {V}"]
    problems.append(vocab_problem(d2t, t2d, V, None, st_path))
    if vocab_dir and K != V and all(os.path.isfile(os.path.join(vocab_dir, n)) for n in ("d2t.npy", "t2d.npy")):
        for name, got in (("d2t", d2t), ("t2d", t2d)):
            want = np.load(os.path.join(vocab_dir, f"{name}.npy"))
            if not np.array_equal(np.asarray(got).astype(want.dtype), want):
                problems.append(f"vocabulary: {st_path} tensor {name} differs from the vocab step's {vocab_dir}/{name}.npy")
    return [p for p in problems if p]


def check_export(export_dir: str, target_text: dict, extracted_aux=None, vocab_dir=None, max_model_len=None,
                 exc=Refused) -> None:
    refuse_first(export_problems(export_dir, target_text, extracted_aux, vocab_dir, max_model_len), exc)


def target_text_config(model_dir: str) -> dict:
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            return text_config_of(json.load(f))
    except (OSError, ValueError) as e:
        raise BadInput(f"{path}: cannot read the target's config ({e})") from None


def run(args) -> dict:
    export = os.path.abspath(args.export or os.path.join(args.output_dir, "draft", "export"))
    vocab_dir = os.path.join(args.output_dir, "vocab") if args.output_dir else None
    check_export(export, target_text_config(args.model), None, vocab_dir, args.max_model_len, exc=BadInput)
    return {"ok": True, "step": "parity", "export": export}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m kimi_eagle_host.draft.parity", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="target model folder")
    ap.add_argument("--export", default=None, help="draft export folder (default <output-dir>/draft/export)")
    ap.add_argument("--output-dir", default=None, help="pipeline root: its vocab/ maps are compared too")
    ap.add_argument("--max-model-len", type=int, default=None, help="serving context (default the target's)")
    return ap


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if not (args.export or args.output_dir):
        print("parity: give --export or --output-dir", file=sys.stderr)
        return 2
    return run_step("parity", run, args)


if __name__ == "__main__":
    sys.exit(main())
