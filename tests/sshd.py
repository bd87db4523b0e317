"""A real OpenSSH sshd on 127.0.0.1 for tests: free port, temporary host and client keys, internal-sftp."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

SSHD = shutil.which("sshd") or "/usr/sbin/sshd"


_handed_out: set[int] = set()


def ephemeral_low() -> int:
    """The first port the kernel hands out as the local end of outgoing connections (Linux; 32768 elsewhere)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, for a server a test starts later: from below the ephemeral range, never one handed out
    before in this process. A port of the ephemeral range (bind to 0) can be taken in between as the local end
    of any outgoing connection, and the tests make hundreds (ssh, torchrun's stores): a rendezvous port then was
    'in use' now and then."""
    import random

    lo, hi = 20000, min(ephemeral_low(), 32768)
    for _ in range(500 if hi - lo > 1000 else 0):
        port = random.randrange(lo, hi)
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:   # no room below the ephemeral range on this machine
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def keygen(path: Path, kind: str = "ed25519") -> Path:
    subprocess.run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(path)], check=True)
    return path


class Sshd:
    def __init__(self, root: Path):
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        self.host_key = keygen(root / "ssh_host_ed25519_key")
        self.client_key = keygen(root / "id_ed25519")
        (root / "authorized_keys").write_text((root / "id_ed25519.pub").read_text())
        self.config = root / "sshd_config"
        self.proc = None
        self.write_config()

    def write_config(self, extra: str = ""):
        threads = " ".join(f"{k}={os.environ[k]}" for k in ("OMP_NUM_THREADS", "VLLM_CPU_OMP_THREADS_BIND") if k in os.environ)
        self.config.write_text(
            f"""Port {self.port}
ListenAddress 127.0.0.1
HostKey {self.host_key}
PidFile {self.root}/sshd.pid
AuthorizedKeysFile {self.root}/authorized_keys
PermitRootLogin yes
PasswordAuthentication no
KbdInteractiveAuthentication no
PubkeyAuthentication yes
UsePAM no
StrictModes no
UseDNS no
PrintMotd no
LogLevel ERROR
MaxSessions 50
MaxStartups 50:30:100
Subsystem sftp internal-sftp
# This test session's machine registry (claims, GPU lock), not the real user's (see ops/machine_claims.py), and the
# tests' threads per process (conftest.py)
SetEnv KIMI_EAGLE_MACHINE_DIR={self.root}/machine {threads}
{extra}
"""
        )

    def host_key_line(self) -> str:
        kind, b64 = (self.root / "ssh_host_ed25519_key.pub").read_text().split()[:2]
        return f"[127.0.0.1]:{self.port} {kind} {b64}\n"

    def start(self):
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)
        # -D: stay in the foreground so the fixture owns it; -e: errors to stderr.
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config)], stderr=open(self.root / "sshd.log", "ab"))
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sshd exited: {(self.root / 'sshd.log').read_text()}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.5):
                    return self
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("sshd did not start listening")

    def _processes(self) -> tuple[dict[int, list[int]], dict[int, str]]:
        """This machine's processes now: (children by parent, command name by pid)."""
        children: dict[int, list[int]] = {}
        comm: dict[int, str] = {}
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                stat = (d / "stat").read_text()
                comm[int(d.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            except (OSError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
        return children, comm

    @staticmethod
    def _below(children, top: int) -> list[int]:
        found, todo = [], [top]
        while todo:
            for c in children.get(todo.pop(), []):
                found.append(c)
                todo.append(c)
        return found

    def _sshd_descendants(self) -> list[int]:
        """Per-connection sshd processes forked from our listener (never any other sshd)."""
        children, comm = self._processes()
        return [p for p in self._below(children, self.proc.pid) if comm.get(p, "").startswith("sshd")]

    def drop_connections_running(self, command: str) -> int:
        """Cut each open connection that runs `command` (a process of that name below it), as drop_connections does;
        the others go on. Returns how many were cut."""
        children, comm = self._processes()
        cut = 0
        for conn in children.get(self.proc.pid, []):
            below = self._below(children, conn)
            if any(comm.get(p) == command for p in below):
                _kill([conn] + [p for p in below if comm.get(p, "").startswith("sshd")])
                cut += 1
        return cut

    def stop(self, kill_sessions: bool = True):
        """Stop the listener; with kill_sessions, drop every open connection too (like a restart of the box's sshd)."""
        if not self.proc or self.proc.poll() is not None:
            return
        sessions = self._sshd_descendants() if kill_sessions else []
        self.proc.terminate()
        self.proc.wait(10)
        _kill(sessions)

    def drop_connections(self):
        """Cut every open connection (SIGKILL to the per-connection sshd processes); the server goes on listening:
        a network drop, with the host up."""
        _kill(self._sshd_descendants())

    def cutter(self, path: Path) -> Path:
        """A script that cuts the one connection it runs under, from the host's side (SIGKILL to the sshd processes
        above it, never the listener): run by a command at a chosen point, it is a network drop at exactly that
        point of that command, which then goes on (nothing it says reaches the client any more)."""
        path.write_text(f"""#!/usr/bin/env bash
p=$$
while :; do
  p=$(sed 's/.*) //' /proc/$p/stat | cut -d' ' -f2)
  # up to this test's listener and no further: what is above it is the test run's, never a connection of ours
  if [ "$p" -le 1 ] || [ "$p" = {self.proc.pid} ]; then exit 0; fi
  case "$(cat /proc/$p/comm 2>/dev/null)" in sshd*) kill -9 "$p" ;; esac
done
""")
        path.chmod(0o755)
        return path

    def restart(self):
        self.stop()
        self.start()


def _kill(pids):
    for pid in pids:
        try:
            os.kill(pid, 9)
        except ProcessLookupError:
            pass
