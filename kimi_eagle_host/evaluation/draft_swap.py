"""Another checkpoint of the same draft into a running vLLM engine, in place.

choose serves every candidate checkpoint of a run next to the target. An engine per candidate loads the target again
each time: for Kimi-K2.5 a half-hour load per candidate, for SmolLM2 on an H200 about a minute of CUDA-graph capture.
The candidates of one run share their shape, so the engine started for the first serves the others: vLLM mixes
DraftSwap into its workers (`worker_extension_cls`), collective_rpc calls its method in each worker by name (no
code is pickled), and vLLM's layer-wise reload (0.16, 0.25.1 and 0.32 have it) takes checkpoint-format tensors into weights the
engine has already processed (repacked on a CPU), copying the result into the same storage, so captured CUDA graphs
and compiled code keep reading the new values.

The caller resets the prefix cache after a swap: its blocks hold the old draft's keys and values next to the
target's.
"""
from __future__ import annotations

import json
import os

EXTENSION = "kimi_eagle_host.evaluation.draft_swap.DraftSwap"
METHOD = "kimi_eagle_swap_draft"


def unsupported(engine_args_cls) -> str | None:
    """None when this vLLM can swap a draft in place, else why not (then each candidate gets its own engine)."""
    if "worker_extension_cls" not in getattr(engine_args_cls, "__dataclass_fields__", {}):
        return "this vLLM has no worker extensions"
    try:
        from vllm.model_executor.model_loader.reload import (finalize_layerwise_processing,  # noqa: F401
                                                             initialize_layerwise_reload)
    except ImportError:
        return "this vLLM has no layer-wise weight reload"
    return None


def safetensors_files(path: str) -> list[str]:
    return [os.path.join(path, n) for n in sorted(os.listdir(path)) if n.endswith(".safetensors")]


def same_shape(a: str, b: str) -> bool:
    """Whether two exported drafts have the same config.json and the same tensors by name and shape. A tensor the
    second lacks would keep the first's values after a swap (vLLM's reload puts back what it was not given)."""
    def shape(path):
        from safetensors import safe_open

        with open(os.path.join(path, "config.json")) as f:
            config = json.load(f)
        tensors = {}
        for file in safetensors_files(path):
            with safe_open(file, framework="pt") as f:
                tensors.update({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()})
        return config, tensors
    return shape(a) == shape(b)


def export_tensors(path: str) -> dict:
    from safetensors.torch import load_file

    tensors = {}
    for file in safetensors_files(path):
        tensors.update(load_file(file))
    if not tensors:
        raise FileNotFoundError(f"{path}: no .safetensors files")
    return tensors


def draft_model(runner):
    """The draft's module inside a vLLM model runner. vLLM's first GPU runner (and the CPU runner built on it) keeps
    it as `drafter.model`; the second (vllm/v1/worker/gpu/model_runner.py, what 0.25.1 runs a Llama target with on
    CUDA) as `speculator.model`. The twenty-ninth session's choose met the second on an H100: 'GPUModelRunner'
    object has no attribute 'drafter'."""
    for name in ("drafter", "speculator"):
        model = getattr(getattr(runner, name, None), "model", None)
        if model is not None:
            return model
    raise RuntimeError(f"{type(runner).__module__}.{type(runner).__name__} serves no draft model this swap knows "
                       f"(neither drafter.model nor speculator.model)")


class DraftSwap:
    """Mixed into vLLM's worker class: `self` is the worker."""

    def kimi_eagle_swap_draft(self, path: str) -> list[str]:
        """Load the exported draft at `path` into this worker's drafter; returns the names of the tensors read."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_processing, initialize_layerwise_reload

        runner = self.model_runner
        model = draft_model(runner)
        tensors = export_tensors(path)
        initialize_layerwise_reload(model)
        model.load_weights(iter(tensors.items()))
        finalize_layerwise_processing(model, runner.vllm_config.speculative_config.draft_model_config)
        return sorted(tensors)
