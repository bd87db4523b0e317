"""Serving a draft in vLLM and reading what it accepted: shared by the eval and choose steps.

  vllm_support        whether the host's vLLM can serve EAGLE-3 for a target (else why not)
  vllm_counters       vLLM's own spec-decode counters (llm.get_metrics()), per-position acceptance included
  ServedEngine        one vLLM engine, the target alone (k = 0) or with the draft at k, greedy, counting each call
  acceptance_by_k     acceptance length at every k' <= k from ONE run at k (a chain draft's first k' proposals do
                      not depend on k, and vLLM counts position i only when every earlier one was accepted)
  tokens_per_s_by_k   tokens/s at every k' <= k from the target alone and the run at k (step time linear in k)
"""
from kimi_eagle_host.step_runtime import stdout_for_result_only
from kimi_eagle_host.model_size import text_config_of


def vllm_support(target_cfg):
    """(True, version) when the host's vLLM can serve EAGLE-3 for this target, else (False, why)."""
    stdout_for_result_only()  # importing vLLM already logs (to stdout)
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        return False, f"vLLM is not importable on this host ({type(e).__name__}: {e})"
    version = getattr(vllm, "__version__", "0")
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3
    except Exception as e:  # noqa: BLE001
        return False, f"vLLM {version} has no EAGLE-3 interface ({type(e).__name__}: {e})"
    archs = target_cfg.get("architectures") or []
    for arch in archs:
        try:
            cls, _ = ModelRegistry.resolve_model_cls([arch], model_config=None)
        except Exception:  # noqa: BLE001 - signature differs across versions: fall back to the plain lookup
            try:
                cls = ModelRegistry._try_load_model_cls(arch)
            except Exception:  # noqa: BLE001
                cls = None
        if cls is not None and supports_eagle3(cls):
            conflict = cpu_kv_block_conflict(target_cfg, version)
            return (False, conflict) if conflict else (True, version)
    return False, f"vLLM {version} cannot serve EAGLE-3 drafts for {archs or 'this target'}"


def cpu_kv_block_conflict(target_cfg, version):
    """Why vLLM on this CPU cannot hold an MLA target and an EAGLE-3 draft in one engine, else None. The target's
    layers and the draft's attention run on two backends that must share a KV block size; without AMX, vLLM 0.32's
    CPU_MLA takes 16-token blocks only and CPU_ATTN multiples of 32, and the engine dies at start-up ("No common
    block size", seen on an AMD EPYC with AVX-512). Asked of vLLM's own backends, so a version that lifts it passes."""
    if not text_config_of(target_cfg).get("kv_lora_rank"):   # not MLA (DeepSeek-V3 / Kimi-K2.5 text configs have it)
        return None
    try:
        import torch
        from vllm.platforms import current_platform

        if not current_platform.is_cpu() or torch.cpu._is_amx_tile_supported():
            return None
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
        from vllm.v1.attention.backends.mla.cpu_mla import CPUMLABackend

        mla, attn = CPUMLABackend.get_supported_kernel_block_sizes(), CPUAttentionBackend.get_supported_kernel_block_sizes()
    except Exception:  # noqa: BLE001 - another layout of vLLM: its engine start decides
        return None

    def fits(size, spec):
        return size == spec if isinstance(spec, int) else size % spec.base == 0

    if not all(isinstance(m, int) for m in mla) or any(fits(m, a) for m in mla for a in attn):
        return None
    return (f"vLLM {version} on this CPU (no AMX) runs the MLA target with CPU_MLA, KV blocks of {mla} tokens, and "
            f"the draft's attention with CPU_ATTN, blocks of {attn}: no block size fits both, so no engine can serve an "
            f"EAGLE-3 draft for this target here (a GPU host or a CPU with AMX can)")




def vllm_counters(llm):
    """Spec-decode counters from llm.get_metrics() (vLLM V1)."""
    got = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            got[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            got["per_pos"] = [a + b for a, b in zip(got["per_pos"] + [0] * len(vals), vals)] \
                if got["per_pos"] else vals
    return got


class ServedEngine:
    """One vLLM engine: the target alone (k = 0) or the target with `draft` at k, greedy. `memory`:
    vllm_compat.size_engine's answer (its environment is set already). counted(call) runs call(llm, sampling) and
    returns (its result, the spec-decode counters of that call: drafts, accepted, per_pos over k positions)."""

    def __init__(self, args, draft, k, memory, swappable=False):
        from vllm import LLM, EngineArgs, SamplingParams

        from kimi_eagle_host.evaluation import draft_swap
        from kimi_eagle_host.vllm_compat import text_only_engine_kwargs

        spec = {"method": "eagle3", "model": draft, "num_speculative_tokens": k} if k else None
        # swappable: another checkpoint of the same draft can be swapped in later (swap), where this vLLM can
        self.cannot_swap = "no draft" if not k else draft_swap.unsupported(EngineArgs) if swappable else "not asked"
        extension = {"worker_extension_cls": draft_swap.EXTENSION} if self.cannot_swap is None else {}
        self.llm = LLM(model=args.model, dtype=args.vllm_dtype, max_model_len=args.max_model_len, seed=0,
                       enforce_eager=args.enforce_eager, disable_log_stats=False, trust_remote_code=True,
                       tensor_parallel_size=args.tp_size, speculative_config=spec, **memory["kwargs"],
                       **text_only_engine_kwargs(args.model, EngineArgs), **extension)
        self.sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
        self.k = k
        self.draft = draft

    def swap(self, draft):
        """Serve `draft`, another checkpoint of the same shape, from now on, without a new engine (draft_swap).
        Raises when it cannot; the engine is then left half-loaded: close it."""
        from kimi_eagle_host.evaluation import draft_swap

        if self.cannot_swap:
            raise RuntimeError(f"the engine cannot swap drafts: {self.cannot_swap}")
        if not draft_swap.same_shape(self.draft, draft):
            raise RuntimeError(f"{draft}: its config or tensors are not those of {self.draft}")
        self.llm.collective_rpc(draft_swap.METHOD, args=(str(draft),))
        # the cached prefixes hold the old draft's keys and values beside the target's
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM did not reset its prefix cache")
        self.draft = draft

    def counted(self, call):
        before = vllm_counters(self.llm)
        res = call(self.llm, self.sp)
        after = vllm_counters(self.llm)
        c = {key: after[key] - before[key] for key in ("drafts", "accepted")}
        per_pos = [a - b for a, b in zip(after["per_pos"], before["per_pos"] + [0] * len(after["per_pos"]))]
        c["per_pos"] = (per_pos + [0] * self.k)[:self.k]
        return res, c

    def close(self):
        """Stops the engine now, so the next one finds its memory free (vllm_compat.shut_down)."""
        from kimi_eagle_host.vllm_compat import shut_down

        shut_down(self)


def acceptance_by_k(per_pos, drafts: int) -> list[float]:
    """[acceptance length at k' = 1..len(per_pos)]: 1 + the fraction of drafts whose positions 1..k' were all
    accepted, summed. vLLM's per_pos[i] counts drafts whose position i was accepted, which it only counts once
    every earlier position was: so the first k' entries are what a run at k' would have counted for these same
    drafts. An estimate of a real run at k', not its measure: a run at k' starts its drafts elsewhere (after
    fewer tokens accepted a step), so the contexts drafted from differ."""
    n = max(int(drafts), 1)
    out, total = [], 1.0
    for a in per_pos:
        total += a / n
        out.append(round(total, 4))
    return out


def tokens_per_s_by_k(without: float, with_k: float, by_k: list[float]) -> list[float | None]:
    """Modelled tokens/s at every k' = 1..k, from two measurements at one batch size: the target alone (k = 0,
    one token a step) and the draft at k (by_k[-1] tokens a step). A step's time is taken as linear in k' (the
    target's verification, plus one draft forward per drafted token): t(k') = t0 + k' * d, fitted through both
    measurements, so the figure at k equals the measured one; tokens/s at k' = by_k[k'-1] / t(k')."""
    if not without or not with_k or not by_k:
        return [None] * len(by_k)
    k = len(by_k)
    t0, tk = 1.0 / without, by_k[-1] / with_k    # seconds per step of one sequence
    if tk < t0:   # a step with the draft measured faster than one without is timing noise: the draft is taken as
        t0 = tk   # free and a step as long as measured with it, so the figure at k stays the measured one
    d = (tk - t0) / k
    return [round(a / (t0 + (i + 1) * d), 2) for i, a in enumerate(by_k)]
