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


def _ip(*args, check=True):
    import subprocess

    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def test_a_silently_dropped_link_is_exit_5_within_a_minute_not_fifteen(tmp_path):
    """A VPN or Wi-Fi drop sends no reset: the sshd's machine just stops answering. Our SSH keepalive keeps data in
    flight, so the kernel sends no TCP keepalive probe, and a command without a timeout of its own (`hosts check`,
    status, uploads) hung until the retransmissions ran out, about 15 minutes. Here the sshd lives in a network
    namespace of its own, the CLI in another, joined by a veth pair whose far end goes down mid-command."""
    import os
    import secrets
    import shutil
    import signal
    import subprocess
    import time

    from conftest import REPO
    from sshd import SSHD, Sshd

    if os.geteuid() != 0 or not shutil.which("ip") or _ip("netns", "list", check=False).returncode:
        pytest.skip("needs root and `ip netns` (network namespaces)")
    tag = "ke" + secrets.token_hex(3)
    client_ns, server_ns, near, far = f"{tag}c", f"{tag}s", f"{tag}a", f"{tag}b"
    server, cli = Sshd(tmp_path / "sshd"), None
    started = tmp_path / "probe-started"
    try:
        _ip("netns", "add", client_ns)
        _ip("netns", "add", server_ns)
        _ip("link", "add", near, "netns", client_ns, "type", "veth", "peer", "name", far, "netns", server_ns)
        for ns, dev, addr in ((client_ns, near, "10.203.0.1/30"), (server_ns, far, "10.203.0.2/30")):
            _ip("-n", ns, "addr", "add", addr, "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
        server.config.write_text(server.config.read_text().replace("ListenAddress 127.0.0.1", "ListenAddress 10.203.0.2"))
        server.proc = subprocess.Popen(["ip", "netns", "exec", server_ns, SSHD, "-D", "-e", "-f", str(server.config)],
                                       stderr=open(server.root / "sshd.log", "ab"))
        reach = f"exec 3<>/dev/tcp/10.203.0.2/{server.port}"
        deadline = time.monotonic() + 15
        while subprocess.run(["ip", "netns", "exec", client_ns, "bash", "-c", reach], capture_output=True).returncode:
            assert time.monotonic() < deadline and server.proc.poll() is None, (server.root / "sshd.log").read_text()
            time.sleep(0.1)
        # The host's Python, except that the probe of `hosts check` stays busy (silent) for two minutes.
        python = tmp_path / "python"
        python.write_text(f'#!/bin/bash\ncase "$*" in *ops.probe*) echo $$ > {started}; sleep 120;; esac\n'
                          f'exec {sys.executable} "$@"\n')
        python.chmod(0o755)
        e = make_env(tmp_path, server)
        kind, b64 = (server.root / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        (tmp_path / "known_hosts").write_text(f"[10.203.0.2]:{server.port} {kind} {b64}\n")
        e.inventory.write_text(e.inventory.read_text().replace("address: 127.0.0.1", "address: 10.203.0.2")
                               .replace(f"python: {sys.executable}", f"python: {python}", 1))
        env = {**os.environ, "HOME": str(e.home), "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
        cli = subprocess.Popen(["ip", "netns", "exec", client_ns, sys.executable, "-m", "kimi_eagle", "--inventory",
                                str(e.inventory), "hosts", "check", "gpu"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 120
        while not started.exists():
            assert cli.poll() is None and time.monotonic() < deadline, cli.communicate()
            time.sleep(0.1)
        _ip("-n", server_ns, "link", "set", far, "down")
        dropped = time.monotonic()
        try:
            out, err = cli.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            pytest.fail("`hosts check` still hangs 150 s after the link went down")
        assert cli.returncode == 5 and "connection lost" in out + err, (cli.returncode, out, err)
        assert time.monotonic() - dropped < 100
    finally:
        if cli is not None and cli.poll() is None:
            cli.kill()
        if started.exists():
            try:
                os.kill(int(started.read_text()), signal.SIGKILL)
            except (ValueError, ProcessLookupError):
                pass
        server.stop()
        for ns in (client_ns, server_ns):
            _ip("netns", "del", ns, check=False)
