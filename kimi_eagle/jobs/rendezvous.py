"""Before a multi-node torchrun: can every host reach the c10d rendezvous on the group's first host?

The first host briefly listens on the rendezvous address and port (as torchrun's store will); every other
host connects to it. A port already in use, an address that is not the first host's, or a host that cannot
connect refuses the start, naming the host. Both helpers are stdlib one-liners run by the hosts' Python.
"""

from __future__ import annotations

from .. import templating
from ..errors import KimiEagleError
from ..shell import quote
from . import layout

_LISTEN = r"""
import socket, sys, time
addr, port, expect, wait = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])
try:
    infos = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)
except OSError as e:
    print("error cannot resolve %s on this host: %s" % (addr, e), flush=True); sys.exit(0)
s = socket.socket(infos[0][0], socket.SOCK_STREAM)
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(infos[0][4])
except OSError as e:
    why = "port %d is in use" % port if e.errno == 98 else "%s is not an address of this host" % addr if e.errno == 99 else str(e)
    print("error " + why, flush=True); sys.exit(0)
s.listen(64); s.settimeout(0.2)
print("ready", flush=True)
deadline = time.monotonic() + wait
while expect > 0 and time.monotonic() < deadline:
    try:
        c, _ = s.accept(); c.close(); expect -= 1
    except socket.timeout:
        pass
print("done", flush=True)
"""

_CONNECT = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close(); print("ok")
except OSError as e:
    print("error %s" % e)
"""


class RendezvousUnreachable(KimiEagleError):
    pass


def _py(host, code: str, args: list) -> str:
    return f"{templating.sh_path(host.python)} -c {quote(code)} " + " ".join(quote(str(a)) for a in args)


def check(sessions, timeout: float = 5.0) -> None:
    """Raise RendezvousUnreachable naming every host that cannot reach sessions[0]'s rendezvous endpoint."""
    from concurrent.futures import ThreadPoolExecutor

    head = sessions[0]
    addr, port = layout.rdzv_address(head.host), layout.rdzv_port(head.host)
    endpoint = f"{addr}:{port}"
    listener = head.transport.stream(_py(head.host, _LISTEN, [addr, port, len(sessions) - 1, timeout + 10]))
    try:
        first = b""
        for chunk in listener.chunks:
            first += chunk
            if b"\n" in first:
                break
        line = first.decode(errors="replace").splitlines()[0] if first else "error listener did not start"
        if line != "ready":
            raise RendezvousUnreachable(f"{head.name}: cannot serve the rendezvous at {endpoint}: {line.removeprefix('error ')}")

        def probe(s):
            res = s.transport.run(_py(s.host, _CONNECT, [addr, port, timeout]), timeout=timeout + 30)
            out = res.stdout.strip()
            return s.name, out if out else f"error {res.stderr.strip()[-200:]}"

        with ThreadPoolExecutor(max_workers=max(1, len(sessions) - 1)) as pool:
            results = list(pool.map(probe, sessions[1:]))
        bad = [(name, out.removeprefix("error ")) for name, out in results if out != "ok"]
        if bad:
            raise RendezvousUnreachable("; ".join(f"{name}: cannot reach the rendezvous {endpoint} on {head.name}: {why}"
                                                  for name, why in bad))
    finally:
        listener.close()  # the listener also exits by itself once every host connected (or after its wait)
