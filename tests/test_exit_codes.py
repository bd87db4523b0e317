"""Exit codes a script can act on: 1 the job (or a host's command) failed, 2 bad input, 5 the connection failed,
each over the real sshd."""

from __future__ import annotations

import sys

import pytest

from conftest import make_env
from sshd import free_port

PY = sys.executable


def _unreachable(e):
    e.inventory.write_text(e.inventory.read_text().replace(f"port: {e.sshd.port}", f"port: {free_port()}"))
    return e


@pytest.mark.parametrize("argv", [
    ["run", "exec", "--host", "gpu", "--", "true"],
    ["status", "--host", "gpu"],
    ["preflight", "prepare", "--host", "gpu"],
    ["upload", "README", "--host", "gpu", "--to", "x"],
    ["hosts", "check", "gpu"],
    ["status", "exec-20260101-000000-abcd", "--host", "gpu"],
    ["logs", "exec-20260101-000000-abcd", "--host", "gpu"],
    ["logs", "exec-20260101-000000-abcd", "--host", "gpu", "--follow"],
    ["stop", "exec-20260101-000000-abcd", "--host", "gpu"],
    ["pull", "exec-20260101-000000-abcd", "--host", "gpu"],
    ["clean", "--run", "out", "--host", "gpu", "--dry-run"],
])
def test_a_host_that_cannot_be_reached_is_exit_5(tmp_path, sshd, argv):
    e = _unreachable(make_env(tmp_path, sshd, extra="pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n"))
    (tmp_path / "README").write_text("x")
    r = e.cli(*argv)
    assert r.code == 5, (argv, r.stdout, r.stderr)
    assert "Traceback" not in r.stderr and "cannot reach 127.0.0.1" in r.stdout + r.stderr


def test_a_failed_job_is_1_and_bad_input_is_2_on_the_same_host(tmp_path, sshd):
    e = make_env(tmp_path, sshd)
    r = e.cli("run", "exec", "--host", "gpu", "--", PY, "-c", "raise SystemExit(3)")
    assert r.code == 1, (r.stdout, r.stderr)
    assert e.cli("run", "exec", "--host", "nosuch", "--", "true").code == 2
    # One of two hosts unreachable and the other fine: the command failed for the connection alone (5); a
    # failure of the reachable host's own would make it 1.
    e.write_inventory(e.inventory.read_text().replace("  local:\n", f"""  far:
    address: 127.0.0.1
    port: {free_port()}
    python: {PY}
  local:
""", 1))
    r = e.cli("status")
    assert r.code == 5 and "[far]" in r.stdout, (r.stdout, r.stderr)


def test_what_counts_as_the_connection_failing():
    """The library's view: raw network errors and lost connections count as the transport's, nothing else."""
    import socket

    import paramiko

    from kimi_eagle.errors import (CommandError, ConfigError, ConnectionFailed, HostKeyError, failure_exit,
                                   is_transport_failure)

    for e in (ConnectionResetError("reset"), EOFError(), socket.timeout(), paramiko.SSHException("x"),
              ConnectionFailed("lost")):
        assert is_transport_failure(e) and failure_exit([e]) == 5, e
    for e in (CommandError("exit 1"), ConfigError("bad"), HostKeyError("unknown key"), ValueError("bug")):
        assert not is_transport_failure(e), e
    assert failure_exit([ConnectionFailed("a"), CommandError("b")]) == 1


@pytest.mark.parametrize("argv", [["status", "--host", "gpu"], ["hosts", "check", "gpu"],
                                  ["run", "exec", "--host", "gpu", "--", "true"]])
def test_a_missing_identity_file_is_the_inventorys_mistake_exit_2_not_unreachable(tmp_path, sshd, argv):
    e = make_env(tmp_path, sshd)
    e.inventory.write_text(e.inventory.read_text().replace(str(sshd.client_key), str(tmp_path / "no-such-key")))
    r = e.cli(*argv)
    out = r.stdout + r.stderr
    assert r.code == 2, (argv, r.code, out)
    assert "identity_file" in out and str(tmp_path / "no-such-key") in out and "unreachable" not in out
    assert "Traceback" not in out


def test_a_connection_lost_during_pull_is_exit_5_and_leaves_no_partial_file(tmp_path, sshd):
    """The sshd and its sessions go away while a large file is on its way here."""
    import os
    import subprocess
    import time

    from conftest import REPO

    e = make_env(tmp_path, sshd, extra="pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n")
    r = e.cli("--json", "run", "vocab", "--host", "gpu", "--detach", "--no-preflight", "--", "--help")
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    assert e.cli("logs", job, "--follow").code == 0
    export = e.workdir / "out" / "draft" / "export"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    with open(export / "model.safetensors", "wb") as f:
        f.write(os.urandom(1 << 20) * 1500)  # 1.5 GB: longer on the wire than the test takes to cut it
    dest = tmp_path / "here"
    env = {**os.environ, "HOME": str(e.home), "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    # the folder by name: `pull JOB` leaves out an export that JOB did not write (this one was made by hand)
    pull = subprocess.Popen([PY, "-m", "kimi_eagle", "--inventory", str(e.inventory), "pull", "--host", "gpu",
                             "--run", str(e.workdir / "out"), "--to", str(dest)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        deadline = time.monotonic() + 120
        while not [p for p in dest.rglob("*.part") if p.stat().st_size > 0]:
            assert pull.poll() is None and time.monotonic() < deadline, pull.communicate()
            time.sleep(0.05)
        sshd.stop(kill_sessions=True)
        out, err = pull.communicate(timeout=120)
    finally:
        sshd.start() if sshd.proc.poll() is not None else None
        if pull.poll() is None:
            pull.kill()
    assert pull.returncode == 5, (pull.returncode, out, err)
    assert "connection lost" in err and "Traceback" not in err, err
    assert not list(dest.rglob("*.part")) and not (export.parent.parent / "here").exists()
    assert not (dest / "draft" / "export" / "model.safetensors").exists()


def test_an_openssh_upload_refused_at_its_start_is_the_connections_failure(tmp_path):
    """Large files go through the OpenSSH client: its exit 255 for a refused connection is exit 5, not 1."""
    from kimi_eagle.errors import failure_exit
    from kimi_eagle.config.inventory import load
    from kimi_eagle.hosts.transport.ssh import SSHTransport

    e = make_env(tmp_path, None)
    e.write_inventory(f"""hosts:
  far:
    address: 127.0.0.1
    port: {free_port()}
    connect_timeout: 5
    workdir: /tmp/kimi-eagle-never
""")
    big = tmp_path / "big"
    big.write_bytes(b"x" * 1024)
    transport = SSHTransport(load(str(e.inventory)).one("far"))
    with pytest.raises(Exception) as refused:
        transport._openssh_receive(str(big), "/tmp/kimi-eagle-never/big", 0o644, None)
    assert failure_exit([refused.value]) == 5, refused.value
    assert "Connection refused" in str(refused.value)
