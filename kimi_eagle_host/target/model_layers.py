"""Shared helpers for finding a target model's decoder stack and choosing layer ids.

Imported by the extract step, preflight and the trainer. No heavy imports at module level:
only objects passed in are inspected, so importing this file costs nothing.

Layer-id convention (vLLM serving, see docs/CONTRACTS.md):
    id i (0 <= i < N) = the INPUT of decoder layer i (residual stream before it; id 0 = embeddings)
    id N              = the OUTPUT of the last decoder layer, BEFORE the final norm
"""

LAYER_CONVENTION = "vllm: id i = input of decoder layer i; id N = output of last layer before final norm"


class LayerResolutionError(RuntimeError):
    pass


class LayerIdError(ValueError):
    pass


def _has_layers(module):
    layers = getattr(module, "layers", None)
    # A ModuleList (or any sized sequence of modules) counts; a stray int/None does not.
    return layers is not None and hasattr(layers, "__len__") and hasattr(layers, "__getitem__") and len(layers) > 0


def _is_eagle3_flagged(model):
    # vLLM marks models with the SupportsEagle3 interface (class attr supports_eagle3 = True).
    if getattr(type(model), "supports_eagle3", False) is True:
        return True
    return any(cls.__name__ == "SupportsEagle3" for cls in type(model).__mro__)


def _module_name(model, module):
    """Dotted attribute path of `module` inside `model` ('' for the model itself)."""
    for name, m in model.named_modules() if hasattr(model, "named_modules") else []:
        if m is module:
            return name
    return None


def _language_model_candidates(model, prefix):
    """(description, owner) pairs for get_language_model() / language_model on `model`, plus errors seen."""
    out, errors = [], []
    get_lm = getattr(model, "get_language_model", None)
    if callable(get_lm):
        try:
            lm = get_lm()
        except Exception as e:  # some wrappers raise when the LM is absent; try the other paths
            lm = None
            errors.append(f"{prefix}get_language_model() (raised {type(e).__name__})")
        if lm is not None:
            out.append((f"{prefix}get_language_model().model", getattr(lm, "model", None)))
            out.append((f"{prefix}get_language_model()", lm))
    lm = getattr(model, "language_model", None)
    if lm is not None:
        out.append((f"{prefix}language_model.model", getattr(lm, "model", None)))
        out.append((f"{prefix}language_model", lm))
    return out, errors


def resolve_decoder_stack(model):
    """Find the decoder layers of a (possibly multimodal-wrapped) causal LM.

    Returns (owner_module, layers, path_str) where owner_module.layers is layers and path_str is the
    dotted path of the layers inside `model` (e.g. 'language_model.model.layers').
    Order matches our speculators patch so extraction and serving agree on which stack is used:
    SupportsEagle3 → model.model; get_language_model() / language_model (its .model, or itself);
    model.model; model itself; finally the HF-v5 nesting model.model.language_model.
    """
    candidates = []  # (description, owner) in priority order
    tried = []
    if _is_eagle3_flagged(model):
        candidates.append(("model.model [SupportsEagle3]", getattr(model, "model", None)))
    lm_cands, errors = _language_model_candidates(model, "")
    candidates += lm_cands
    tried += errors
    candidates.append(("model", getattr(model, "model", None)))
    candidates.append(("<model itself>", model))
    # transformers v5 puts the wrapper's language model one level down (LlavaForConditionalGeneration
    # .model = LlavaModel, whose .language_model = LlamaModel), so look through model.model as well.
    inner = getattr(model, "model", None)
    if inner is not None and inner is not model:
        lm_cands, errors = _language_model_candidates(inner, "model.")
        candidates += lm_cands
        tried += errors

    for desc, owner in candidates:
        tried.append(desc + ".layers")
        if owner is not None and _has_layers(owner):
            name = _module_name(model, owner)
            path = desc + ".layers" if name is None else (name + "." if name else "") + "layers"
            return owner, owner.layers, path

    raise LayerResolutionError(
        f"cannot find the decoder layers of {type(model).__name__}; tried: {', '.join(tried)}"
    )


def text_config(config):
    """The text (LLM) part of a config: config.text_config, config.get_text_config(), or config."""
    tc = getattr(config, "text_config", None)
    if tc is not None:
        return tc
    get_tc = getattr(config, "get_text_config", None)
    if callable(get_tc):
        try:
            tc = get_tc()
        except Exception:
            tc = None
        if tc is not None:
            return tc
    return config


def engine_default_aux_ids(num_layers):
    """vLLM's aux layers for a draft whose config names none: (2, N//2, N-3), as vLLM computes them (unchecked)."""
    n = int(num_layers)
    return [2, n // 2, n - 3]


def default_layer_ids(num_layers):
    """[2, N//2, N-3, N]: three aux features for the draft + the verifier's last hidden state."""
    n = int(num_layers)
    if n < 4:
        raise LayerIdError(f"default layer ids need at least 4 decoder layers, model has {n}; pass --layer-ids")
    ids = [*engine_default_aux_ids(n), n]
    if len(set(ids)) != len(ids):
        raise LayerIdError(f"default layer ids {ids} collide for a {n}-layer model; pass --layer-ids")
    return ids


def layer_id_list(text):
    """The ids a --layer-ids value names, as given ('2,14,25,28' or [2, 14, 25, 28] -> [2, 14, 25, 28]); None when there is no value
    (the default applies). Anything but a comma list of integers is a LayerIdError. Checking them against a model
    is parse_layer_ids' part (preflight reads the list before it knows the model's depth)."""
    if text is None or str(text).strip() == "":
        return None
    ids = []
    # A list when the settings schema checked the flag (settings.build_parser), text from elsewhere.
    for raw in map(str, text) if isinstance(text, (list, tuple)) else str(text).split(","):
        tok = raw.strip()
        try:
            ids.append(int(tok))
        except ValueError:
            raise LayerIdError(f"--layer-ids: {tok!r} is not an integer (expected a comma list like 2,14,25,28)") from None
    return ids


def parse_layer_ids(text, num_layers):
    """Parse '2,14,25,28' (or None/'' → defaults). Valid ids are 0..N inclusive and unique.

    Returned in increasing order, whatever order they were given in: vLLM concatenates the aux hidden states in
    layer order (its decoder loop appends them as it passes each layer), so a draft trained on another order
    would get its inputs shuffled when served. Sorting puts id N (the last layer's output) last, as train expects.
    """
    n = int(num_layers)
    given = layer_id_list(text)
    if given is None:
        return default_layer_ids(n)
    ids = []
    for v in given:
        if not 0 <= v <= n:
            raise LayerIdError(f"--layer-ids: layer id {v} is out of range 0..{n} (model has {n} decoder layers; "
                               f"id {n} = last layer output before the final norm)")
        if v in ids:
            raise LayerIdError(f"--layer-ids: layer id {v} is given twice")
        ids.append(v)
    return sorted(ids)
