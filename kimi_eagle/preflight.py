"""Preflight: every known failure caught in seconds, before a 27-minute model load.

The checks run on the host in one host module (kimi_eagle_host/ops/preflight.py); this module maps
the inventory's pipeline settings to its flags and turns its verdict into a result or an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from .errors import KimiEagleError
from .host import RUNS, HostSession, expand
from .pipeline import chain


@dataclass
class PreflightResult:
    host: str
    checks: list[dict] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not any(c["status"] == "fail" for c in self.checks)

    @property
    def failures(self) -> list[dict]:
        return [c for c in self.checks if c["status"] == "fail"]


class PreflightFailed(KimiEagleError):
    pass


def preflight_args(session: HostSession, step: str, extra: list[str] | None = None) -> list[str]:
    p = session.host.pipeline
    args = ["--step", step, "--backend", p.backend, "--tp-size", str(p.tp_size), "--seq-len", str(p.seq_len),
            "--output-dir", str(expand(p.output_dir)), "--runs-dir", RUNS]
    # A tiny demo model (or one from a package) is built by the job itself, so it cannot be checked before.
    if p.model and not p.tiny_model and not p.model_source:
        args += ["--model", str(expand(p.model))]
    # With regenerate, `dataset` holds the prompts and prepare reads what regenerate writes.
    if p.dataset and (step in ("regenerate", "all") or (step == "prepare" and not p.regenerate)):
        args += ["--dataset", str(expand(p.dataset))]
    if p.layer_ids:
        args += ["--layer-ids", ",".join(map(str, p.layer_ids))]
    # The steps this job runs and their recipe settings: the host sizes the vLLM engine of each one that starts
    # one (regenerate, eval) as that step will.
    steps = chain(p) if step == "all" else [step]
    args += ["--step-settings", json.dumps({n: p.steps.get(n) or {} for n in steps}, sort_keys=True)]
    return args + list(extra or [])


def run(session: HostSession, step: str, extra: list[str] | None = None) -> PreflightResult:
    res = session.run_payload("preflight", "ops.preflight", preflight_args(session, step, extra))
    checks = []
    for c in res.data.get("checks", []):
        c = dict(c)
        if c.get("fix"):
            c["fix"] = c["fix"].replace("{host}", session.name)
        checks.append(c)
    return PreflightResult(session.name, checks)


def gate(session: HostSession, step: str, printer) -> PreflightResult:
    """Run before a job: print warnings and failures; raise when anything fails."""
    result = run(session, step)
    for c in result.checks:
        if c["status"] != "pass":
            fix = f" — fix: {c['fix']}" if c.get("fix") else ""
            printer(f"preflight {c['status']}: {c['name']}: {c['detail']}{fix}", "red" if c["status"] == "fail" else "yellow")
    if not result.ok:
        names = ", ".join(c["name"] for c in result.failures)
        raise PreflightFailed(
            f"{session.name}: preflight failed ({names}); nothing was started. Fix the above, or skip with --no-preflight",
            result=result,
        )
    return result
