"""The `ssh` transport: one fabric Connection per host per CLI command, reused for every step.

Tuned for many small commands and long transfers: TCP_NODELAY and TCP keepalive on our own
socket, AES-GCM preferred, strict host keys, explicit timeouts, a liveness probe that notices a
dead peer (paramiko's own keepalive never waits for an answer), one cached SFTP session.
"""

from __future__ import annotations

import logging
import os
import socket
import threading

from ...errors import ConfigError, ConnectionFailed, ConnectionLost, HostError, HostUnreachable
from .. import hostkeys
from .base import TIMED_OUT, TIMED_OUT_NOTE, HashingReader, Stream, Transport

_GCM_FIRST = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")
# paramiko logs a failed handshake (no banner, reset) with its traceback through logging's last-resort handler,
# i.e. on the user's terminal; our one-line error says what happened.
logging.getLogger("paramiko").addHandler(logging.NullHandler())


# How long sent data may stay unacknowledged before the kernel gives up on the connection (Linux). Our SSH keepalive
# (every 15 s) keeps data in flight, and the kernel sends no TCP keepalive probe while data is unacknowledged: without
# this, a silently dropped link (VPN, Wi-Fi) is noticed only when the retransmissions run out, about 15 minutes later,
# by any command without a timeout of its own (status, hosts check, uploads). A live peer acknowledges within
# milliseconds, however busy the command is.
USER_TIMEOUT_MS = 45_000


def _tune_socket(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, val in (("TCP_KEEPIDLE", 30), ("TCP_KEEPINTVL", 10), ("TCP_KEEPCNT", 3),
                     ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), val)


def _transport_factory(sock, disabled_algorithms=None, **kw):
    import paramiko

    t = paramiko.Transport(sock, disabled_algorithms=disabled_algorithms, **kw)
    opts = t.get_security_options()
    ciphers = list(opts.ciphers)
    opts.ciphers = tuple([c for c in _GCM_FIRST if c in ciphers] + [c for c in ciphers if c not in _GCM_FIRST])
    return t


def _identity_file(h) -> str:
    """The inventory's key file, which must exist: a missing one is the inventory's mistake (exit 2), not an
    unreachable host worth retrying."""
    path = os.path.expanduser(h.identity_file)
    if not os.path.isfile(path):
        raise ConfigError(f"{h.name}: identity_file {h.identity_file}: no such file (fix the inventory's "
                          f"`identity_file:`)")
    return path


# What OpenSSH's client prints when the network, not the login, failed (it exits 255 for both).
_OPENSSH_CONNECTION_WORDS = ("Connection refused", "Connection timed out", "Connection reset", "Connection closed",
                             "Broken pipe", "No route to host", "Network is unreachable", "Could not resolve",
                             "connection lost", "Timeout, server", "kex_exchange_identification")


def _handshake_failure(h, conn, e: BaseException) -> str:
    """What a failed SSH handshake means and what to do. Without the server's banner paramiko says "Error reading
    SSH protocol banner", or, when it went on to log in, "No existing session": neither says what to do."""
    t = conn.client.get_transport()
    if t is None or not t.remote_version:
        return (f"{h.name}: SSH banner not received from {conn.host}:{conn.port} within {h.connect_timeout:g}s — check "
                f"that sshd listens there; a slow host: raise `connect_timeout:` in the inventory")
    return f"{h.name}: SSH connection to {conn.host}:{conn.port} failed: {e}"


def _lost(name: str, what: str) -> ConnectionLost:
    return ConnectionLost(f"{name}: connection lost {what}")


class SSHTransport(Transport):
    def __init__(self, host):
        super().__init__(host)
        self._conn = None
        self._sftp = None
        self._lock = threading.Lock()

    # -- connection -------------------------------------------------------
    @property
    def conn(self):
        with self._lock:
            if self._conn is None:
                self._conn = self._connect()
            elif not self._conn.is_connected:
                # No silent reconnect: callers that can resume (log following) do it knowingly.
                raise ConnectionError(f"{self.name}: connection lost")
            return self._conn

    def _connect(self):
        from fabric import Config, Connection
        import paramiko

        h = self.host
        connect_kwargs = {
            "banner_timeout": h.connect_timeout,
            "auth_timeout": h.connect_timeout,
            "channel_timeout": max(30.0, h.connect_timeout),
            "transport_factory": _transport_factory,
        }
        if h.identity_file:
            connect_kwargs["key_filename"] = [_identity_file(h)]
        conn = Connection(
            h.address, user=h.user, port=h.port, connect_timeout=h.connect_timeout,
            connect_kwargs=connect_kwargs, forward_agent=False, config=Config(),
        )
        # Fabric builds ProxyJump hops as Connections of its own, which auto-add unknown keys: verify them too.
        hop = conn
        while hop is not None and not isinstance(hop, str):
            hostkeys.load_into(hop.client, h.known_hosts)
            hop = hop.gateway
        if not conn.gateway:
            # Our own socket: NODELAY turns a 43 ms channel open into 0.3 ms.
            try:
                sock = socket.create_connection((conn.host, conn.port), timeout=h.connect_timeout)
            except OSError as e:
                raise HostUnreachable(f"{h.name}: cannot reach {conn.host}:{conn.port}: {e.strerror or e}") from None
            _tune_socket(sock)
            conn.connect_kwargs["sock"] = sock
        try:
            conn.open()
        except (hostkeys.UnknownHostKey, hostkeys.RevokedHostKey) as e:
            through = hostkeys.known_host_name(conn.host, conn.port) if conn.gateway else None
            raise e.for_host(h.name, through=through, known_hosts=h.known_hosts) from None
        except paramiko.BadHostKeyException as e:
            # paramiko names the bare host; known_hosts (and ssh-keygen -R) name `[host]:port` off port 22.
            known_name = hostkeys.known_host_name(conn.host, conn.port) if e.hostname == conn.host else e.hostname
            raise hostkeys.changed_key_error(h.name, known_name, e.key, e.expected_key,
                                             hostkeys.trusted_files(h.known_hosts)) from None
        except paramiko.AuthenticationException as e:
            raise HostError(f"{h.name}: authentication failed for {conn.user}@{conn.host}:{conn.port}: {e}") from None
        except (paramiko.SSHException, OSError, EOFError) as e:
            raise HostUnreachable(_handshake_failure(h, conn, e)) from None
        conn.transport.set_keepalive(15)
        # Through ProxyJump the first hop's socket is fabric's: the same dead-link bound on it.
        hop = conn.gateway
        while hop is not None and not isinstance(hop, str):
            if hop.transport is not None and isinstance(hop.transport.sock, socket.socket):
                _tune_socket(hop.transport.sock)
            hop = hop.gateway
        return conn

    @property
    def sftp(self):
        conn = self.conn
        if self._sftp is None or self._sftp.sock.closed:
            self._sftp = conn.client.open_sftp()
        return self._sftp

    def alive(self, timeout: float = 10.0) -> bool:
        """A keepalive that waits for the answer: False when the peer is gone."""
        t = self._conn.transport if self._conn and self._conn.is_connected else None
        if t is None or not t.is_active():
            return False
        done = threading.Event()
        threading.Thread(target=lambda: (t.global_request("keepalive@openssh.com", wait=True), done.set()), daemon=True).start()
        if not done.wait(timeout):
            self.close()
            return False
        return t.is_active()

    def close(self):
        if self._sftp is not None:
            try:
                self._sftp.close()
            except Exception:
                pass
            self._sftp = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    # -- commands ---------------------------------------------------------
    def _open_channel(self, command: str):
        import paramiko

        t = self.conn.transport
        try:
            chan = t.open_session(timeout=max(30.0, self.host.connect_timeout))
            chan.exec_command(command)
        except (EOFError, OSError, paramiko.SSHException) as e:
            if t.is_active():
                raise
            raise _lost(self.name, f"before a command could start ({type(e).__name__}: {e})") from None
        return chan

    def _exec(self, command, stdin, timeout):
        import time

        chan = self._open_channel(command)
        if stdin:
            chan.sendall(stdin)
        chan.shutdown_write()
        # Read stdout and stderr concurrently: a full window on either would deadlock the other.
        out, err = bytearray(), bytearray()
        deadline = None if timeout is None else time.monotonic() + timeout
        chan.settimeout(0.2)
        while True:
            progressed = False
            while chan.recv_ready():
                out += chan.recv(65536)
                progressed = True
            while chan.recv_stderr_ready():
                err += chan.recv_stderr(65536)
                progressed = True
            if chan.exit_status_ready() and not chan.recv_ready() and not chan.recv_stderr_ready():
                break
            if chan.closed or not self.conn.transport.is_active():
                break
            if deadline and time.monotonic() > deadline:
                chan.close()
                return TIMED_OUT, bytes(out), bytes(err) + TIMED_OUT_NOTE
            if not progressed:
                try:
                    data = chan.recv(65536)
                    if data:
                        out += data
                except socket.timeout:
                    pass
        if not chan.exit_status_ready() or self._cut_off(chan):
            chan.close()
            raise _lost(self.name, "while running a command")
        code = chan.recv_exit_status()
        chan.close()
        return code, bytes(out), bytes(err)

    def _cut_off(self, chan) -> bool:
        """A channel that ended without an exit status because the connection died (paramiko then reports -1,
        as for a command killed by a signal, but the transport is gone)."""
        return chan.exit_status == -1 and not (self._conn and self._conn.transport and self._conn.transport.is_active())

    def stream(self, command: str) -> Stream:
        chan = self._open_channel(command)
        chan.shutdown_write()
        chan.settimeout(1.0)
        state = {"idle": 0.0}

        def chunks():
            while True:
                try:
                    data = chan.recv(65536)
                except socket.timeout:
                    # Quiet log: make sure the peer is still there before waiting on.
                    state["idle"] += 1.0
                    if state["idle"] >= 15.0:
                        state["idle"] = 0.0
                        if not self.alive():
                            raise ConnectionError(f"{self.name}: connection lost")
                    continue
                except OSError as e:
                    raise ConnectionError(f"{self.name}: connection lost: {e}") from None
                state["idle"] = 0.0
                if not data:
                    # A command that ended normally sends its exit status around its EOF.
                    if not chan.status_event.wait(5.0) or self._cut_off(chan):
                        raise _lost(self.name, "while reading a command's output")
                    return
                yield data

        def exit_status():
            return chan.recv_exit_status() if chan.exit_status_ready() else None

        return Stream(chunks(), chan.close, exit_status)

    # -- files ------------------------------------------------------------
    def _home_dir(self):
        return self.sftp.normalize(".")

    def write_bytes(self, path, data, mode=None):
        path = self.abspath(path)
        with self.sftp.open(path, "wb") as f:
            f.set_pipelined(True)
            f.write(data)
        if mode is not None:
            self.sftp.chmod(path, mode)

    def upload_fileobj(self, fileobj, path, mode=None):
        path = self.abspath(path)
        # putfo() pipelines its writes; confirm=False because the caller verifies the sha256.
        self.sftp.putfo(fileobj, path, confirm=False)
        if mode is not None:
            self.sftp.chmod(path, mode)

    # Files this large go through the OpenSSH client when it is installed: paramiko's pure-Python
    # packet path tops out near 1/2 of OpenSSH's with AES-GCM (docs/benchmarks.md).
    OPENSSH_MIN_BYTES = 32 << 20

    def upload_hashed(self, local_path, path, mode, progress=None):
        import shutil

        if (os.path.getsize(local_path) < self.OPENSSH_MIN_BYTES or not shutil.which("ssh")
                or os.environ.get("KIMI_EAGLE_OPENSSH", "1") == "0"):
            return super().upload_hashed(local_path, path, mode, progress)
        return self._openssh_receive(local_path, self.abspath(path), mode, progress)

    def openssh_argv(self) -> list[str]:
        """An OpenSSH command line with the same trust (known_hosts files) and identity as ours."""
        h = self.host
        known = [str(hostkeys.system_known_hosts())] + ([os.path.expanduser(h.known_hosts)] if h.known_hosts else [])
        argv = ["ssh", "-T", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                "-o", "UserKnownHostsFile=" + " ".join(f'"{k}"' for k in known),
                "-o", f"ConnectTimeout={int(h.connect_timeout)}", "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3",
                "-c", "aes128-gcm@openssh.com,aes256-gcm@openssh.com,chacha20-poly1305@openssh.com,aes128-ctr"]
        if h.port:
            argv += ["-p", str(h.port)]
        if h.user:
            argv += ["-l", h.user]
        if h.identity_file:
            argv += ["-i", os.path.expanduser(h.identity_file), "-o", "IdentitiesOnly=yes"]
        # `--` ends the options: whatever the address is, ssh reads it as the destination, never as an option.
        return argv + ["--", h.address]

    def _openssh_receive(self, local_path, path, mode, progress):
        import subprocess

        from ...shell import join
        from ...templating import sh_path
        from ..sync import RECEIVE_CODE

        remote = f"exec {sh_path(self.host.python)} -c {join([RECEIVE_CODE, path, format(mode, 'o')])}"
        proc = subprocess.Popen(self.openssh_argv() + [remote], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE)
        with open(local_path, "rb") as f:
            reader = HashingReader(f, progress)
            try:
                while chunk := reader.read(1 << 20):
                    proc.stdin.write(chunk)
                proc.stdin.close()
            except BrokenPipeError:
                pass
        out, err = proc.stdout.read(), proc.stderr.read()  # both tiny: a digest, maybe a warning
        proc.wait()
        if proc.returncode != 0:
            said = err.decode(errors="replace").strip()
            last = (said.splitlines() or [""])[-1]
            network = proc.returncode == 255 and any(w in said for w in _OPENSSH_CONNECTION_WORDS)
            raise (ConnectionFailed if network else HostError)(
                f"{self.name}: upload through OpenSSH failed (exit {proc.returncode}): {last}")
        return reader.hexdigest(), out.decode().strip()

    def rename(self, src, dst):
        self.sftp.posix_rename(self.abspath(src), self.abspath(dst))

    def read_bytes(self, path, offset=0):
        with self.sftp.open(self.abspath(path), "rb") as f:
            f.seek(offset)
            size = f.stat().st_size
            f.prefetch(max(0, size - offset))
            return f.read()

    def exists(self, path):
        try:
            self.sftp.stat(self.abspath(path))
            return True
        except FileNotFoundError:
            return False
        except IOError as e:
            if getattr(e, "errno", None) == 2:
                return False
            raise

    def makedirs(self, path):
        from ...shell import join

        self.run(join(["mkdir", "-p", "--", self.abspath(path)]), check=True, what=f"mkdir {path}")
