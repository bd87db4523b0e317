"""`hosts check`: what a host has (Python, torch/CUDA, vLLM, GPUs), from kimi_eagle_host/ops/probe.py run there."""

from __future__ import annotations

from .parallel import each_host


def check(hosts) -> list:
    """Probe each host in parallel with one uploaded script. Returns HostOutcome values of probe dicts."""

    def probe(session):
        res = session.run_payload("probe", "ops.probe", [])
        return res.data

    return each_host(hosts, probe)
