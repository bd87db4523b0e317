"""A real Slurm cluster on this machine for tests: slurmctld plus several slurmd emulating nodes.

Debian's slurm-wlm, run as root without munge (auth/none, cred/none), process tracking by /proc
(proctrack/linuxproc) and no task plugin, so it needs neither cgroups nor systemd. Every daemon gets free
ports and a temporary state directory; they are stopped by their pid (never by name).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import stat
import subprocess
import time
from pathlib import Path

from sshd import free_port

SLURMCTLD = shutil.which("slurmctld") or "/usr/sbin/slurmctld"
SLURMD = shutil.which("slurmd") or "/usr/sbin/slurmd"


def available() -> bool:
    return os.path.exists(SLURMCTLD) and os.path.exists(SLURMD) and shutil.which("sbatch") is not None and os.geteuid() == 0


class SlurmCluster:
    """`nodes` emulated nodes n1..nN, each with `cpus` CPUs and `gpus` fake GPUs (gres without devices)."""

    def __init__(self, root: Path, nodes: int = 2, cpus: int = 2, gpus: int = 2, partition: str = "debug"):
        self.root = root
        self.nodes = [f"n{i + 1}" for i in range(nodes)]
        self.cpus, self.gpus, self.partition = cpus, gpus, partition
        self.ctld_port = free_port()
        self.node_ports = {n: free_port() for n in self.nodes}
        self.conf = root / "slurm.conf"
        self.procs: dict[str, subprocess.Popen] = {}
        for d in ("state", "spool", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        self._write_config()

    @property
    def env(self) -> dict[str, str]:
        """What a client (sbatch, squeue, ...) needs to talk to this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _write_config(self):
        r = self.root
        host = socket.gethostname().split(".")[0]
        node_lines = "\n".join(
            f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={self.node_ports[n]} CPUs={self.cpus} "
            f"RealMemory=1000" + (f" Gres=gpu:{self.gpus}" if self.gpus else "") + " State=UNKNOWN"
            for n in self.nodes
        )
        self.conf.write_text(f"""# kimi-eagle test cluster (generated)
ClusterName=kimitest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={self.ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
LaunchParameters=use_interactive_step
PropagateResourceLimits=NONE
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
SchedulerType=sched/builtin
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MailProg=/bin/true
GresTypes=gpu
KillWait=3
MinJobAge=600
InactiveLimit=0
SlurmctldTimeout=30
SlurmdTimeout=30
MessageTimeout=10
{node_lines}
PartitionName={self.partition} Nodes={",".join(self.nodes)} Default=YES MaxTime=INFINITE State=UP
""")
        # Fake GPUs: slurm 22.05 counts a gpu gres only with a character device per GPU, so each is a copy of
        # /dev/null (mknod, we are root). NodeName= in gres.conf would be matched against the machine's hostname,
        # not the emulated node's name, so the line applies to every node.
        if self.gpus:
            (r / "dev").mkdir(exist_ok=True)
            for i in range(self.gpus):
                dev = r / "dev" / f"gpu{i}"
                if not dev.exists():
                    os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
            (r / "gres.conf").write_text(f"Name=gpu File={r}/dev/gpu[0-{self.gpus - 1}]\n")
        else:
            (r / "gres.conf").write_text("")

    def _spawn(self, name: str, argv: list[str]):
        log = open(self.root / "log" / f"{name}.out", "ab")
        env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.procs[name] = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def start(self, timeout: float = 60) -> "SlurmCluster":
        # -i: ignore state files of an earlier run; -D: foreground, so we own the pid.
        self._spawn("slurmctld", [SLURMCTLD, "-D", "-i", "-f", str(self.conf)])
        self._wait_port(self.ctld_port, "slurmctld", timeout)
        for n in self.nodes:
            (self.root / "spool" / n).mkdir(exist_ok=True)
            self._spawn(f"slurmd-{n}", [SLURMD, "-D", "-N", n, "-f", str(self.conf)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout
            states = dict(line.split() for line in out.splitlines() if line.strip())
            if len(states) == len(self.nodes) and all(s in ("idle", "mix", "alloc") for s in states.values()):
                return self
            self._check_alive()
            time.sleep(0.3)
        raise RuntimeError(f"slurm nodes never became idle: {out!r}\n{self.logs()}")

    def stop_controller(self):
        """slurmctld away (a restart, a crash): clients such as squeue fail until start_controller()."""
        p = self.procs["slurmctld"]
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(30)

    def start_controller(self, timeout: float = 60):
        """slurmctld back with its saved state (no -i): the jobs it knew go on."""
        self._spawn("slurmctld", [SLURMCTLD, "-D", "-f", str(self.conf)])
        self._wait_port(self.ctld_port, "slurmctld", timeout)

    def _wait_port(self, port: int, name: str, timeout: float):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.1)
        raise RuntimeError(f"{name} did not listen on {port}\n{self.logs()}")

    def _check_alive(self):
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise RuntimeError(f"{name} exited with {p.returncode}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted((self.root / "log").iterdir()))

    def run(self, argv: list[str], **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **self.env}, timeout=60, **kw)

    def stop(self):
        """TERM each daemon we started (by pid), KILL what remains; slurmstepd children go with their slurmd's group."""
        for name, p in reversed(list(self.procs.items())):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in self.procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(5)


if __name__ == "__main__":  # manual try-out: python tests/slurm_cluster.py DIR
    import sys

    c = SlurmCluster(Path(sys.argv[1]), nodes=3).start()
    print("SLURM_CONF=" + str(c.conf))
    print(c.run(["sinfo"]).stdout)
    try:
        input("enter to stop ")
    finally:
        c.stop()
