"""A loopback SSH host on the GPU machine, for the runs that drive the product through its CLI as a user would
(gpu_e2e.py, kimi_stage.py): the controller's wheels and an OpenSSH sshd from the carried .whl/ and .debs/ (the
machine has no network and no sshd), a real sshd on 127.0.0.1 (tests/sshd.py) with an empty known_hosts (the runs
check that an unknown key is refused, then `hosts trust` it), and the inventory entry that reaches it.

    site = controller_site(py, work / "ctl-site")     # None: `py` has the controller's dependencies already
    openssh_on_path(work)                             # sshd/ssh/ssh-keygen/scp on PATH
    sshd, known = start_sshd(work)
    inventory = "hosts:\\n" + host_entry("h200", sshd, known, python=py, workdir=work / "host", env={...}) + ...
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPENSSH_TOOLS = ("usr/sbin/sshd", "usr/bin/ssh", "usr/bin/ssh-keygen", "usr/bin/scp")


def controller_site(py: str, site: Path) -> Path | None:
    """The controller's dependencies for the interpreter `py`: None when it imports them already, else the carried
    .whl/*.whl unpacked into `site` (once; nothing comes from a registry). Put the result on PYTHONPATH."""
    if subprocess.run([py, "-c", "import fabric, pydantic, typer"], capture_output=True).returncode == 0:
        return None
    if not (site / "fabric").exists():
        wheels = sorted((ROOT / ".whl").glob("*.whl"))
        if not wheels:
            raise SystemExit("no .whl/*.whl in the checkout: run bench/gpu/fetch_gpu_deps.sh and carry .whl/")
        subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--target",
                        str(site), *map(str, wheels)], check=True)
    return site


def openssh_on_path(work: Path) -> None:
    """sshd, ssh, ssh-keygen and scp on PATH: the system's, else the carried .debs/*.deb unpacked (dpkg -x) under
    work/openssh behind wrappers that set their library path; the sshd user is created when missing."""
    if not shutil.which("sshd"):
        ossh = work / "openssh"
        debs = sorted((ROOT / ".debs").glob("*.deb"))
        if not debs:
            raise SystemExit("no sshd and no .debs/*.deb in the checkout: carry .debs/")
        for deb in debs:
            subprocess.run(["dpkg", "-x", str(deb), str(ossh)], check=True)
        if subprocess.run(["id", "sshd"], capture_output=True).returncode != 0:
            subprocess.run(["useradd", "-r", "-M", "-d", "/run/sshd", "-s", "/usr/sbin/nologin", "sshd"], check=True)
        libs = f"{ossh}/usr/lib/x86_64-linux-gnu:{ossh}/lib/x86_64-linux-gnu"
        wrap = ossh / "wrap"
        wrap.mkdir(exist_ok=True)
        for tool in OPENSSH_TOOLS:
            w = wrap / Path(tool).name
            w.write_text(f'#!/bin/sh\nLD_LIBRARY_PATH={libs} exec {ossh / tool} "$@"\n')
            w.chmod(0o755)
        os.environ["PATH"] = f"{wrap}:{os.environ['PATH']}"
    os.environ["PATH"] += ":/usr/local/nvidia/bin"


def start_sshd(work: Path):
    """A started tests/sshd.py Sshd under work/sshd and an empty known_hosts file: (sshd, known_hosts)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from sshd import Sshd  # after openssh_on_path(): it looks sshd up on PATH when imported

    sshd = Sshd(work / "sshd").start()
    known = work / "known_hosts"
    known.write_text("")
    return sshd, known


def host_entry(name: str, sshd, known: Path, *, python: str, workdir: Path, env: dict) -> str:
    """The inventory's entry for the loopback host (under `hosts:`, two-space indent)."""
    return (f"  {name}:\n    address: 127.0.0.1\n    port: {sshd.port}\n    user: root\n"
            f"    identity_file: {sshd.client_key}\n    known_hosts: {known}\n    python: {python}\n"
            f"    workdir: {workdir}\n    env: {json.dumps(env)}\n")
