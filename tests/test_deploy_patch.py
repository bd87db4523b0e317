"""`kimi-eagle deploy-patch` and `render patch`, through the CLI, against the real sshd (`gpu` host) and the
real speculators 0.3.0 / 0.4.0 wheels installed into throwaway --target dirs on the host's PYTHONPATH."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest

from conftest import REPO, make_env
from fixtures_speculators import PATCH_DIR, TARGETS, tree_hashes

SETS = {"0.3.0": "speculators-0.3.0-vllm-0.16", "0.4.0": "speculators-0.4.0"}


def _env_for(tmp_path, sshd, site, extra: str = ""):
    # make_env already puts PYTHONPATH=<repo> in the host's env; a second PYTHONPATH key follows it in the
    # same YAML mapping and wins, so the host Python sees the throwaway install first.
    return make_env(tmp_path, sshd, host_env={"PYTHONPATH": f"{site}{os.pathsep}{REPO}"}, extra=extra)


def _statuses(r) -> list[str]:
    (doc,) = r.json()
    return [f["status"] for f in doc["files"]]


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.mark.parametrize("version", ["0.3.0", "0.4.0"])
def test_check_diff_apply_reapply_revert(tmp_path, sshd, install, version):
    site = install(version)
    e = _env_for(tmp_path, sshd, site)
    pristine = tree_hashes(site)

    # --check and --diff report, change nothing.
    r = e.cli("--json", "deploy-patch", "--host", "gpu", "--check")
    assert r.code == 0, r.stderr
    assert _statuses(r) == ["would-change"] * 2
    assert tree_hashes(site) == pristine
    r = e.cli("deploy-patch", "--host", "gpu", "--diff")
    assert r.code == 0, r.stderr
    for rel in TARGETS:
        assert f"--- a/{rel}" in r.stdout and f"+++ b/{rel}" in r.stdout
    assert "@@ -" in r.stdout and "+def _kimi_eagle_resolve_base_model(model):" in r.stdout
    assert "would-change" in r.stdout and "check passed" in r.stdout
    assert tree_hashes(site) == pristine

    # First apply: changed, pristine copies stored next to the install.
    r = e.cli("--json", "deploy-patch", "--host", "gpu")
    assert r.code == 0, r.stderr
    (doc,) = r.json()
    assert doc["ok"] and doc["error"] is None and doc["version"] == version and doc["patch_set"] == SETS[version]
    assert [f["status"] for f in doc["files"]] == ["changed", "changed"]
    assert doc["state_dir"] == str(site / ".kimi-eagle-pristine")
    patched = tree_hashes(site)
    for f in doc["files"]:
        assert f["sha256_before"] == pristine[f["path"]] and f["sha256_after"] == patched[f["path"]]
        assert patched[f["path"]] != pristine[f["path"]]
    assert len(list((site / ".kimi-eagle-pristine").rglob("*.pristine"))) == 2

    # Second apply: ok, byte-identical; the human view says so.
    r = e.cli("deploy-patch", "--host", "gpu")
    assert r.code == 0, r.stderr
    assert "already patched" in r.stdout and "[gpu] patched (2 ok)" in r.stdout
    assert tree_hashes(site) == patched

    # --check on a patched install: nothing to do, nothing changed.
    r = e.cli("--json", "deploy-patch", "--host", "gpu", "--check")
    assert r.code == 0 and _statuses(r) == ["ok", "ok"]
    assert tree_hashes(site) == patched

    # --revert restores the original bytes and removes our copies.
    r = e.cli("--json", "deploy-patch", "--host", "gpu", "--revert")
    assert r.code == 0, r.stderr
    assert _statuses(r) == ["reverted", "reverted"]
    assert tree_hashes(site) == pristine
    assert not list(site.rglob("*.pristine"))


def test_hand_edited_file_fails_and_is_left_untouched(tmp_path, sshd, install):
    site = install("0.4.0")
    e = _env_for(tmp_path, sshd, site)
    assert e.cli("deploy-patch", "--host", "gpu").code == 0
    edited = site / TARGETS[0]
    edited.write_text(edited.read_text() + "# a local tweak\n")
    before = tree_hashes(site)

    r = e.cli("--json", "deploy-patch", "--host", "gpu")
    assert r.code == 1
    (doc,) = r.json()
    assert doc["ok"] is False
    bad = next(f for f in doc["files"] if f["path"] == TARGETS[0])
    assert bad["status"] == "failed" and "hand-edited" in bad["reason"]
    assert tree_hashes(site) == before

    human = e.cli("deploy-patch", "--host", "gpu")
    assert human.code == 1 and "failed" in human.stdout and "[gpu] NOT patched" in human.stdout
    assert e.cli("deploy-patch", "--host", "gpu", "--revert").code == 1  # not reverting over the edit either
    assert tree_hashes(site) == before


@pytest.mark.parametrize("which", [0, 1])
def test_the_summary_names_the_file_that_failed(tmp_path, sshd, install, which):
    """Not the other file, skipped because of it ('not written: another file of the set failed')."""
    site = install("0.3.0")
    e = _env_for(tmp_path, sshd, site)
    edited = site / TARGETS[which]
    edited.write_text(edited.read_text() + "# a local tweak\n")
    human = e.cli("deploy-patch", "--host", "gpu")
    assert human.code == 1
    summary = next(ln for ln in human.stdout.splitlines() if ln.startswith("[gpu] NOT patched"))
    assert TARGETS[which] in summary and "hand-edited" in summary, summary


def test_unsupported_version_is_skipped_and_exits_1(tmp_path, sshd, install):
    site = install("0.4.0")
    e = _env_for(tmp_path, sshd, site)
    before = tree_hashes(site)
    r = e.cli("--json", "deploy-patch", "--host", "gpu", "--patch-set", SETS["0.3.0"])
    assert r.code == 1
    (doc,) = r.json()
    assert doc["ok"] is False and _statuses(r) == ["skipped", "skipped"]
    assert "outside the set's range" in doc["reason"]
    human = e.cli("deploy-patch", "--host", "gpu", "--patch-set", SETS["0.3.0"], "--check")
    assert human.code == 1 and "skipped" in human.stdout and "check failed" in human.stdout
    assert tree_hashes(site) == before
    assert not (site / ".kimi-eagle-pristine").exists()


def test_unknown_patch_set_is_exit_2_with_one_line(tmp_path, sshd, install):
    site = install("0.4.0")
    e = _env_for(tmp_path, sshd, site)
    r = e.cli("deploy-patch", "--host", "gpu", "--patch-set", "no-such-set")
    assert r.code == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "unknown patch set 'no-such-set'" in lines[0] and SETS["0.4.0"] in lines[0]
    assert not (e.workdir / ".kimi-eagle").exists()  # refused before the host was contacted
    assert e.cli("deploy-patch", "--host", "gpu", "--revert", "--check").code == 2


def test_unreachable_host_fails_the_run_but_not_the_others(tmp_path, sshd, install):
    site = install("0.4.0")
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    extra = f"""  down:
    address: 127.0.0.1
    port: {dead}
    user: root
    identity_file: {sshd.client_key}
    known_hosts: {tmp_path / "known_hosts"}
    connect_timeout: 3
groups:
  all: [gpu, down]
"""
    e = _env_for(tmp_path, sshd, site, extra=extra)
    r = e.cli("--json", "deploy-patch", "--group", "all")
    assert r.code == 5  # the only failure is the connection's
    by_host = {d["host"]: d for d in r.json()}
    assert by_host["gpu"]["ok"] and [f["status"] for f in by_host["gpu"]["files"]] == ["changed", "changed"]
    assert not by_host["down"]["ok"] and by_host["down"]["error"]


def test_render_patch_writes_engine_sets_and_script_offline(tmp_path, install):
    work = tmp_path / "rendered"
    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"""hosts:
  gpu:
    address: blackwell-01.example
    user: nobody
    python: {sys.executable}
    workdir: {work}
    env: {{PYTHONPATH: "{install('0.3.0')}"}}
""")
    e = make_env(tmp_path / "e", None)
    e.inventory = inv
    r = e.cli("render", "patch", "--host", "gpu", "--out", str(work), timeout=60)
    assert r.code == 0, r.stderr
    script = work / ".kimi-eagle" / "bin" / "patch.sh"
    from kimi_eagle.hosts.session import payload_set

    package = work / payload_set().folder / "kimi_eagle_host"
    engine = package / "ops" / "deploy_patch.py"
    assert engine.read_bytes() == (REPO / "kimi_eagle_host" / "ops" / "deploy_patch.py").read_bytes()
    sets = sorted(p.name for p in (package / "patch_sets").iterdir())
    assert sets == sorted(p.name for p in PATCH_DIR.glob("*.json")) and sets
    for name in sets:
        assert (package / "patch_sets" / name).read_bytes() == (PATCH_DIR / name).read_bytes()
    (wrapper,) = (work / ".kimi-eagle" / "bin").glob("patch-*.sh")  # as uploaded: named by content, no flags
    assert "-m kimi_eagle_host.ops.deploy_patch" in wrapper.read_text() and "--patch-set" not in wrapper.read_text()
    text = script.read_text()  # how it is run: the wrapper with this call's flags
    assert wrapper.name in text and "--patch-set auto" in text
    assert os.access(script, os.X_OK)
    assert {str(script), str(engine)} <= set(r.stdout.split())

    # What was rendered is what runs: the script applies the set from the rendered files alone.
    p = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60,
                       env={k: v for k, v in os.environ.items() if not k.startswith("KIMI_EAGLE")})
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    assert doc["patch_set"] == SETS["0.3.0"] and [f["status"] for f in doc["files"]] == ["changed", "changed"]


def test_a_set_the_host_refuses_is_exit_2_naming_it(tmp_path, install, monkeypatch, capsys):
    """Should the host's engine refuse the set (exit 2, no JSON), the CLI exits 2 with its one line."""
    from kimi_eagle import cli
    from kimi_eagle.operations import deploy_patch
    from kimi_eagle.cli.context import state

    inv = tmp_path / "inventory.yaml"
    inv.write_text(f"""hosts:
  local:
    transport: local
    python: {sys.executable}
    workdir: {tmp_path / "work"}
    env: {{PYTHONPATH: "{install('0.4.0')}"}}
""")
    monkeypatch.setattr(deploy_patch, "check_patch_set", lambda name: None)  # skip the local check
    monkeypatch.setattr(state, "_inventory", None)
    with pytest.raises(SystemExit) as exc:
        cli.main(["--inventory", str(inv), "deploy-patch", "--patch-set", "no-such-set"])
    assert exc.value.code == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "unknown patch set 'no-such-set'" in err[0] and err[0].startswith("error: local:")


@pytest.mark.vllm
def test_a_host_that_needs_no_patch_says_skipped_and_exits_0(tmp_path, sshd, install):
    """speculators 0.9.0 (no set covers it) next to vLLM 0.32 (native extraction) on the host: a clear
    "skipped, nothing to patch", exit 0, in --check and apply; nothing written on the host."""
    from vllm_envs import SUITE_VLLM, env_python

    site = install("0.9.0")
    e = make_env(tmp_path, sshd, host_env={"PYTHONPATH": f"{site}{os.pathsep}{REPO}"},
                 python=str(env_python(SUITE_VLLM)))
    before = tree_hashes(site)
    for mode in (["--check"], []):
        r = e.cli("--json", "deploy-patch", "--host", "gpu", *mode)
        assert r.code == 0, r.stdout + r.stderr
        (doc,) = r.json()
        assert doc["ok"] is True and doc["files"] == [] and f"vLLM {SUITE_VLLM}" in doc["not_needed"]
        human = e.cli("deploy-patch", "--host", "gpu", *mode)
        assert human.code == 0 and "skipped, nothing to patch" in human.stdout, human.stdout + human.stderr
    assert tree_hashes(site) == before and not (site / ".kimi-eagle-pristine").exists()
