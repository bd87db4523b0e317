"""Rendering safety and verified, atomic uploads, on the real sshd and on the local transport."""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO

HOSTILE = [
    "it's",
    'say "hi"',
    "$(touch /tmp/kimi-eagle-pwned)",
    "`touch /tmp/kimi-eagle-pwned`",
    "a; touch /tmp/kimi-eagle-pwned",
    "x && touch /tmp/kimi-eagle-pwned",
    "two\nlines",
    "  spaced  out  ",
    "ünïcødé ✓ 日本語",
    "$HOME ${PATH} \\n \\",
    "",
    "-flag-looking",
    "*",
]


def test_every_template_interpolation_goes_through_a_quoting_filter():
    import jinja2
    from jinja2 import nodes

    from kimi_eagle.templating import environment

    allowed = {"sh", "sh_path", "sh_join", "sh_name", "comment", "sbatch"}  # `comment` only in comments: test_template_safety.py
    env = environment()
    templates = sorted((REPO / "templates").glob("*.j2"))
    assert templates
    for t in templates:
        ast = env.parse(t.read_text())
        for out in ast.find_all(nodes.Output):
            for node in out.nodes:
                if isinstance(node, nodes.TemplateData):
                    continue
                ok = isinstance(node, nodes.Filter) and node.name in allowed
                ok = ok or (isinstance(node, nodes.Name) and node.name == "version")
                assert ok, f"{t.name}:{node.lineno}: interpolation without a quoting filter"


def test_unquoted_value_is_refused_at_render_time(tmp_path):
    import jinja2

    from kimi_eagle import templating
    from kimi_eagle.errors import ConfigError

    env = templating.environment().overlay(loader=jinja2.DictLoader({"bad.sh.j2": "echo {{ value }}\n"}))
    with pytest.raises(ConfigError, match="without a quoting filter"):
        env.get_template("bad.sh.j2").render(value="x; rm -rf /")


def test_nul_byte_is_refused():
    from kimi_eagle.errors import ConfigError
    from kimi_eagle.shell import quote

    with pytest.raises(ConfigError, match="NUL"):
        quote("a\x00b")


@pytest.mark.parametrize("host", ["gpu", "local"])
def test_hostile_values_arrive_byte_exact(env, host, tmp_path):
    """Values in argv and env pass through a rendered script run on the host unchanged."""
    from kimi_eagle.config import inventory
    from kimi_eagle import templating
    from kimi_eagle.hosts import sync
    from kimi_eagle.hosts.session import HostSession

    inv = inventory.load(env.inventory)
    h = inv.hosts[host]
    h.env.update({f"HOSTILE_{i}": v for i, v in enumerate(HOSTILE)})
    echo = tmp_path / "echo.py"
    echo.write_text(
        "import json, os, sys\n"
        "print(json.dumps({'argv': sys.argv[1:], 'env': [os.environ[f'HOSTILE_{i}'] for i in range(%d)]}))\n" % len(HOSTILE)
    )
    with HostSession(h) as s:
        # A module of the host package, next to the deployed ones: wrappers run `python -m kimi_eagle_host.<module>`.
        s.deploy_payloads()
        sync.sync(s.transport, s.path(s.payloads), [sync.Item(remote="kimi_eagle_host/echo.py", local=echo)])
        files = s.render_payload("echo", "echo", HOSTILE)
        s.upload_scripts(files)
        # Both ways in: the wrapper with the flags at run time (what run_payload does), and the rendered call.
        res = s.transport.run(f"bash {templating.sh_join([s.path(s.payload_wrapper('echo', 'echo')[0]), *HOSTILE])}", check=True)
        via_call = s.transport.run(f"bash {templating.quote(s.path('.kimi-eagle/bin/echo.sh'))}", check=True)
    assert via_call.stdout == res.stdout
    got = json.loads(res.stdout)
    assert got["argv"] == HOSTILE
    assert got["env"] == HOSTILE
    assert not Path("/tmp/kimi-eagle-pwned").exists()


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


@pytest.mark.parametrize("host", ["gpu", "local"])
def test_upload_verifies_and_skips_unchanged(env, host, tmp_path):
    src = tmp_path / "data"
    (src / "sub").mkdir(parents=True)
    (src / "a.bin").write_bytes(os.urandom(300_000))
    (src / "sub" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    (src / "sub" / "run.sh").chmod(0o755)
    r = env.cli("--json", "upload", str(src), "--host", host, "--to", "incoming")
    assert r.code == 0, r.stderr
    out = r.json()[0]
    assert sorted(out["changed"]) == ["data/a.bin", "data/sub/run.sh"] and out["unchanged"] == []
    base = Path(out["root"])
    assert _sha(base / "data" / "a.bin") == _sha(src / "a.bin")
    assert os.access(base / "data" / "sub" / "run.sh", os.X_OK)
    # Second deploy of unchanged files transfers nothing.
    again = env.cli("--json", "upload", str(src), "--host", host, "--to", "incoming").json()[0]
    assert again["changed"] == [] and again["bytes_sent"] == 0
    # One changed file is the only one sent.
    (src / "a.bin").write_bytes(os.urandom(1000))
    third = env.cli("--json", "upload", str(src), "--host", host, "--to", "incoming").json()[0]
    assert third["changed"] == ["data/a.bin"] and _sha(base / "data" / "a.bin") == _sha(src / "a.bin")
    assert not list(base.rglob("*.part"))


def test_killed_upload_leaves_nothing_at_the_final_path_and_a_rerun_completes(env, tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(64):
            f.write(os.urandom(4 << 20))  # 256 MiB: long enough to kill midway
    target_dir = env.workdir / "incoming"
    final = target_dir / "big.bin"
    e = {**os.environ, "HOME": str(env.home), "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kimi_eagle", "--inventory", str(env.inventory), "upload", str(big), "--host", "gpu", "--to", "incoming"],
        env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 60
    part = None
    while time.monotonic() < deadline:
        parts = list(target_dir.glob(".big.bin.*.part")) if target_dir.exists() else []
        if parts and parts[0].stat().st_size > (8 << 20):
            part = parts[0]
            sent = part.stat().st_size
            break
        time.sleep(0.02)
    assert part is not None, "upload never started"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert sent < big.stat().st_size  # it really was cut midway
    assert not final.exists()
    r = env.cli("--json", "upload", str(big), "--host", "gpu", "--to", "incoming")
    assert r.code == 0, r.stderr
    assert _sha(final) == _sha(big)
    assert not list(target_dir.glob("*.part"))


def test_render_writes_files_without_network(tmp_path, sshd):
    from conftest import make_env

    e = make_env(tmp_path, sshd)
    # An address nothing listens on: render must not try to connect.
    e.inventory.write_text(e.inventory.read_text().replace("127.0.0.1", "blackwell-01.example"))
    r = e.cli("render", "probe", "--host", "gpu", "--out", str(tmp_path / "rendered"))
    assert r.code == 0, r.stderr
    (wrapper,) = (tmp_path / "rendered" / ".kimi-eagle" / "bin").glob("probe-*.sh")
    script = wrapper.read_text()
    assert "set -euo pipefail" in script and "-m kimi_eagle_host.ops.probe" in script and sys.executable in script


def test_a_payload_layout_from_before_the_package_is_left_alone_and_never_imported(tmp_path, sshd):
    """A workdir used before the host code became a package holds payloads/step_runtime.py, payloads/pipeline/*.py,
    payloads/ops/*.py (a job started then may still be running them). The upload leaves them; every command now
    runs the package as uploaded, and none of the old files is imported (each would end the process if it were)."""
    from conftest import make_env

    e = make_env(tmp_path, sshd, host_env={"PYTHONPATH": ""})  # the host sees no checkout: only what was uploaded
    old = e.workdir / ".kimi-eagle" / "payloads"
    stale = ["step_runtime.py", "versions.py", "vllm_compat.py", "model_size.py", "pipeline/launch.py",
             "pipeline/prepared_data.py", "ops/probe.py", "ops/jobctl.py", "ops/provenance.py"]
    for rel in stale:
        (old / rel).parent.mkdir(parents=True, exist_ok=True)
        (old / rel).write_text("raise SystemExit('stale payload imported: ' + __file__)\n")
    (old / "MANIFEST").write_text("the digest of the old layout\n")

    assert e.cli("--json", "hosts", "check", "gpu").code == 0
    code = "import kimi_eagle_host.step_runtime as s, kimi_eagle_host.gpus; print('runtime at', s.__file__)"
    r = e.cli("--json", "run", "exec", "--host", "gpu", "--no-gpu", "--", sys.executable, "-c", code)
    assert r.code == 0, (r.stdout, r.stderr)
    from kimi_eagle.hosts.session import payload_set

    assert f"runtime at {e.workdir / payload_set().folder}/kimi_eagle_host/step_runtime.py" in r.stdout + r.stderr
    status = e.cli("--json", "status", "--host", "gpu")
    assert status.code == 0 and "stale payload" not in status.stdout + status.stderr, (status.stdout, status.stderr)
    assert all((old / rel).exists() for rel in stale)  # left for the jobs that may still use them
