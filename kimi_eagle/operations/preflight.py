"""Preflight: every known failure caught in seconds, before a 27-minute model load.

The checks run on the host in one host module (kimi_eagle_host/ops/preflight.py); this module maps
the inventory's pipeline settings to its flags and turns its verdict into a result or an error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kimi_eagle_host import settings

from ..config.step_plan import chain, extra_settings, step_section
from ..errors import KimiEagleError
from ..hosts.session import RUNS, HostSession, expand


@dataclass
class PreflightResult:
    host: str
    checks: list[dict] = field(default_factory=list)
    online_instead: dict | None = None   # gate(may_go_online): the storage check that offline would not pass

    @property
    def ok(self) -> bool:
        return not any(c["status"] == "fail" for c in self.checks)

    @property
    def failures(self) -> list[dict]:
        return [c for c in self.checks if c["status"] == "fail"]


class PreflightFailed(KimiEagleError):
    pass


def preflight_args(session: HostSession, step: str, extra: list[str] | None = None,
                   step_flags: list[str] | None = None) -> list[str]:
    """ops/preflight.py's flags: the settings the schema marks as read by preflight, from the job's resolved
    settings, and the steps this job runs with their sections as each step gets them (`step_flags`: the flags typed
    after -- for the job's first step, as its settings.json holds them)."""
    p = session.host.pipeline
    section = settings.step_section("preflight", p.model_dump())
    # With regenerate, `dataset` holds the prompts and prepare reads what regenerate writes.
    if not (step in ("regenerate", "all") or (step == "prepare" and not p.regenerate)):
        section.pop("dataset", None)
    if not p.model:
        section.pop("model", None)
    section = {k: str(expand(v)) if isinstance(v, str) else v for k, v in section.items()}
    args = ["--step", step, *settings.section_to_argv("preflight", section), "--runs-dir", RUNS]
    if session.host.gpus:   # the job's steps use this many of the host's GPUs (launch.py --gpus): the plan's hours
        args += ["--gpus", str(session.host.gpus)]
    # A model the job builds (the tiny demo, one from a package): the host checks it can be built.
    if p.tiny_model or p.model_source:
        args += ["--model-source", "tiny" if p.tiny_model else p.model_source]
    # The steps this job runs and their settings: the host sizes the vLLM engine of each one that starts one
    # (regenerate, eval) and plans the hidden states' storage (where extract writes, how much data, how many epochs,
    # the online buffer) from what the steps will really run with.
    steps = chain(p) if step == "all" else [step]
    given = extra_settings(steps[0], list(step_flags or []))
    sections = {n: step_section(n, p, given if n == steps[0] else None, required=False) for n in steps}
    args += ["--step-settings", json.dumps(sections, sort_keys=True)]
    return args + list(extra or [])


def run(session: HostSession, step: str, extra: list[str] | None = None,
        step_flags: list[str] | None = None) -> PreflightResult:
    res = session.run_payload("preflight", "ops.preflight", preflight_args(session, step, extra, step_flags))
    checks = []
    for c in res.data.get("checks", []):
        c = dict(c)
        if c.get("fix"):
            c["fix"] = c["fix"].replace("{host}", session.name)
        checks.append(c)
    return PreflightResult(session.name, checks)


def offline_does_not_fit(result: PreflightResult) -> dict | None:
    """The storage check when it is preflight's only failure and says the hidden states would not fit as files,
    while online's buffer would fit its folder."""
    fails = result.failures
    plan = (fails[0].get("plan") or {}) if len(fails) == 1 and fails[0]["name"] == "storage" else {}
    if plan.get("offline_fits") is False and plan.get("spool_fits") is not False:
        return fails[0]
    return None


def gate(session: HostSession, step: str, printer, may_go_online: bool = False,
         step_flags: list[str] | None = None) -> PreflightResult:
    """Run before a job: print warnings and failures; raise when anything fails. may_go_online: a storage check
    that fails only because offline would not fit is not a failure but `result.online_instead` (the caller runs
    the job online). `step_flags`: the flags typed after -- for the job's step."""
    result = run(session, step, step_flags=step_flags)
    result.online_instead = offline_does_not_fit(result) if may_go_online else None
    if result.online_instead:
        return result
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
