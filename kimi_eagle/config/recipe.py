"""Recipes: what a run trains (model, data, layers, vocabulary, schedule) in one file you can share, apart from
the inventory that says where it runs.

`--recipe FILE.yaml` (or `-c`) plus `KEY=VALUE` overrides (dotted where nested: `steps.train.warmup_steps=100`)
on `run`, `render` and `preflight`. A recipe holds the inventory's pipeline settings, flat, plus `steps:` (any
other flag of a step) and `description`. Order, last wins: the inventory's `pipeline:`, the host's `pipeline:`,
the recipe, the overrides. Every mistake is one line naming the file (or the override) and the key, exit 2.
"""

from __future__ import annotations


import sys

import yaml

from kimi_eagle_host import settings

from ..errors import ConfigError
from pydantic import ValidationError, model_validator

from .yaml_files import CANNOT_READ
from .inventory import PipelineOverride, _checked_section, check_settings, line_of, read_config_text, read_yaml, refuse_duplicate_keys

COMMAND_LINE = "<command line>"


class Recipe(PipelineOverride):
    """The pipeline settings of one experiment (every key optional; unknown keys refused)."""

    description: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _check(cls, value):
        return _checked_section(value, recipe=True)


def load(path: str | None, overrides: list[str] | None = None) -> Recipe | None:
    """The recipe at `path` with `overrides` applied, each checked by the settings schema; None when neither."""
    overrides = list(overrides or [])
    if not path and not overrides:
        return None
    raw: dict = {}
    if path:
        text_raw, node = _parse(read_config_text(path, "recipe"), str(path))
        raw = check_settings(text_raw, str(path), node, (), recipe=True)
    for o in overrides:
        keys, value = _override(o)
        one: dict = {}
        _set(one, keys, value, o)
        raw = _merge(raw, _checked_override(one, o, path))
    return _validated(raw, path, overrides)


def _validated(raw: dict, path: str | None, overrides: list[str]) -> Recipe:
    # The file and each override were checked alone; what is left to fail is how they combine: one line too.
    try:
        return Recipe.model_validate(raw)
    except ValidationError as e:
        msg = e.errors()[0]["msg"].removeprefix("Value error, ")
        given = f"recipe {path} with overrides {' '.join(overrides)}" if path and overrides else \
            f"recipe {path}" if path else f"overrides {' '.join(overrides)}"
        raise ConfigError(f"{given}: field {msg}") from None


def _checked_override(one: dict, text: str, path: str | None) -> dict:
    where = f" (recipe {path})" if path else ""
    try:
        for old in settings.renamed(one):
            print(f"override {text}: {old} is renamed to {settings.RENAMED[old]}; read as "
                  f"{settings.RENAMED[old]}", file=sys.stderr)
        return settings.check_section(one, recipe=True)
    except settings.SettingError as e:
        raise ConfigError(f"override {text}: field {'.'.join(e.path)}: {e.message}{where}") from None


def _merge(base: dict, over: dict) -> dict:
    """`over` on `base`, the per-step settings key by key (steps.train.lr=… keeps the recipe's other train keys)."""
    base = dict(base)
    # One way to build `model`: an override that picks one replaces the other, as a level does over the
    # inventory's (Inventory._resolve).
    for mine, other in (("tiny_model", "model_source"), ("model_source", "tiny_model")):
        if over.get(mine):
            base.pop(other, None)
    merged = {**base, **{k: v for k, v in over.items() if k != "steps"}}
    steps = {s: dict(v) for s, v in (base.get("steps") or {}).items()}
    for step, section in (over.get("steps") or {}).items():
        steps[step] = {**steps.get(step, {}), **section}
    if steps:
        merged["steps"] = steps
    return merged


def _parse(text: str, shown: str):
    raw, node = read_yaml(text, shown)
    if raw is None:
        return {}, node
    if not isinstance(raw, dict):
        raise ConfigError(f"{shown}: a recipe is a mapping of settings (model: ..., epochs: ...)")
    if "pipeline" in raw:
        raise ConfigError(f"{shown}{line_of(node, ('pipeline',))}: a recipe holds the pipeline settings themselves: "
                          f"move what is under `pipeline:` to the top level")
    if "hosts" in raw:
        raise ConfigError(f"{shown}{line_of(node, ('hosts',))}: hosts belong in the inventory, not in a recipe")
    refuse_duplicate_keys(shown, node)
    return raw, node


def _override(text: str) -> tuple[tuple, object]:
    key, sep, value = text.partition("=")
    keys = tuple(key.strip().split("."))
    if not sep or not all(keys):
        raise ConfigError(f"override {text!r}: expected KEY=VALUE, e.g. epochs=3 or steps.train.warmup_steps=100")
    try:
        # the same bounded reader as the files: `lr=[[[[…` is one line, not a RecursionError
        parsed = read_yaml(value, f"override {key.strip()}")[0] if value.strip() else ""
    except ConfigError as e:
        if "YAML syntax error" not in str(e) and CANNOT_READ not in str(e):
            raise
        # `{workdir}/models/x` is a path, not a YAML mapping; `dataset=2024-02-30` a name, not a date
        parsed = value
    return keys, value if isinstance(parsed, dict) else parsed


def _set(raw: dict, keys: tuple, value, text: str) -> None:
    d = raw
    for k in keys[:-1]:
        nxt = d.setdefault(k, {})
        if not isinstance(nxt, dict):
            raise ConfigError(f"override {text}: {k} is not a section")
        d = nxt
    d[keys[-1]] = value


def source(path: str | None, overrides: list[str] | None) -> str | None:
    """How a recipe was given, for the record: `FILE KEY=VALUE ...`."""
    words = ([str(path)] if path else []) + list(overrides or [])
    return " ".join(words) or None


def resolved_yaml(pipeline, *, source: str | None, host: str) -> str:
    """What a run actually used, written next to its outputs: every setting, and where it came from."""
    head = [f"# the settings this run used on host {host}",
            f"# recipe: {source or '(none: the inventory pipeline section)'}"]
    body = yaml.safe_dump(resolved(pipeline), sort_keys=False, default_flow_style=None)
    return "\n".join(head) + "\n" + body


def resolved(pipeline) -> dict:
    """Every setting a run uses, as plain data (the pipeline's settings and the per-step ones)."""
    return pipeline.model_dump()
