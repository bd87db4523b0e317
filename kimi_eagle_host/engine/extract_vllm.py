"""`extract --engine vllm`: the two ways vLLM extracts hidden states, picked by the host's vLLM version
(vllm_compat.extraction_path says which and why).

  speculators  vLLM <= 0.16: speculators' in-process VllmHiddenStatesGenerator (0.3.0 / 0.4.0) on an install
               carrying the kimi-eagle patch. Their layer convention is shifted by one (translated here).
  native       vLLM >= 0.18: an LLM engine with speculative_config method "extract_hidden_states" and our KV
               connector (vllm_hs_connector.py), which writes each sample file itself, in the worker. Layer ids
               pass unchanged: vLLM's convention is ours (id i = input of layer i, id N = last layer's output).

Both write the samples extract.py's hf engine writes (hs_{i}.safetensors), atomically; extract.py decides which
samples still need doing (resume) and records data_config.json.
"""
import os
import sys
import time

from kimi_eagle_host.data.hidden_state_files import error_path, sample_path, taken_path
from kimi_eagle_host.target.model_layers import LayerIdError
from kimi_eagle_host.step_runtime import Refused, log, payload_root, progress, stdout_for_result_only
from kimi_eagle_host.versions import at_least
from kimi_eagle_host.model_size import read_text_config
from kimi_eagle_host.vllm_compat import (CPU_KV_ENV, engine_env_defaults, extraction_path, size_engine,
                                         text_only_engine_kwargs, vllm_install)

KIMI_EAGLE_PATCH_MARKER = "kimi-eagle-patch"
CONNECTOR = "KimiEagleHiddenStatesConnector"
CONNECTOR_MODULE = "kimi_eagle_host.engine.vllm_hs_connector"
# How long to wait, after generate() returned, for the connector's writer threads to finish a chunk.
WRITE_WAIT_S = float(os.environ.get("KIMI_EAGLE_CONNECTOR_WAIT_S", "600"))


def choose_path():
    """('speculators' | 'native', vllm install or None, why); raise Refused where neither applies.

    Without vLLM at all we still take the speculators path: its checks (installed? patched?) come first and name
    what is missing, and a patched speculators without vLLM fails on import with vLLM's own message.
    """
    inst = vllm_install()
    if inst is None:
        return "speculators", None, "vLLM is not installed"
    path, why = extraction_path(inst["version"], inst["dir"])
    if path is None:
        raise Refused(f"--engine vllm: {why}")
    return path, inst, why


def prepare_environment():
    """Before vLLM is imported: its workers are spawned (CUDA cannot be re-initialised in a fork), and nothing
    but our one JSON result reaches stdout (vLLM and its workers' gloo print there)."""
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    engine_env_defaults()
    stdout_for_result_only()


# ----------------------------------------------------------------------------------------------------
# speculators 0.3 / 0.4 in-process generator (vLLM <= 0.16)

def to_speculators_layer_ids(layer_ids, num_layers, speculators_version):
    """Translate our ids (vLLM convention) to what the installed speculators' generator captures.

    speculators 0.3.0 / 0.4.0 record the OUTPUT of decoder layer j (valid j: 0..N-1), so our id i (input of
    layer i = output of layer i-1) is their j = i-1, and our id N is their N-1. Our id 0 (the embeddings) has
    no equivalent. speculators >= 0.5 delegates to vLLM's own convention, which is ours: ids pass unchanged.
    """
    n = int(num_layers)
    for lid in layer_ids:
        if not 0 <= lid <= n:
            raise LayerIdError(f"layer id {lid} is out of range 0..{n}")
    if at_least(speculators_version, "0.5"):
        return list(layer_ids)
    if 0 in layer_ids:
        raise LayerIdError(
            f"layer id 0 (the embeddings = input of decoder layer 0) cannot be captured by speculators "
            f"{speculators_version}, which records the output of layer j (our id i is its j = i-1); use ids 1..{n}")
    return [lid - 1 for lid in layer_ids]


def check_speculators_patch():
    """(version, location) of an installed, kimi-eagle-patched speculators, else raise Refused.

    Uses importlib.metadata only: importing speculators would import vLLM (slow, may initialise CUDA).
    """
    from importlib import metadata

    try:
        dist = metadata.distribution("speculators")
    except metadata.PackageNotFoundError:
        raise Refused(f"--engine vllm: speculators is not installed for {sys.executable}; install speculators "
                      f"0.3/0.4 and apply the kimi-eagle patch, or use --engine hf") from None
    location = str(dist.locate_file(""))
    for f in dist.files or []:
        name = str(f).replace("\\", "/")
        if not (name.startswith("speculators/") and name.endswith(".py")):
            continue
        try:
            with open(f.locate(), encoding="utf-8", errors="replace") as fh:
                if KIMI_EAGLE_PATCH_MARKER in fh.read():
                    return dist.version, location
        except OSError:
            continue
    raise Refused(f"--engine vllm: speculators {dist.version} at {location} is not patched (no "
                  f"'{KIMI_EAGLE_PATCH_MARKER}' marker in its files); apply the kimi-eagle patch first, or use --engine hf")


def cpu_kv_cache_budget(torch, gen_module):
    """Let speculators' generator size its KV cache on a CPU-only vLLM (a laptop, CI).

    The generator (in this, the driver process) sizes the cache from the accelerator's free memory: 0.3.0 calls
    torch.cuda.mem_get_info() (raises without CUDA) and torch.cuda.empty_cache(); 0.4.0 calls its own
    mem_get_info(), which answers (0, 0) without an accelerator, so no cache fits. On a CPU host the cache lives in
    host memory and vLLM's own knob for its size is VLLM_CPU_KVCACHE_SPACE (GiB): we answer the generator's query
    with that budget, in this process only, rather than patching more of speculators' files than the patch set.
    """
    gib = float(os.environ.get(CPU_KV_ENV) or 1)
    # The generator keeps free * gpu_memory_utilization (0.8) * CACHE_MEMORY_FRACTION of what we report.
    share = 0.8 * float(getattr(gen_module, "CACHE_MEMORY_FRACTION", 1.0))
    free = int(gib * (1 << 30) / share)

    def mem_get_info(*_a, **_k):
        return free, free

    def empty_cache(*_a, **_k):
        return None

    torch.cuda.mem_get_info = mem_get_info    # 0.3.0 calls torch.cuda directly
    torch.cuda.empty_cache = empty_cache
    for name, fn in (("mem_get_info", mem_get_info), ("empty_cache", empty_cache)):
        if hasattr(gen_module, name):          # 0.4.0 imported its helpers by name
            setattr(gen_module, name, fn)
    log(f"[extract] no CUDA device: KV cache budget {gib:g} GiB of host memory (set {CPU_KV_ENV} to change)")


def extract_speculators(args, ds, todo, layer_ids, info, writer, spec_version):
    import torch

    spec_ids = to_speculators_layer_ids(layer_ids, info["num_layers"], spec_version)
    if at_least(spec_version, "0.5"):
        raise Refused(f"--engine vllm: speculators {spec_version} has no in-process generator (it extracts through "
                      f"a vLLM server); use speculators 0.3/0.4 with the kimi-eagle patch, or --engine hf")
    info.update(speculators_layer_ids=spec_ids)
    from speculators.data_generation import vllm_hidden_states_generator as gen_module

    torch_dtype = getattr(torch, info["dtype"])
    if not torch.cuda.is_available():
        cpu_kv_cache_budget(torch, gen_module)
    # The generator truncates prompts to max_model_len - 1 (it reserves one decode token).
    gen = gen_module.VllmHiddenStatesGenerator(model_path=args.model, layer_ids=spec_ids,
                                               max_model_len=args.seq_len + 1, tensor_parallel_size=args.tp_size)
    t_loop = time.time()
    order = sorted(todo, key=lambda i: (-len(ds[i][0]), i))
    tokens = 0
    bar = progress(None, total=len(order), desc="extract[vllm]")
    try:
        for b in range(0, len(order), args.batch_size):
            batch = order[b:b + args.batch_size]
            seqs = {i: ds[i][0][:args.seq_len] for i in batch}
            results = gen.generate([seqs[i].tolist() for i in batch])
            # speculators 0.4 returns results in sorted request-id order, not input order: pair by token ids.
            waiting = {}
            for i in batch:
                waiting.setdefault(tuple(seqs[i].tolist()), []).append(i)
            for r in results:
                key = tuple(torch.as_tensor(r["input_ids"]).tolist())
                if not waiting.get(key):
                    raise RuntimeError("speculators returned hidden states for a sequence that was not requested "
                                       "(truncated or reordered tokens)")
                i = waiting[key].pop()
                layers = r["hidden_states"]
                if len(layers) != len(layer_ids):
                    raise RuntimeError(f"speculators returned {len(layers)} layers, expected {len(layer_ids)}")
                hs = torch.stack([h.to("cpu") for h in layers], dim=1).to(torch_dtype)
                mask = ds[i][1][:args.seq_len]
                writer.put(i, torch.from_numpy(seqs[i].copy()), hs, torch.from_numpy(mask.astype("int64")))
                tokens += len(seqs[i])
            if any(waiting.values()):
                raise RuntimeError(f"speculators returned no hidden states for samples "
                                   f"{sorted(i for v in waiting.values() for i in v)}")
            if hasattr(bar, "update"):  # tokens: the bar's tokens/s in `kimi-eagle logs`
                bar.update(len(batch), tokens=sum(len(seqs[i]) for i in batch))
    finally:
        if hasattr(bar, "close"):
            bar.close()
        writer.close()
    info["extract_seconds"] = time.time() - t_loop  # the steady state: after the model load, until all is written
    return writer.written, tokens


# ----------------------------------------------------------------------------------------------------
# native extraction (vLLM >= 0.18): extract_hidden_states + our KV connector

def native_engine(args, layer_ids, info, out_dir, chunk):
    """(llm, SamplingParams, LOSS_MASK_KEY): one vLLM engine extracting `layer_ids`, whose connector writes each
    sample where its request says, under `out_dir`."""
    import torch

    from kimi_eagle_host.engine.vllm_hs_connector import LOSS_MASK_KEY

    # The workers import the connector by module name: the folder that holds our package must be on their path
    # (they are spawned; a job's PYTHONPATH already names it, a step started otherwise may not).
    os.environ["PYTHONPATH"] = payload_root() + (os.pathsep + os.environ["PYTHONPATH"] if os.environ.get("PYTHONPATH") else "")
    on_gpu = torch.cuda.is_available()
    # Before vLLM is imported: it reads its environment once. The prompt plus the one token vLLM samples.
    # Our connector saves a finished request's hidden states in a later engine step: only vLLM's engine process keeps
    # stepping after generate() returns (in this process the last chunk's files were never written).
    memory = size_engine("extract", args.model, args.tp_size, args.seq_len + 1, chunk, in_process_on_cpu=False,
                         beside_trainer=getattr(args, "beside_trainer", False),
                         extra_bytes_per_token=hidden_state_bytes_per_token(args.model, layer_ids, info["dtype"]))
    from vllm import LLM, EngineArgs, SamplingParams

    t0 = time.time()
    llm = LLM(model=args.model, dtype=info["dtype"], tensor_parallel_size=args.tp_size, trust_remote_code=True,
              max_model_len=args.seq_len + 1,   # the prompt plus the one token vLLM insists on sampling
              enforce_eager=not on_gpu,         # torch.compile on CPU costs minutes and gains little here
              enable_prefix_caching=False, disable_log_stats=True,
              **memory["kwargs"], **text_only_engine_kwargs(args.model, EngineArgs),
              speculative_config={"method": "extract_hidden_states", "num_speculative_tokens": 1,
                                  "draft_model_config": {"hf_config": {
                                      "eagle_aux_hidden_state_layer_ids": list(layer_ids)}}},
              kv_transfer_config={"kv_connector": CONNECTOR, "kv_connector_module_path": CONNECTOR_MODULE,
                                  "kv_role": "kv_producer",
                                  "kv_connector_extra_config": {
                                      "shared_storage_path": out_dir,
                                      # our own driver names each file (hs_{i}); nobody else talks to this engine
                                      "allow_custom_save_path": True,
                                      # files appear by rename, complete: no lock files needed
                                      "use_synchronization_lock": False,
                                      "num_writer_threads": max(1, args.writers)}})
    log(f"[extract] vLLM engine up in {time.time() - t0:.1f}s (native extract_hidden_states, ids {layer_ids})")
    return llm, SamplingParams, LOSS_MASK_KEY


def hidden_state_bytes_per_token(model_dir, layer_ids, dtype) -> int:
    """What extract_hidden_states keeps per token in the engine's KV-cache blocks until our connector saves it: one
    hidden_size vector per captured layer (vLLM's CacheOnly attention layer). 0 when the config does not say."""
    try:
        hidden = int((read_text_config(model_dir) or {})["hidden_size"])
    except (KeyError, ValueError, TypeError):
        return 0
    return len(layer_ids) * hidden * (4 if dtype == "float32" else 2)


def native_chunk(engine, ds, seq_len, part) -> int:
    """Extract `part`, a list of (dataset index, sample path), through the engine; wait until every file is
    written. Returns the tokens."""
    llm, SamplingParams, LOSS_MASK_KEY = engine
    prompts, params, tokens = [], [], 0
    for i, path in part:
        ids, mask = ds[i]
        ids, mask = ids[:seq_len], mask[:seq_len]
        if os.path.exists(error_path(path)):
            os.unlink(error_path(path))
        prompts.append({"prompt_token_ids": [int(t) for t in ids]})
        params.append(SamplingParams(max_tokens=1, extra_args={"kv_transfer_params": {
            "hidden_states_path": path, LOSS_MASK_KEY: [int(m) for m in mask]}}))
        tokens += len(ids)
    llm.generate(prompts, params, use_tqdm=False)
    _wait_for_samples([path for _, path in part])
    return tokens


def extract_native(args, ds, todo, layer_ids, info, out_dir):
    """Every todo sample through one vLLM engine; the connector writes hs_{i}.safetensors in the worker."""
    chunk = max(64, args.batch_size)
    engine = native_engine(args, layer_ids, info, out_dir, chunk)
    t_loop = time.time()
    order = sorted(todo, key=lambda i: (-len(ds[i][0]), i))
    written = tokens = 0
    bar = progress(None, total=len(order), desc="extract[vllm-native]")
    try:
        for b in range(0, len(order), chunk):
            part = order[b:b + chunk]
            part_tokens = native_chunk(engine, ds, args.seq_len, [(i, sample_path(out_dir, i)) for i in part])
            written += len(part)
            tokens += part_tokens
            if hasattr(bar, "update"):  # tokens: the bar's tokens/s in `kimi-eagle logs`
                bar.update(len(part), tokens=part_tokens)
    finally:
        if hasattr(bar, "close"):
            bar.close()
    info["extract_seconds"] = time.time() - t_loop
    return written, tokens


def stream_native(args, ds, layer_ids, info, spool):
    """An online run's engine (engine/stream_producer.py): the spool's entries in order, `args.batch_size` at a
    time, each batch once the buffer has room for it."""
    # Room for more sequences than one batch (as extract_native's 64): a finished request's blocks are freed only
    # once the connector has copied it out, in a later engine step; with room for one batch alone the next batch
    # waited for blocks that nothing freed (seen on vLLM 0.32's CPU build: the engine idle, the batch never done).
    engine = native_engine(args, layer_ids, info, spool.path, max(64, 2 * args.batch_size))
    for b in range(0, len(spool.entries), args.batch_size):
        batch = spool.entries[b:b + args.batch_size]
        spool.wait_room(batch, lambda e: min(len(ds[e[2]][0]), args.seq_len))
        spool.produced(native_chunk(engine, ds, args.seq_len, [(e[2], spool.file(e)) for e in batch]))


def _wait_for_samples(paths):
    """The connector writes in worker threads after the request finished: wait until every sample of the chunk is
    on disk (it appears by rename, complete), or online the trainer has already taken it (its tombstone), or its
    error marker says why not."""
    deadline = time.time() + WRITE_WAIT_S
    pending = list(paths)
    while pending:
        still = []
        for path in pending:
            if os.path.exists(path) or os.path.exists(taken_path(path)):
                continue
            if os.path.exists(error_path(path)):
                with open(error_path(path)) as f:
                    raise RuntimeError(f"the vLLM connector could not write {path}: {f.read().strip()}")
            still.append(path)
        pending = still
        if pending:
            if time.time() > deadline:
                raise RuntimeError(f"{len(pending)} sample(s) never appeared within {WRITE_WAIT_S:.0f}s after vLLM "
                                   f"finished them (first: {pending[0]}); see the vLLM worker log")
            time.sleep(0.005)
