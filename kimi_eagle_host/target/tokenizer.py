"""The target's tokenizer, as the data steps load it: prepare and regenerate render its chat template."""
from __future__ import annotations

import json
import os

from kimi_eagle_host.step_runtime import BadInput

# transformers' generic tokenizer.json backend, under its v5 and v4 names. AutoTokenizer builds exactly this class
# for a tokenizer whose config names it, but importing AutoTokenizer pulls in transformers' model configuration and
# generation code and with them torch: ~6 of a small prepare's ~8 CPU-seconds, for nothing prepare uses.
GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def generic_tokenizer_class(model: str):
    """The class AutoTokenizer would build for the local folder `model` when its tokenizer_config.json names
    transformers' generic tokenizer.json backend (no remote code); None otherwise (AutoTokenizer decides)."""
    try:
        with open(os.path.join(model, "tokenizer_config.json")) as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return None
    name = cfg.get("tokenizer_class") if isinstance(cfg, dict) else None
    if name not in GENERIC_TOKENIZER_CLASSES or cfg.get("auto_map") \
            or not os.path.isfile(os.path.join(model, "tokenizer.json")):
        return None
    import transformers

    return getattr(transformers, name, None)


def load_tokenizer(model: str):
    """The target's tokenizer, refused (BadInput) without a chat template."""
    try:
        cls = generic_tokenizer_class(model)
        if cls is None:
            from transformers import AutoTokenizer as cls
        tok = cls.from_pretrained(model, trust_remote_code=True)
    except Exception as e:
        raise BadInput(f"{model}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    if not getattr(tok, "chat_template", None):
        raise BadInput(f"{model}: the tokenizer has no chat_template")
    return tok


def chat_template_sha256(tok) -> str:
    """The template that renders every turn, as a digest: edited (a fixed template, chat_template.jinja replaced),
    the same weights answer other prompts. The weights' fingerprint does not see it."""
    import hashlib
    import json

    template = tok.chat_template
    text = template if isinstance(template, str) else json.dumps(template, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
