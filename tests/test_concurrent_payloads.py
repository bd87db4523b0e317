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


def test_a_checkout_edited_while_a_call_deploys_still_runs_the_call(env, monkeypatch):
    # A developer saves a host-package file while a command runs: the set read for the first attempt (its digest)
    # differs from the set deployed after that attempt found the host behind. The call runs against what was
    # deployed; before, it failed with a bare "exit 222" (seen in the suite when the checkout was edited mid-run).
    from kimi_eagle.config import inventory
    from kimi_eagle.hosts import session, sync

    reads = []

    def items_then_an_edit():
        items = list(session.sync.tree_items(session.payloads_dir(), session.payload_files()))
        reads.append(len(reads))
        if len(reads) > 1:   # every read after the first sees the file as saved since
            items.append(sync.Item(remote="kimi_eagle_host/edited_meanwhile.py", data=b"# saved during the call\n"))
        return items

    monkeypatch.setattr(session, "_payload_items", items_then_an_edit)
    h = inventory.load(env.inventory).hosts["gpu"]
    with session.HostSession(h) as s:
        res = s.call("ops.probe", [])
    assert res.exited == 0, (res.exited, res.stderr)
    assert len(reads) >= 2 and (env.workdir / session.PAYLOADS / "kimi_eagle_host" / "edited_meanwhile.py").exists()
