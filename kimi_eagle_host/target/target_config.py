"""A target's text config as a dict, read once the same way by every step that needs its sizes.

config.json is read as is where it states every field the caller reads: importing transformers costs a step process
~3 CPU-seconds beyond torch (docs/benchmarks.md), and where the file states a field AutoConfig hands back the same
value. Where one is missing, transformers' AutoConfig (trust_remote_code: Kimi-K2.5's own config class) reads it and
fills the model class's defaults. Multimodal wrappers (KimiK25ForConditionalGeneration) nest the language model
under text_config: that part is what is returned.
"""
from __future__ import annotations

from typing import Callable

from kimi_eagle_host.model_size import read_config, text_config_of
from kimi_eagle_host.step_runtime import BadInput
from kimi_eagle_host.target.model_layers import text_config


class ConfigUnreadable(BadInput):
    """AutoConfig could not read a config.json that leaves out a field the caller reads."""


def states(*fields: str) -> Callable[[dict], bool]:
    """A `needs` for read_target_config: every one of `fields` is in the file with a value."""
    return lambda text: all(text.get(f) is not None for f in fields)


def read_raw(model_dir: str) -> tuple[dict, list[str]] | None:
    """(text config, architectures) of <model_dir>/config.json as written; None where there is no readable one."""
    cfg = read_config(model_dir)
    return (text_config_of(cfg), list(cfg.get("architectures") or [])) if cfg is not None else None


def read_target_config(model_dir: str, needs: Callable[[dict], bool]) -> tuple[dict, list[str]]:
    """(text config, architectures) of the target in model_dir: config.json's own where `needs(text)` says it states
    every field the caller reads, else AutoConfig's (to_dict of its text part). Raises ConfigUnreadable (exit 2,
    naming the folder) where neither does."""
    raw = read_raw(model_dir)
    if raw is not None and needs(raw[0]):
        return dict(raw[0]), raw[1]
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True)
    except Exception as e:  # noqa: BLE001 - a missing file, unknown model_type, custom code absent on this host
        raise ConfigUnreadable(f"{model_dir}: cannot load the model config ({type(e).__name__}: {e})") from None
    text = text_config(cfg)
    as_dict = text.to_dict()
    # Names a config class maps onto its own (GPT-2's n_layer is num_hidden_layers): to_dict writes only the latter.
    for alias in getattr(text, "attribute_map", None) or {}:
        as_dict.setdefault(alias, getattr(text, alias, None))
    return as_dict, list(getattr(cfg, "architectures", None) or [type(cfg).__name__])


def model_info(model_path: str) -> dict:
    """{num_layers, hidden_size, model_class} of a target, for extraction."""
    text, archs = read_target_config(model_path, states("num_hidden_layers", "hidden_size"))
    n, h = text.get("num_hidden_layers"), text.get("hidden_size")
    if not n or not h:
        raise BadInput(f"{model_path}: config has no num_hidden_layers/hidden_size (looked in text_config too)")
    return {"num_layers": int(n), "hidden_size": int(h), "model_class": (archs or ["?"])[0]}
