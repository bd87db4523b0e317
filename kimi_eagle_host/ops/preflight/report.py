"""What every preflight check returns, and the settings several concerns share."""

from __future__ import annotations

from kimi_eagle_host.step_runtime import log as _log

GPU_STEPS = {"regenerate", "extract", "train", "choose", "eval", "all"}
DEPLOY_FIX = "run `kimi-eagle deploy-patch --host {host}`"


def log(msg: str) -> None:
    _log(msg, "preflight")


def check(name: str, status: str, detail: str, fix: str | None = None) -> dict:
    assert status in ("pass", "warn", "fail")
    return {"name": name, "status": status, "detail": detail, "fix": None if status == "pass" else fix}
