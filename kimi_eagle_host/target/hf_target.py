"""The target model under transformers: loading it (trust_remote_code, multimodal wrappers, one or several GPUs)
and capturing its hidden states at the layer ids (extract's hf engine, and eval's transformers engine)."""

from kimi_eagle_host import compute_dtype, cpu_threads
from kimi_eagle_host.step_runtime import log
from kimi_eagle_host.target.model_layers import text_config


class _StopForward(Exception):
    """Raised from a hook once every requested layer is captured: skips the rest of the model (and lm_head)."""


class HiddenStateCapture:
    """Forward hooks implementing the layer-id convention on a decoder stack of N layers.

    id i < N: forward pre-hook on layers[i] (its input = residual stream before it).
    id N:     forward hook on layers[N-1], first element of its output (before the final norm).
    """

    def __init__(self, layers, layer_ids, early_stop=True):
        self.layer_ids = list(layer_ids)
        self.n = len(layers)
        self.captured = {}
        self.handles = []
        last = max(self.layer_ids)  # ids are captured in increasing order during the forward
        self.stop_after = last if early_stop else None
        for lid in self.layer_ids:
            if lid < self.n:
                self.handles.append(layers[lid].register_forward_pre_hook(self._pre_hook(lid), with_kwargs=True))
            else:
                self.handles.append(layers[self.n - 1].register_forward_hook(self._post_hook(lid)))

    def _store(self, lid, tensor):
        # clone: the next layer must not be able to modify our copy in place
        self.captured[lid] = tensor.detach().clone()
        if self.stop_after == lid:
            raise _StopForward()

    def _pre_hook(self, lid):
        def hook(module, args, kwargs):
            self._store(lid, args[0] if args else kwargs["hidden_states"])
        return hook

    def _post_hook(self, lid):
        def hook(module, args, output):
            self._store(lid, output[0] if isinstance(output, (tuple, list)) else output)
        return hook

    def run(self, model, **inputs):
        """Forward pass; returns [B, T, L, H] stacked in layer-id order."""
        import torch

        self.captured = {}
        try:
            model(**inputs)
        except _StopForward:
            pass
        missing = [lid for lid in self.layer_ids if lid not in self.captured]
        if missing:
            raise RuntimeError(f"hooks did not capture layer ids {missing}; the model did not run those layers")
        dev = self.captured[self.layer_ids[0]].device
        return torch.stack([self.captured[lid].to(dev) for lid in self.layer_ids], dim=2)

    def remove(self):
        for h in self.handles:
            h.remove()


def _auto_class(model_path):
    """Pick the Auto class from the config instead of trial and error (a failed Auto lookup is slow)."""
    import transformers
    from transformers.models.auto import modeling_auto

    cfg = transformers.AutoConfig.from_pretrained(model_path, trust_remote_code=True)
    auto_map = getattr(cfg, "auto_map", None) or {}
    if "AutoModelForCausalLM" in auto_map or cfg.model_type in modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return transformers.AutoModelForCausalLM
    if cfg.model_type in getattr(modeling_auto, "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES", {}):
        return transformers.AutoModelForImageTextToText
    return transformers.AutoModel


def load_model(model_path, torch_dtype, device, tp_size, gpus=None):
    """Load the target with trust_remote_code; multimodal wrappers go through AutoModelForImageTextToText.

    gpus: the CUDA devices of this copy (None: all visible). One GPU takes the whole model; several share
    it layer by layer (accelerate's device_map, limited to these GPUs by max_memory)."""
    cls = _auto_class(model_path)
    kwargs = {"trust_remote_code": True, "dtype": torch_dtype}
    if device == "cuda" and gpus is not None:
        import torch

        # This worker's own GPU is the current device, so nothing it allocates without naming a device
        # (pinned host buffers, streams) opens a context on another worker's GPU.
        torch.cuda.set_device(gpus[0])
        if len(gpus) == 1:
            return cls.from_pretrained(model_path, **kwargs).to(f"cuda:{gpus[0]}").eval()
        max_memory = {g: torch.cuda.get_device_properties(g).total_memory for g in gpus}
        return cls.from_pretrained(model_path, device_map="auto", max_memory=max_memory, **kwargs).eval()
    if device == "cuda":
        try:  # spreads a huge target over all visible GPUs (layer-wise; tp_size is a vllm-engine notion)
            return cls.from_pretrained(model_path, device_map="auto", **kwargs).eval()
        except ImportError as e:  # device_map needs accelerate; a single GPU works without it
            log(f"[extract] device_map='auto' unavailable ({e}); loading onto one GPU")
            return cls.from_pretrained(model_path, **kwargs).to("cuda").eval()
    model = cls.from_pretrained(model_path, **kwargs).to("cpu").eval()
    cpu_threads.fit(getattr(text_config(model.config), "hidden_size", None), "cpu", log)
    return model


def resolve_device_dtype(device, dtype, engine="hf"):
    """(device, dtype) of an extraction: auto resolved as extract and an online engine both do."""
    import torch

    from kimi_eagle_host.step_runtime import BadInput

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise BadInput("--device cuda: no CUDA device is visible")
    if dtype == "auto" and engine == "vllm":
        # vLLM computes a float32 checkpoint in bfloat16 on every platform; say so instead of upcasting its output
        return device, "bfloat16"
    return device, compute_dtype.resolve(dtype, device, log)


def capture_batch(capture, model, seqs, input_device, torch_dtype):
    """[B, T_max, L, H] hidden states of the token sequences `seqs` (numpy int arrays) in one forward, right-padded.
    Call under torch.inference_mode()."""
    import torch

    cuda = input_device.type == "cuda"
    t_max = max(len(s) for s in seqs)
    # Right padding: with a causal mask, real tokens never see the pads, and positions stay 0..T-1.
    ids = torch.zeros(len(seqs), t_max, dtype=torch.long)
    attn = torch.zeros(len(seqs), t_max, dtype=torch.long)
    for j, s in enumerate(seqs):
        ids[j, :len(s)] = torch.from_numpy(s)
        attn[j, :len(s)] = 1
    return capture.run(model, input_ids=ids.to(input_device, non_blocking=cuda),
                       attention_mask=attn.to(input_device, non_blocking=cuda), use_cache=False).to(torch_dtype)
