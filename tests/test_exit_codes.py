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
