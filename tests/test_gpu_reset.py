"""kimi_eagle_host/ops/gpu_reset.py with real fuser and real signals, no GPU.

Ordinary temp files stand in for /dev/nvidia*: spawned processes hold them open, so
fuser reports them exactly as it reports GPU holders. A bash `nvidia-smi` stand-in is
used only to exercise the memory-verification logic.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import host_cmd
from kimi_eagle_host.ops.jobs import start_ticks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = host_cmd("ops.gpu_reset")

pytestmark = pytest.mark.skipif(shutil.which("fuser") is None, reason="fuser (psmisc) not installed")

HOLDER = textwrap.dedent("""
    import signal, sys, time
    if sys.argv[2] == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    f = open(sys.argv[1])
    print("ready", flush=True)
    while True:
        time.sleep(1)
""")


class Holders:
    """Spawns holder processes and always cleans them up (by their own pid)."""

    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: list[subprocess.Popen] = []
        self.extra_pids: list[int] = []  # processes that are not our children (a vfork child)
        self.runs = tmp / "runs"
        self.runs.mkdir()

    def spawn(self, device: Path, *, ours: bool = False, own_session: bool = False,
              ignore_term: bool = False, env_job: str | None = None) -> subprocess.Popen:
        env = dict(os.environ)
        env.pop("KIMI_EAGLE_JOB_ID", None)
        if env_job:
            env["KIMI_EAGLE_JOB_ID"] = env_job
        p = subprocess.Popen([sys.executable, "-c", HOLDER, str(device),
                              "ignore-term" if ignore_term else "plain"],
                             stdout=subprocess.PIPE, text=True, env=env,
                             start_new_session=ours or own_session)
        assert p.stdout.readline().strip() == "ready"
        self.procs.append(p)
        if ours:
            job = self.runs / f"job-{p.pid}"
            job.mkdir()
            (job / "pgid").write_text(f"{os.getpgid(p.pid)}\n")
            (job / "pid").write_text(f"{p.pid}\n")
            # as ops/jobs.py records a job: its shell's start tells it from a later process given its number
            (job / "meta.json").write_text(json.dumps({"job_id": f"job-{p.pid}", "start_ticks": start_ticks(p.pid)}))
        return p

    def cleanup(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=10)
        for pid in self.extra_pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.fixture
def holders(tmp_path):
    h = Holders(tmp_path)
    yield h
    h.cleanup()


def device(tmp: Path, name: str = "nvidia0") -> Path:
    d = tmp / "dev"
    d.mkdir(exist_ok=True)
    f = d / name
    f.touch()
    return f


def run_reset(tmp: Path, *args: str, smi: str | None = None) -> tuple[int, dict, str]:
    # Plain files stand in for the device nodes: through the host's env, which is trusted as given (a
    # --device-path must be a GPU's character device).
    cmd = [*SCRIPT, "--runs-dir", str(tmp / "runs"), "--nvidia-smi", smi or str(tmp / "no-nvidia-smi"), *args]
    env = {**os.environ, "KIMI_EAGLE_GPU_DEVICES": str(tmp / "dev" / "nvidia*")}
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    return res.returncode, json.loads(res.stdout), res.stderr


def import_script():
    from kimi_eagle_host.ops import gpu_reset

    return gpu_reset


def by_pid(report: dict) -> dict[int, dict]:
    return {h["pid"]: h for h in report["holders"]}


def alive(p: subprocess.Popen) -> bool:
    return p.poll() is None


def test_sigterm_ignorer_is_escalated_to_sigkill(tmp_path, holders):
    dev = device(tmp_path)
    stubborn = holders.spawn(dev, ours=True, ignore_term=True)
    polite = holders.spawn(dev, ours=True)
    rc, rep, err = run_reset(tmp_path, "--grace", "1.5", "--timeout", "10")
    assert rc == 0, (rep, err)
    h = by_pid(rep)
    assert h[stubborn.pid]["owner"] == "ours" and h[stubborn.pid]["job_id"] == f"job-{stubborn.pid}"
    assert h[stubborn.pid]["result"] == "killed-after-term"
    assert h[stubborn.pid]["signal_sent"] == "SIGTERM,SIGKILL"
    assert h[polite.pid]["result"] == "gone" and h[polite.pid]["signal_sent"] == "SIGTERM"
    assert stubborn.wait(timeout=5) == -signal.SIGKILL
    assert polite.wait(timeout=5) == -signal.SIGTERM
    # SIGKILL comes right after the grace, not after the whole --timeout of 10 s (a bound a busy box cannot break).
    assert 1.4 <= rep["elapsed_s"] < 10, rep["elapsed_s"]
    assert rep["ok"] is True and rep["gpus"] == []


def test_foreign_survives_default_and_dies_with_all(tmp_path, holders):
    dev = device(tmp_path)
    ours = holders.spawn(dev, ours=True)
    foreign = holders.spawn(dev, own_session=True)  # its own group, not recorded in runs/
    rc, rep, _ = run_reset(tmp_path, "--grace", "2")
    assert rc == 0
    h = by_pid(rep)
    assert h[ours.pid]["owner"] == "ours" and h[ours.pid]["action"] == "stop"
    assert h[foreign.pid]["owner"] == "foreign" and h[foreign.pid]["action"] == "keep"
    assert h[foreign.pid]["result"] == "still-running" and h[foreign.pid]["signal_sent"] is None
    assert rep["remaining_foreign"] == [foreign.pid]
    assert ours.wait(timeout=5) == -signal.SIGTERM
    time.sleep(0.3)
    assert alive(foreign)

    rc, rep, _ = run_reset(tmp_path, "--all", "--grace", "2")
    assert rc == 0, rep
    h = by_pid(rep)
    assert list(h) == [foreign.pid]
    assert h[foreign.pid]["owner"] == "foreign" and h[foreign.pid]["result"] == "gone"
    assert foreign.wait(timeout=5) == -signal.SIGTERM


def test_env_marker_makes_a_process_ours(tmp_path, holders):
    dev = device(tmp_path)
    tagged = holders.spawn(dev, own_session=True, env_job="job-env-7")
    rc, rep, _ = run_reset(tmp_path, "--grace", "2")
    assert rc == 0
    assert by_pid(rep)[tagged.pid]["owner"] == "ours"
    assert by_pid(rep)[tagged.pid]["job_id"] == "job-env-7"
    assert tagged.wait(timeout=5) == -signal.SIGTERM


def test_dry_run_kills_nothing(tmp_path, holders):
    dev = device(tmp_path)
    ours = holders.spawn(dev, ours=True, ignore_term=True)
    foreign = holders.spawn(dev)
    for extra in ([], ["--all"]):
        rc, rep, _ = run_reset(tmp_path, "--dry-run", "--grace", "0", *extra)
        assert rc == 0 and rep["mode"] == "dry-run"
        h = by_pid(rep)
        assert {x["action"] for x in h.values()} == {"none"}
        assert all(x["signal_sent"] is None for x in h.values())
        assert h[ours.pid]["planned"] == "stop"
        assert h[foreign.pid]["planned"] == ("stop" if extra else "keep")
    time.sleep(0.3)
    assert alive(ours) and alive(foreign)


def test_only_pids_guard(tmp_path, holders):
    dev = device(tmp_path)
    a = holders.spawn(dev)
    b = holders.spawn(dev)
    rc, rep, _ = run_reset(tmp_path, "--all", "--only-pids", str(a.pid), "--grace", "2")
    assert rc == 0
    assert a.wait(timeout=5) == -signal.SIGTERM
    assert alive(b) and by_pid(rep)[b.pid]["signal_sent"] is None


def test_only_pids_with_a_start_time_spares_a_later_process_of_that_pid(tmp_path, holders):
    """gpu-reset --all signals the pids a person confirmed: one whose start time is not the confirmed one is another
    process that got the number since, and is neither signalled nor silently skipped."""
    dev = device(tmp_path)
    a = holders.spawn(dev)
    b = holders.spawn(dev)
    rc, rep, _ = run_reset(tmp_path, "--dry-run", "--all")
    shown = by_pid(rep)
    assert shown[a.pid]["start_ticks"] == start_ticks(a.pid) and shown[b.pid]["start_ticks"] == start_ticks(b.pid)
    wrong = shown[b.pid]["start_ticks"] + 1  # b stands for the process that took the number of the one confirmed
    rc, rep, err = run_reset(tmp_path, "--all", "--only-pids", f"{a.pid}:{shown[a.pid]['start_ticks']},{b.pid}:{wrong}",
                             "--grace", "2")
    assert rc == 0, (rep, err)
    assert a.wait(timeout=5) == -signal.SIGTERM
    time.sleep(0.3)
    assert alive(b) and by_pid(rep)[b.pid]["signal_sent"] is None and by_pid(rep)[b.pid]["action"] == "keep"
    assert rep["warnings"] == [f"pid {b.pid} not signalled: it started at tick {wrong - 1}, not {wrong} as when it "
                               "was shown (another process has that number now)"]


def test_only_pids_that_is_no_list_of_pids_is_refused(tmp_path, holders):
    holder = holders.spawn(device(tmp_path))
    rc = subprocess.run([*SCRIPT, "--all", "--only-pids", f"{holder.pid}:soon", "--nvidia-smi", str(tmp_path / "x")],
                        capture_output=True, text=True, timeout=60)
    assert rc.returncode == 2 and rc.stdout == "" and "--only-pids: not a comma list of PID or PID:START" in rc.stderr
    assert alive(holder)


def test_host_without_gpu(tmp_path):
    # No nvidia-smi, and the device glob matches nothing.
    rc, rep, _ = run_reset(tmp_path)
    assert rc == 0 and rep["ok"] is True
    assert "no NVIDIA driver" in rep["note"] and rep["holders"] == []
    rc, rep, _ = run_reset(tmp_path, "--require-gpu")
    assert rc == 1 and rep["ok"] is False and "no NVIDIA driver" in rep["note"]


def test_host_with_gpu_files_but_neither_fuser_nor_nvidia_smi_fails_clearly(tmp_path, holders):
    """It cannot tell who holds the GPU: not "nothing held" (exit 0), on which `run --reset-gpus` would go ahead."""
    holder = holders.spawn(device(tmp_path), ours=True)
    for extra in ([], ["--require-gpu"]):
        rc, rep, _ = run_reset(tmp_path, "--fuser", str(tmp_path / "no-fuser"), *extra)
        assert rc == 1 and rep["ok"] is False
        assert "fuser not found" in rep["note"] and "no nvidia-smi: cannot tell which processes hold" in rep["note"]
        assert rep["problems"] == [rep["note"]]
    assert alive(holder)


# --- memory verification, with a bash stand-in for nvidia-smi --------------------

FAKE_SMI = r"""#!/usr/bin/env bash
# Stand-in for nvidia-smi. $STATE/apps: lines "pid,mem_mib,gpu_uuid". A pid's memory is
# listed while it lives (zombies count as dead) and stays in memory.used for $STATE/release_s
# seconds after death, like a driver that frees late. $STATE/leak_mib: memory no process owns.
STATE="$(dirname "$0")"
now=$(date +%s.%N)
release=$(cat "$STATE/release_s" 2>/dev/null || echo 0)
used=$(cat "$STATE/leak_mib" 2>/dev/null || echo 0)
listing=""
while IFS=, read -r pid mem uuid; do
  [ -z "$pid" ] && continue
  state=""
  [ -r "/proc/$pid/stat" ] && state=$(sed 's/.*) //' "/proc/$pid/stat" | cut -d' ' -f1)
  if [ -n "$state" ] && [ "$state" != Z ]; then
    listing+="$pid, $mem, $uuid"$'\n'
    used=$((used + mem))
  else
    [ -f "$STATE/dead_$pid" ] || echo "$now" > "$STATE/dead_$pid"
    died=$(cat "$STATE/dead_$pid")
    if awk -v n="$now" -v d="$died" -v r="$release" 'BEGIN{exit !(n - d < r)}'; then
      used=$((used + mem))
    fi
  fi
done < "$STATE/apps"
case "$*" in
  *--query-gpu=*) echo "0, GPU-fake-0, NVIDIA H200, $used, 143771" ;;
  *--query-compute-apps=*) printf "%s" "$listing" ;;
  *) echo "fake nvidia-smi" ;;
esac
"""


def fake_smi(tmp: Path, apps: list[tuple[int, int]], release_s: float = 0, leak_mib: int = 0) -> str:
    d = tmp / "smi"
    d.mkdir(exist_ok=True)
    exe = d / "nvidia-smi"
    exe.write_text(FAKE_SMI)
    exe.chmod(0o755)
    (d / "apps").write_text("".join(f"{pid},{mem},GPU-fake-0\n" for pid, mem in apps))
    (d / "release_s").write_text(str(release_s))
    (d / "leak_mib").write_text(str(leak_mib))
    return str(exe)


def test_memory_verified_after_late_release(tmp_path, holders):
    dev = device(tmp_path)
    ours = holders.spawn(dev, ours=True)
    foreign = holders.spawn(dev)
    smi = fake_smi(tmp_path, [(ours.pid, 80000), (foreign.pid, 4000)], release_s=1.5, leak_mib=3)
    rc, rep, err = run_reset(tmp_path, "--grace", "2", "--timeout", "10", smi=smi)
    assert rc == 0, (rep, err)
    gpu = rep["gpus"][0]
    assert gpu["mem_used_before"] == 84003 and gpu["mem_total"] == 143771
    # The foreign process keeps its 4000 MiB; the 3 MiB nobody owns is the baseline.
    assert gpu["mem_used_after"] == 4003 and gpu["baseline_mib"] == 3
    assert gpu["held_by"] == [{"pid": foreign.pid, "mem_mib": 4000.0, "owner": "foreign"}]
    h = by_pid(rep)
    assert h[ours.pid]["mem_mib"] == 80000 and h[ours.pid]["gpu"] == [0]
    assert h[ours.pid]["sources"] == ["fuser", "nvidia-smi"]
    # Verified only once the late-freed memory was gone, not when the pid died.
    assert rep["elapsed_s"] >= 1.4 and rep["elapsed_s"] > rep["t_processes_gone_s"]
    assert alive(foreign)


def test_without_fuser_nvidia_smi_alone_finds_and_stops_the_holders(tmp_path, holders):
    """A container without psmisc: the holders nvidia-smi lists are stopped and verified, not "nothing done"."""
    ours = holders.spawn(device(tmp_path), ours=True)
    foreign = holders.spawn(device(tmp_path))
    smi = fake_smi(tmp_path, [(ours.pid, 30000), (foreign.pid, 2000)])
    rc, rep, err = run_reset(tmp_path, "--fuser", str(tmp_path / "no-fuser"), "--grace", "2", "--timeout", "10", smi=smi)
    assert rc == 0 and rep["ok"] is True, (rep, err)
    assert rep["note"] == "fuser not found (install psmisc: apt-get install psmisc): holders from nvidia-smi only"
    h = by_pid(rep)
    assert h[ours.pid]["sources"] == ["nvidia-smi"] and h[ours.pid]["owner"] == "ours" and h[ours.pid]["result"] == "gone"
    assert ours.wait(timeout=5) == -signal.SIGTERM and alive(foreign)
    assert rep["gpus"][0]["mem_used_after"] == 2000 and rep["gpus"][0]["free"] is True


def test_memory_still_held_exits_1_naming_it(tmp_path, holders):
    dev = device(tmp_path)
    ours = holders.spawn(dev, ours=True)
    # The memory is never released after the holder dies.
    smi = fake_smi(tmp_path, [(ours.pid, 20000)], release_s=3600)
    rc, rep, err = run_reset(tmp_path, "--grace", "1", "--timeout", "1.5", smi=smi)
    assert rc == 1 and rep["ok"] is False
    assert by_pid(rep)[ours.pid]["result"] == "gone"
    assert any("GPU 0" in p and "20000 MiB not accounted for" in p for p in rep["problems"]), rep["problems"]
    assert rep["gpus"][0]["free"] is False


def test_invisible_pid_is_reported(tmp_path, holders):
    device(tmp_path)
    ghost = 4_000_000  # a pid no process here has (checked below)
    assert not Path(f"/proc/{ghost}").exists()
    smi = fake_smi(tmp_path, [], leak_mib=0)
    # The stand-in lists a pid that is not in our namespace.
    exe = Path(smi)
    exe.write_text(exe.read_text().replace(
        '*--query-compute-apps=*) printf "%s" "$listing" ;;',
        f'*--query-compute-apps=*) printf "%s" "$listing"; echo "{ghost}, 7000, GPU-fake-0" ;;'))
    rc, rep, _ = run_reset(tmp_path, "--grace", "1", "--timeout", "1", smi=smi)
    h = by_pid(rep)[ghost]
    assert h["owner"] == "invisible" and h["result"] == "not-visible" and h["action"] == "none"
    assert h["mem_mib"] == 7000
    assert rc == 0  # nothing targeted, and an invisible holder is not ours to fix by default
    rc, rep, _ = run_reset(tmp_path, "--all", "--grace", "1", "--timeout", "1", smi=smi)
    assert rc == 1 and any("not in this PID namespace" in p for p in rep["problems"])


def test_importable_main(tmp_path, capsys):
    from kimi_eagle_host.ops import gpu_reset

    rc = gpu_reset.main(["--device-path", str(tmp_path / "none*"), "--nvidia-smi", str(tmp_path / "x")])
    assert rc == 0 and "no NVIDIA driver" in json.loads(capsys.readouterr().out)["note"]


@pytest.mark.parametrize("path", ["/dev/null", "/dev/zero", "/dev/tty", "{tmp}/dev/nvidia0", "{tmp}/dev/nvidia*"])
def test_a_device_path_that_is_no_gpu_node_is_refused(tmp_path, holders, path):
    """fuser on /dev/null lists every process of the machine: a --device-path must be a GPU's character device."""
    dev = device(tmp_path)
    holder = holders.spawn(dev)
    res = subprocess.run([*SCRIPT, "--device-path", path.format(tmp=tmp_path), "--dry-run",
                          "--nvidia-smi", str(tmp_path / "no-nvidia-smi")], capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and res.stdout == "", (res.stdout, res.stderr)
    (line,) = res.stderr.strip().splitlines()
    assert "is not a GPU device node" in line and path.format(tmp=tmp_path).rstrip("*") in line, line
    assert alive(holder)


def test_gpu_majors_include_the_dynamic_nvidia_ones(tmp_path):
    gpu_reset = import_script()
    devices = tmp_path / "devices"
    devices.write_text("Character devices:\n  1 mem\n195 nvidia-frontend\n226 drm\n508 nvidia-uvm\n"
                       "509 nvidia-caps\n\nBlock devices:\n510 nvidia-not-a-char-device\n")
    assert gpu_reset.gpu_majors(str(devices)) == {195, 226, 508, 509}
    # /dev/null (major 1) is none of them, on this machine too.
    assert gpu_reset.not_gpu_nodes(["/dev/null"]) == ["/dev/null"]


# A real process in D state without root: a vfork parent waits uninterruptibly (state D) until its child execs or
# exits, and this child stops itself first.
D_STATE_HOLDER = textwrap.dedent("""
    import ctypes, os, signal, sys
    f = open(sys.argv[1])
    print("ready", flush=True)
    if ctypes.CDLL(None).vfork() == 0:
        os.kill(os.getpid(), signal.SIGSTOP)
        os._exit(0)
""")


def d_state_holder(holders: Holders, dev: Path) -> subprocess.Popen:
    p = subprocess.Popen([sys.executable, "-c", D_STATE_HOLDER, str(dev)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    holders.procs.append(p)
    assert p.stdout.readline().strip() == "ready"
    deadline = time.monotonic() + 10
    while Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "D":
        assert time.monotonic() < deadline, "the vfork parent never reached D state"
        time.sleep(0.05)
    # The stopped child, killed at cleanup by its own pid (it holds the device too).
    child = int(Path(f"/proc/{p.pid}/task/{p.pid}/children").read_text().split()[0])
    holders.extra_pids.append(child)
    return p


def test_a_holder_in_d_state_fails_neither_a_dry_run_nor_a_reset_that_leaves_it(tmp_path, holders):
    """A dry run reports and a foreign holder the reset never touches is not its failure: a D-state process is
    said (as a warning where it would be stopped), not a problem."""
    dev = device(tmp_path)
    stuck = d_state_holder(holders, dev)
    ours = holders.spawn(dev, ours=True)
    for extra in ([], ["--all"]):
        rc, rep, err = run_reset(tmp_path, "--dry-run", *extra)
        assert rc == 0 and rep["ok"] is True and rep["problems"] == [], (rep["problems"], err)
        assert by_pid(rep)[stuck.pid]["state"] == "D" and stuck.pid in rep["d_state"]
        said = [w for w in rep["warnings"] if f"pid {stuck.pid} is in D state" in w]
        assert len(said) == (1 if extra else 0), rep["warnings"]
    rc, rep, err = run_reset(tmp_path, "--grace", "1", "--timeout", "5")
    assert rc == 0 and rep["ok"] is True, (rep["problems"], err)
    assert ours.wait(timeout=5) == -signal.SIGTERM and alive(stuck)


def test_pgid_from_an_earlier_boot_is_not_ours(tmp_path, holders):
    dev = device(tmp_path)
    p = holders.spawn(dev, ours=True)
    meta = tmp_path / "runs" / f"job-{p.pid}" / "meta.json"
    meta.write_text(json.dumps({"job_id": f"job-{p.pid}", "boot_id": "some-earlier-boot"}))
    rc, rep, _ = run_reset(tmp_path, "--grace", "1")
    assert rc == 0 and by_pid(rep)[p.pid]["owner"] == "foreign"
    assert alive(p)
