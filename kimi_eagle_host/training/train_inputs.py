"""What train reads and checks before any device is touched: its flags, the extraction's record (or, online, what
extract would record), the samples, the vocabulary maps and the target's config, each against the others.

Every refusal here is a BadInput (exit 2, nothing changed), in the order a user meets them.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np
import torch

from kimi_eagle_host.data import hs_manifest  # (the samples of one extraction, never a folder listing)
from kimi_eagle_host.data import online_stream  # (hidden_states online: the engine feeds the trainer)
from kimi_eagle_host.data.hidden_state_files import check_sample_headers
from kimi_eagle_host.data.prepared_data import check_vocab_built_from, manifest_digest, prompt_keys
from kimi_eagle_host.draft import parity
from kimi_eagle_host.draft.draft_model import draft_layer_config, load_target_config
from kimi_eagle_host.step_runtime import BadInput, log, model_fingerprint
from kimi_eagle_host.target.model_layers import LayerIdError, parse_layer_ids
from kimi_eagle_host.training.tracker import wanted


@dataclass
class TrainInputs:
    """The checked inputs of a training run (paths under --output-dir `out`)."""
    out: str
    online: bool
    dc: dict                 # data_config.json: what extract recorded (online: what it would record)
    dc_path: str             # where dc comes from, for messages
    files: list | None       # the sample files (online: None, the engine makes them)
    lengths: list[int]       # tokens of each document
    layer_ids: list[int]     # vLLM convention; the last one is num_layers
    num_layers: int
    hidden: int
    d2t: torch.Tensor        # draft id -> target id - draft id (int64 [K])
    t2d: torch.Tensor        # target id -> in the draft vocabulary (bool [target vocab])
    tcfg: dict               # the target's text config
    archs: list
    draft_cfg: dict          # the draft layer's config (draft_layer_config)
    draft_to_target: torch.Tensor   # d2t + arange(K): the target id of each draft id
    weights: str | None      # the target's weights fingerprint (step_runtime.model_fingerprint; None: a hub id)
    prompt_keys: list | None = None   # each document's prompt (prepared_data.prompt_keys; None: no prepared data)

    @property
    def hs_dir(self) -> str:
        return os.path.join(self.out, "hidden_states")

    @property
    def vocab_dir(self) -> str:
        return os.path.join(self.out, "vocab")

    @property
    def aux_ids(self) -> list[int]:
        return self.layer_ids[:-1]

    @property
    def draft_vocab(self) -> int:
        return self.d2t.shape[0]

    @property
    def n_tokens(self) -> int:
        return sum(self.lengths)


def check_flags(args) -> None:
    """The flags' own ranges, before any file is read."""
    for name in ("batch_size", "tokens_per_step", "pack_len", "ttt_steps", "log_every", "save_every"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise BadInput(f"--{name.replace('_', '-')}: must be >= 1")
    wanted(args.report_to)  # a tracker asked for by name and missing: said before any work
    if args.ttt_steps > 7:
        raise BadInput(f"--ttt-steps {args.ttt_steps}: at most 7 (EAGLE-3's depth)")
    if not 0 <= args.holdout_fraction < 1:
        raise BadInput(f"--holdout-fraction {args.holdout_fraction}: must be in [0, 1)")
    if args.trainer == "speculators":   # its trainer builds its own one-layer draft: these would be ignored
        shaped = [f"--{n.replace('_', '-')}" for n in ("draft_num_heads", "draft_num_kv_heads",
                                                         "draft_intermediate_size") if getattr(args, n) is not None]
        shaped += ["--draft-layers"] if args.draft_layers != 1 else []
        if shaped:
            raise BadInput(f"{', '.join(shaped)}: only with --trainer ours (speculators' trainer builds a one-layer "
                           f"draft of the target's shape)")


def read_data_config(args, out: str) -> tuple[dict, str, list | None, list[int] | None]:
    """(data_config, its path, sample files, lengths); offline the files and lengths come later (read_samples)."""
    hs_dir = os.path.join(out, "hidden_states")
    dc_path = os.path.join(hs_dir, "data_config.json")
    files = lengths = None
    if args.hidden_states == "online":
        # what extract would record, and the lengths, from the prepared data and the target's config
        dc, lengths = online_stream.inputs(args, out)
        dc_path = os.path.join(out, "prepared", "manifest.json")
    elif not os.path.isfile(dc_path):
        raise BadInput(f"{dc_path}: missing (run extract first)")
    else:
        with open(dc_path) as f:
            dc = json.load(f)
    for field in ("layer_ids", "num_layers", "hidden_size"):
        if field not in dc:
            raise BadInput(f"{dc_path}: missing field '{field}'")
    return dc, dc_path, files, lengths


def check_layer_ids(dc: dict, dc_path: str) -> tuple[list[int], int, int]:
    """(layer ids, num_layers, hidden size) of data_config, refused unless vLLM would feed the draft the same."""
    conv = str(dc.get("layer_convention", "vllm"))
    if not conv.startswith("vllm"):
        # Features captured in another convention (e.g. "output of layer i") are shifted by one layer
        # from what vLLM feeds the draft at serving time; training on them would silently hurt acceptance.
        raise BadInput(f"{dc_path}: layer_convention {conv!r}: expected the vLLM convention")
    layer_ids, N, H = [int(i) for i in dc["layer_ids"]], int(dc["num_layers"]), int(dc["hidden_size"])
    if len(layer_ids) < 2 or layer_ids[-1] != N:
        raise BadInput(f"{dc_path}: layer_ids {layer_ids}: the last id must be num_layers={N} (the final "
                         f"hidden state that yields the training targets) after at least one aux layer")
    if layer_ids != sorted(set(layer_ids)):
        # vLLM concatenates the aux states in layer order at serving time; features stacked in another order
        # would reach the trained fc shuffled. (extract sorts them since; older extractions kept the given order.)
        raise BadInput(f"{dc_path}: layer_ids {layer_ids} are not in increasing order: vLLM feeds the draft its "
                       f"aux layers in layer order; re-extract (extract sorts them)")
    return layer_ids, N, H


def check_extracted_for(args, dc: dict, dc_path: str, weights: str | None) -> None:
    """Offline, the hidden states must come from the target, layers and cut train is given: features of other
    weights beside this target's head, or other layers than --layer-ids asked for, would train a draft that serves
    worse, with nothing said."""
    extracted = dc.get("weights_fingerprint")
    if extracted and weights and extracted != weights:
        raise BadInput(f"{dc_path}: the hidden states were extracted from other weights (fingerprint {extracted}) "
                       f"than --model {args.model} ({weights}); run extract again for this model")
    if getattr(args, "layer_ids", None) is not None:
        try:
            asked = parse_layer_ids(args.layer_ids, int(dc["num_layers"]))
        except LayerIdError as e:
            raise BadInput(str(e)) from None
        if asked != [int(i) for i in dc["layer_ids"]]:
            raise BadInput(f"--layer-ids {','.join(map(str, asked))}: the hidden states in {os.path.dirname(dc_path)} "
                           f"hold layers {dc['layer_ids']}; run extract again with these ids, or train on those")
    cut = dc.get("seq_len")
    if isinstance(cut, int) and getattr(args, "seq_len", None) is not None:
        if args.seq_len < cut:
            raise BadInput(f"--seq-len {args.seq_len}: the hidden states were extracted at seq_len {cut} and train "
                           f"reads them whole; run extract again at {args.seq_len}, or train with seq_len {cut}")
        if args.seq_len > cut:
            log(f"note: --seq-len {args.seq_len}: the hidden states hold samples cut at {cut} tokens (extract's "
                f"seq_len); train reads them as they are")


def read_vocab(vocab_dir: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) as vocab wrote them."""
    for name in ("d2t.npy", "t2d.npy"):
        if not os.path.isfile(os.path.join(vocab_dir, name)):
            raise BadInput(f"{os.path.join(vocab_dir, name)}: missing (run vocab first)")
    d2t = torch.from_numpy(np.load(os.path.join(vocab_dir, "d2t.npy")).astype(np.int64))
    t2d = torch.from_numpy(np.load(os.path.join(vocab_dir, "t2d.npy")).astype(bool))
    return d2t, t2d


def read_inputs(args, out: str) -> TrainInputs:
    """The inputs of a run, checked against each other and against the target (--model)."""
    dc, dc_path, files, lengths = read_data_config(args, out)
    layer_ids, N, H = check_layer_ids(dc, dc_path)
    aux_ids = layer_ids[:-1]
    hs_dir, vocab_dir = os.path.join(out, "hidden_states"), os.path.join(out, "vocab")
    # Exactly the samples of this extraction, and only if they come from the prepared data at hand (when the
    # folder has one: hidden states copied alone to a training host carry their own manifest).
    weights = model_fingerprint(args.model)
    if args.hidden_states != "online":
        check_extracted_for(args, dc, dc_path, weights)
        files = hs_manifest.read_samples(hs_dir, dc, manifest_digest(os.path.join(out, "prepared")))
        lengths = check_sample_headers(files, len(layer_ids), H)
    check_vocab_built_from(vocab_dir, dc.get("prepared_sha256"))
    keys = documents_prompts(out, dc, len(lengths))
    d2t, t2d = read_vocab(vocab_dir)
    K = d2t.shape[0]

    tcfg, archs = load_target_config(args.model)
    if tcfg["hidden_size"] != H:
        raise BadInput(f"{dc_path}: hidden_size {H} != target hidden_size {tcfg['hidden_size']}")
    if tcfg["num_hidden_layers"] != N:
        raise BadInput(f"{dc_path}: num_layers {N} != target num_hidden_layers {tcfg['num_hidden_layers']}")
    if t2d.shape[0] != tcfg["vocab_size"]:
        raise BadInput(f"{vocab_dir}/t2d.npy: length {t2d.shape[0]} != target vocab_size {tcfg['vocab_size']}")
    c = draft_layer_config(tcfg, args)
    parity.check_before_training(tcfg, c, aux_ids, dc_path, d2t.numpy(), t2d.numpy(), vocab_dir)
    # t2d's true positions in order are the draft ids' targets (both are built sorted by target id);
    # if not, rows of the target lm_head would land on the wrong draft ids.
    draft_to_target = d2t + torch.arange(K)
    if not torch.equal(torch.nonzero(t2d).squeeze(1), draft_to_target):
        raise BadInput(f"{vocab_dir}/d2t.npy: draft ids must map to increasing target ids")
    return TrainInputs(out=out, online=args.hidden_states == "online", dc=dc, dc_path=dc_path, files=files,
                       lengths=lengths, layer_ids=layer_ids, num_layers=N, hidden=H, d2t=d2t, t2d=t2d, tcfg=tcfg,
                       archs=archs, draft_cfg=c, draft_to_target=draft_to_target, weights=weights,
                       prompt_keys=keys)


def documents_prompts(out: str, dc: dict, n: int) -> list | None:
    """Each document's prompt (prepared_data.prompt_keys), from the prepared data the documents come from, so that
    the held-out split keeps documents with the same prompt together; None where it is not at hand (hidden states
    copied alone to a training host: the split is then by document, and choose, which reads it too, refuses)."""
    prepared = os.path.join(out, "prepared")
    if not dc.get("prepared_sha256") or manifest_digest(prepared) != dc["prepared_sha256"]:
        return None
    keys = prompt_keys(prepared)
    return keys if len(keys) == n else None
