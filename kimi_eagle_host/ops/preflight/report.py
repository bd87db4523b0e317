"""What every preflight check returns, and the settings several concerns share."""

from __future__ import annotations

import os

from kimi_eagle_host import settings
from kimi_eagle_host.step_runtime import log as _log

GPU_STEPS = {"regenerate", "extract", "train", "choose", "eval", "all"}
DEPLOY_FIX = "run `kimi-eagle deploy-patch --host {host}`"


def log(msg: str) -> None:
    _log(msg, "preflight")


def check(name: str, status: str, detail: str, fix: str | None = None) -> dict:
    assert status in ("pass", "warn", "fail")
    return {"name": name, "status": status, "detail": detail, "fix": None if status == "pass" else fix}


def step_value(args, step: str, key: str, given=None):
    """`key` as `step` will read it: its section in --step-settings (the controller sends each step's settings as
    the step gets them), else `given` (a preflight flag), else the step's default (settings.py)."""
    value = (args.step_settings_parsed.get(step) or {}).get(key)
    if value is not None:
        return value
    return given if given is not None else settings.BY_STEP[step][key].default_for(step)


def prepared_dir(args) -> str:
    """Where this step reads the prepared data: extract's `prepared_dir` when set, else <output-dir>/prepared."""
    chosen = step_value(args, "extract", "prepared_dir") if args.step == "extract" else None
    return chosen or os.path.join(args.output_dir, "prepared")
