"""`logs JOB` against a host that never answered: one line at once, no ten minutes of reconnecting, no traceback.

Real sockets on 127.0.0.1: a port where nothing listens (connection refused) and a server that accepts and never
sends an SSH banner. A connection that once worked is still retried (tests/test_jobs.py: sshd restart).
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from conftest import make_env
from sshd import free_port


@pytest.fixture
def silent_server():
    """Accepts TCP connections and says nothing (no SSH banner), until the test ends."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    held, stop = [], threading.Event()

    def accept():
        srv.settimeout(0.2)
        while not stop.is_set():
            try:
                held.append(srv.accept()[0])
            except OSError:
                pass

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield srv.getsockname()[1]
    stop.set()
    t.join()
    for c in held:
        c.close()
    srv.close()


def inventory_at(tmp_path, port):
    env = make_env(tmp_path, None)
    env.write_inventory(f"""hosts:
  quiet:
    address: 127.0.0.1
    port: {port}
    user: root
    connect_timeout: 2
    workdir: /tmp/kimi-eagle-never
""")
    return env


@pytest.mark.parametrize("case", ["refused", "no-banner"])
@pytest.mark.parametrize("cmd", [["logs", "20261201-000000-exec-abcd"], ["logs", "20261201-000000-exec-abcd", "--follow"]])
def test_a_host_that_never_answered_fails_fast_with_one_line(tmp_path, silent_server, case, cmd):
    port = free_port() if case == "refused" else silent_server
    env = inventory_at(tmp_path, port)
    t0 = time.monotonic()
    r = env.cli(*cmd, "--host", "quiet", timeout=60)
    took = time.monotonic() - t0
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.code == 5, (r.code, r.stdout, r.stderr)
    assert len(lines) == 1 and "quiet" in lines[0] and "Traceback" not in r.stderr, r.stderr
    assert "reconnecting" not in r.stderr and took < 30, took


@pytest.mark.parametrize("cmd", [["preflight", "prepare"], ["hosts", "check"], ["status"]])
def test_a_host_that_sends_no_ssh_banner_is_told_what_to_do(tmp_path, silent_server, cmd):
    env = inventory_at(tmp_path, silent_server)
    r = env.cli(*cmd, *(["--host"] if cmd[0] != "hosts" else []), "quiet", timeout=60)
    said = r.stdout + r.stderr
    assert r.code == 5, (r.code, said)
    assert "SSH banner not received" in said and "within 2s" in said and "connect_timeout" in said, said
    assert "No existing session" not in said and "Traceback" not in said
