"""Two terminals at once on one host: payload wrappers carry no per-call flags, deploy-patch serialises.

A wrapper with this call's flags baked in at a fixed path once let a concurrent `deploy-patch` apply run the
other's `--revert` (it printed `patched (2 reverted)` and left the host unpatched).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from conftest import REPO
from fixtures_speculators import TARGETS, tree_hashes
from test_deploy_patch import _env_for


def _cli(env, *args):
    e = {**os.environ, "HOME": str(env.home), "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    p = subprocess.run([sys.executable, "-m", "kimi_eagle", "--inventory", str(env.inventory), *args],
                       env=e, capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def _targets(site):
    return {k: v for k, v in tree_hashes(site).items() if k in TARGETS}


def test_concurrent_apply_and_revert_each_do_what_they_were_asked(tmp_path, sshd, install):
    site = install("0.3.0")
    env = _env_for(tmp_path, sshd, site)
    pristine = _targets(site)
    assert _cli(env, "deploy-patch", "--host", "gpu")[0] == 0
    patched = _targets(site)
    assert patched != pristine
    for rnd in range(4):
        asks = [["--json", "deploy-patch", "--host", "gpu"], ["--json", "deploy-patch", "--host", "gpu", "--revert"],
                ["--json", "deploy-patch", "--host", "gpu", "--check"]]
        with ThreadPoolExecutor(3) as pool:
            results = list(pool.map(lambda a: _cli(env, *a), asks))
        for ask, (rc, out, err) in zip(asks, results):
            assert rc == 0, (rnd, ask, out, err)
            (doc,) = json.loads(out)
            mode = "revert" if "--revert" in ask else "check" if "--check" in ask else "apply"
            assert doc["mode"] == mode, (rnd, ask, doc)
            allowed = {"apply": {"changed", "ok"}, "revert": {"reverted", "ok"}, "check": {"would-change", "ok"}}[mode]
            assert {f["status"] for f in doc["files"]} <= allowed, (rnd, ask, doc["files"])
        # Serialised: the install is wholly patched or wholly pristine, never a mix.
        assert _targets(site) in (patched, pristine), rnd


def test_payload_wrappers_carry_no_flags_and_are_named_by_content(env):
    from kimi_eagle.config import inventory
    from kimi_eagle.hosts.session import BIN, HostSession

    h = inventory.load(env.inventory).hosts["gpu"]
    with HostSession(h) as s:
        s.run_payload("probe", "ops.probe", [])
        s.run_payload("probe", "ops.probe", [])
    wrappers = sorted((env.workdir / BIN).iterdir())
    assert len(wrappers) == 1 and wrappers[0].name.startswith("probe-") and wrappers[0].suffix == ".sh"
    text = wrappers[0].read_text()
    assert '"$@"' in text
    import hashlib

    assert hashlib.sha256(text.encode()).hexdigest()[:12] in wrappers[0].name
