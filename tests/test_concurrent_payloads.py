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


def _checkout_copy(dest, marker: str):
    """Another checkout of kimi-eagle (another user's, or a newer release) whose host package differs by one line."""
    import shutil

    for part in ("kimi_eagle", "kimi_eagle_host", "templates", "recipes"):
        shutil.copytree(REPO / part, dest / part, ignore=shutil.ignore_patterns("__pycache__"))
    init = dest / "kimi_eagle_host" / "__init__.py"
    init.write_text(init.read_text() + f"# {marker}\n")
    return dest


def test_a_running_job_keeps_the_host_code_it_started_with(env, tmp_path):
    """Two checkouts on one host: while checkout A's job runs, checkout B deploys its own host package. The job's
    later steps used to import B's code (one shared payloads folder, read at each step's start) and the job still
    ended as succeeded. Now each set has its own folder, named by its content, and the job names its own."""
    import shlex
    import time

    other = _checkout_copy(tmp_path / "checkout-b", "checkout B")
    go = tmp_path / "go"
    show = ("import sys, kimi_eagle_host as k; print('step', sys.argv[1], k.__file__, "
            "open(k.__file__).read().splitlines()[-1])")
    py = shlex.quote(sys.executable)
    script = (f"{py} -c {shlex.quote(show)} 1; while [ ! -e {shlex.quote(str(go))} ]; do sleep 0.05; done; "
              f"{py} -c {shlex.quote(show)} 2")
    rc, out, err = _cli(env, "--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", "bash", "-c", script)
    assert rc == 0, (out, err)
    job = json.loads(out)["id"]
    # Checkout B, meanwhile: its own set goes to the host, and its commands run it.
    e = {**os.environ, "HOME": str(env.home), "NO_COLOR": "1", "PYTHONPATH": str(other)}
    b = subprocess.run([sys.executable, "-m", "kimi_eagle", "--inventory", str(env.inventory), "hosts", "check", "gpu"],
                       env=e, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert b.returncode == 0, (b.stdout, b.stderr)
    go.touch()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rc, out, err = _cli(env, "--json", "status", job, "--host", "gpu")
        if json.loads(out)["jobs"][0]["state"] != "running":
            break
        time.sleep(0.2)
    rc, out, err = _cli(env, "logs", job, "--host", "gpu")
    steps = [ln.split(" ", 3)[3] for ln in out.splitlines() if ln.startswith("[gpu] step ")]
    assert len(steps) == 2 and steps[0] == steps[1], out   # the same file, the same text, in both steps
    assert "checkout B" not in out and "/.kimi-eagle/payloads/" in steps[0], out
    # Both sets lie on the host, each in its own folder; B's commands run B's.
    payloads = env.workdir / ".kimi-eagle" / "payloads"
    inits = [p / "kimi_eagle_host" / "__init__.py" for p in payloads.iterdir() if not p.name.startswith(".")]
    assert len(inits) == 2 and sum("checkout B" in p.read_text() for p in inits) == 1, inits


def test_one_command_deploys_and_names_one_set_even_if_the_checkout_changes_meanwhile(env, tmp_path, monkeypatch):
    """A developer saves a host-package file while a command runs: the command read the package once (the folder its
    calls and job scripts name is that set's), and it deploys exactly that set; the saved file waits for the next
    command. Before, a call whose first try read one digest and whose deploy read another failed with a bare exit 222."""
    from kimi_eagle.config import inventory
    from kimi_eagle.hosts import session

    checkout = _checkout_copy(tmp_path / "checkout", "as read")
    monkeypatch.setattr(session, "payloads_dir", lambda: checkout)
    monkeypatch.setattr(session, "payload_files", lambda: sorted(
        p for p in (checkout / "kimi_eagle_host").rglob("*") if p.is_file() and "__pycache__" not in p.parts))
    session.payload_set.cache_clear()
    try:
        before = session.payload_set()
        (checkout / "kimi_eagle_host" / "edited_meanwhile.py").write_text("# saved during the command\n")
        h = inventory.load(env.inventory).hosts["gpu"]
        with session.HostSession(h) as s:
            res = s.call("ops.probe", [])
        assert res.exited == 0, (res.exited, res.stderr)
        assert session.payload_set() is before
        deployed = env.workdir / before.folder
        assert (deployed / "MANIFEST").read_text() == before.digest
        assert "as read" in (deployed / "kimi_eagle_host" / "__init__.py").read_text()
        assert not (deployed / "kimi_eagle_host" / "edited_meanwhile.py").exists()
    finally:
        session.payload_set.cache_clear()  # the real package again for the next test


def test_old_payload_sets_go_unless_a_job_that_may_run_names_them(env):
    """One folder per set would pile up with every upgrade: a deploy removes the sets no deploy has used for a week,
    except one a job that may still run names (started or queued with no exit code yet, or active within the week).
    Older layouts stay."""
    import time

    payloads = env.workdir / ".kimi-eagle" / "payloads"
    runs = env.workdir / "runs"
    old = time.time() - 8 * 86400

    def a_set(name, *, age=old):
        folder = payloads / name
        (folder / "kimi_eagle_host").mkdir(parents=True)
        (folder / "MANIFEST").write_text(name + "0" * 48)
        os.utime(folder / "MANIFEST", (age, age))
        return folder

    def a_job(job, names, *, exit_code=None, age=old):
        run = runs / job
        run.mkdir(parents=True)
        (run / "job.sh").write_text(f'export PYTHONPATH="$PWD"/.kimi-eagle/payloads/{names}\n')
        if exit_code is not None:
            (run / "exit_code").write_text(f"{exit_code}\n")
        for f in run.iterdir():
            os.utime(f, (age, age))

    unused, running, queued_data, finished, recent, active = (c * 16 for c in "abcdef")
    for name in (unused, running, queued_data, finished, active):
        a_set(name)
    a_set(recent, age=time.time() - 86400)
    slurm = json.dumps({"scheduler": "slurm"})
    a_job("j-running", running)                       # no exit code: a Slurm job queued for a week
    (runs / "j-running" / "meta.json").write_text(slurm)
    (runs / "j-data").mkdir(parents=True)            # its settings read a file of the set ({payloads})
    (runs / "j-data" / "settings.json").write_text(json.dumps({"dataset": f".kimi-eagle/payloads/{queued_data}/x"}))
    (runs / "j-data" / "meta.json").write_text(slurm)
    for f in (*(runs / "j-running").iterdir(), *(runs / "j-data").iterdir()):   # quiet for a week
        os.utime(f, (old, old))
    a_job("j-finished", finished, exit_code=0)
    a_job("j-active", active, exit_code=143, age=time.time() - 3600)  # e.g. a Slurm job requeued after preemption
    (payloads / "kimi_eagle_host").mkdir()            # the layout before sets had folders: an old job may run it
    (payloads / "MANIFEST").write_text("the old layout\n")

    r = env.cli("hosts", "check", "gpu")
    assert r.code == 0, r.stdout + r.stderr
    from kimi_eagle.hosts.session import payload_set

    left = sorted(p.name for p in payloads.iterdir())
    assert left == sorted([payload_set().digest[:16], running, queued_data, recent, active, "MANIFEST",
                           "kimi_eagle_host"]), left


def _wrapper(bin_dir, name, names_set, *, age=None):
    """A payload wrapper as session.payload_wrapper writes it, naming `names_set` (a set's folder name, or the old
    layout's kimi_eagle_host) in its PYTHONPATH line."""
    import hashlib

    text = f'#!/usr/bin/env bash\nexport PYTHONPATH="$PWD"/.kimi-eagle/payloads/{names_set}"${{PYTHONPATH:+:$PYTHONPATH}}"\n'
    path = bin_dir / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.sh"
    bin_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    if age is not None:
        os.utime(path, (age, age))
    return path.name


def test_a_lost_jobs_set_and_the_wrappers_of_gone_sets_do_not_stay_forever(env):
    """A job whose shell died without writing its end (`lost`) once held its payload set forever, and the wrappers
    in .kimi-eagle/bin were never removed: the host's .kimi-eagle grew with every upgrade. Now a lost job holds its
    set a week after its folder last changed, like an ended one, and a week-old wrapper whose set is gone goes with
    it; so does the set of a folder a start recorded a week ago without ever starting its job. A running job's set,
    one a start in progress names, the wrappers of sets that are there, and wrappers of older layouts stay."""
    import signal
    import time

    payloads = env.workdir / ".kimi-eagle" / "payloads"
    bin_dir = env.workdir / ".kimi-eagle" / "bin"
    runs = env.workdir / "runs"
    old = time.time() - 8 * 86400
    lost_set, running_set = "1" * 16, "2" * 16
    def job(what):
        r = env.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", "sleep", "300")
        assert r.code == 0, (r.stdout, r.stderr)
        return r.json()

    lost, running = job("lost"), job("running")
    meta = json.loads((runs / lost["id"] / "meta.json").read_text())
    os.killpg(meta.get("pgid") or meta["pid"], signal.SIGKILL)  # its shell and all it started: no end written
    deadline = time.monotonic() + 30
    while env.cli("--json", "status", lost["id"]).json()["jobs"][0]["state"] != "lost":
        assert time.monotonic() < deadline
        time.sleep(0.2)
    # Started from older checkouts' sets (a node script names them), and quiet for a week.
    for j, name in ((lost, lost_set), (running, running_set)):
        (payloads / name / "kimi_eagle_host").mkdir(parents=True)
        (payloads / name / "MANIFEST").write_text(name + "0" * 48)
        os.utime(payloads / name / "MANIFEST", (old, old))
        run = runs / j["id"]
        (run / "node.sh").write_text(f'export PYTHONPATH="$PWD"/.kimi-eagle/payloads/{name}\n')
        for f in run.iterdir():
            os.utime(f, (old, old))
    # Folders recorded by starts that never started their job (no meta.json): one a week old, one in progress.
    never_set, starting_set = "5" * 16, "6" * 16
    for name, age in ((never_set, old), (starting_set, None)):
        (payloads / name / "kimi_eagle_host").mkdir(parents=True)
        (payloads / name / "MANIFEST").write_text(name + "0" * 48)
        os.utime(payloads / name / "MANIFEST", (old, old))
        run = runs / f"20261129-000000-train-{name[:8]}"
        run.mkdir()
        (run / "job.sh").write_text(f'export PYTHONPATH="$PWD"/.kimi-eagle/payloads/{name}\n')
        if age:
            os.utime(run / "job.sh", (age, age))
    gone = _wrapper(bin_dir, "probe", "3" * 16, age=old)                 # its set was removed long ago
    of_lost = _wrapper(bin_dir, "preflight", lost_set, age=old)         # its set goes in this deploy
    of_running = _wrapper(bin_dir, "preflight", running_set, age=old)   # its set stays: a job runs from it
    fresh = _wrapper(bin_dir, "patch", "4" * 16)                        # a call of another terminal, just written
    older_layout = _wrapper(bin_dir, "probe", "kimi_eagle_host", age=old)

    try:
        r = env.cli("hosts", "check", "gpu")
        assert r.code == 0, r.stdout + r.stderr
        sets = {p.name for p in payloads.iterdir()}
        assert running_set in sets and lost_set not in sets, sets
        assert starting_set in sets and never_set not in sets, sets
        wrappers = {p.name for p in bin_dir.iterdir()}
        assert {of_running, fresh, older_layout} <= wrappers and not {gone, of_lost} & wrappers, wrappers
        assert [w for w in wrappers if w.startswith("probe-") and w != older_layout], wrappers  # this call's own
        assert env.cli("--json", "status", running["id"]).json()["jobs"][0]["state"] == "running"
    finally:
        env.cli("stop", running["id"], "--grace", "1")


def test_two_terminals_of_two_checkouts_keep_their_sets_and_wrappers_while_old_ones_go(env, tmp_path):
    """Two terminals at once, each with its own checkout (its own set and wrappers), each deploying and pruning while
    the other runs its wrapper: every call succeeds, and both sets and wrappers stay; the old ones go."""
    import time

    other = _checkout_copy(tmp_path / "checkout-b", "checkout B")
    bin_dir = env.workdir / ".kimi-eagle" / "bin"
    old = time.time() - 8 * 86400
    stale = [_wrapper(bin_dir, f"w{i}", f"{i:016x}", age=old) for i in range(20)]
    envs = [{"PYTHONPATH": str(REPO)}, {"PYTHONPATH": str(other)}]

    def terminal(e):
        return [env.cli("hosts", "check", "gpu", env=e) for _ in range(3)]

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(terminal, envs))
    for rs in results:
        for r in rs:
            assert r.code == 0, r.stdout + r.stderr
    wrappers = {p.name for p in bin_dir.iterdir()}
    assert not set(stale) & wrappers, wrappers
    probes = [bin_dir / w for w in wrappers if w.startswith("probe-")]
    sets = {p.name for p in (env.workdir / ".kimi-eagle" / "payloads").iterdir()}
    assert len(probes) == 2 and len(sets) == 2, (wrappers, sets)   # one of each per checkout
    for p in probes:   # each names a set that is there
        assert any(s in p.read_text() for s in sets), (p.read_text(), sets)
