#!/usr/bin/env python3
"""Free the GPUs of a host after a crashed run, host side, stdlib only.

One call does the whole reset:

1. gather the GPU holders from ``fuser`` on the NVIDIA device files and from
   ``nvidia-smi --query-compute-apps`` (either may see processes the other cannot);
2. classify each holder as ``ours`` (in the process group / session of a kimi-eagle job
   recorded under ``<runs-dir>/*/pgid``: led by the job's shell, or, once that shell is gone,
   with the job's id in its environment; or carrying ``KIMI_EAGLE_JOB_ID`` in its
   environment with a ``KIMI_EAGLE_RUN_DIR`` under this runs dir), ``other-workdir`` (a
   kimi-eagle job of another workdir on the same machine: its environment names that run
   dir), ``foreign`` or ``invisible`` (listed by nvidia-smi, absent from our PID namespace).
   Whether a holder's job is running is read from that job's own run dir, wherever it is,
   the same way ops/jobs.py reads it;
3. stop the targets (default: ours; ``--all``: every holder) with SIGTERM, then
   SIGKILL after ``--grace`` seconds;
4. verify, up to ``--timeout``, that the targets are gone and that nvidia-smi shows
   each affected GPU's memory back to its baseline.

Prints one JSON document on stdout, progress on stderr. Exit 0 when the GPUs are free
(or there was nothing to do), 1 when a targeted process or held memory remains, 2 on
bad usage. Importable: ``run_reset(...)`` returns the report, ``main(argv)`` the code.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import pwd
import re
import shutil
import signal
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from kimi_eagle_host import procfs
from kimi_eagle_host.gpus import find_nvidia_smi
from kimi_eagle_host.step_runtime import atomic_write, host_runs_dir
from kimi_eagle_host.step_runtime import log as _log
from kimi_eagle_host.ops.jobs import JOB_ID, env_job, in_job_group, job_state, own_group, same_dir

DEFAULT_DEVICE_GLOB = "/dev/nvidia*"
# A CUDA context costs a few hundred MiB; driver bookkeeping on an idle GPU a few MiB.
# Anything above 1 GiB that no live process accounts for means memory is still held.
DEFAULT_THRESHOLD_MIB = 1024
POLL_S = 0.1


def log(msg: str) -> None:
    _log(msg, "gpu_reset")


# ---------------------------------------------------------------------------
# /proc helpers
# ---------------------------------------------------------------------------

def _cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return ""
    if not raw:  # kernel threads and zombies have an empty cmdline
        try:
            return "[" + Path(f"/proc/{pid}/comm").read_text().strip() + "]"
        except OSError:
            return ""
    return raw.rstrip(b"\0").replace(b"\0", b" ").decode(errors="replace")


def _user(pid: int) -> str | None:
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        return None
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)




def _protected_pids() -> set[int]:
    """Never signal ourselves, our ancestors (the SSH session running us) or init."""
    pids = {1, os.getpid()}
    pid = os.getpid()
    for _ in range(64):
        st = procfs.stat(pid)
        if st is None:
            break
        ppid = st.ppid
        if ppid <= 1:
            break
        pids.add(ppid)
        pid = ppid
    return pids


# ---------------------------------------------------------------------------
# Holder sources
# ---------------------------------------------------------------------------

def expand_device_paths(patterns: list[str]) -> list[str]:
    paths: list[str] = []
    for pat in patterns:
        hits = sorted(glob.glob(pat)) if glob.has_magic(pat) else ([pat] if os.path.exists(pat) else [])
        for p in hits:
            # /dev/nvidia-caps is a directory: fuser would report cwd users, not GPU users.
            if not os.path.isdir(p) and p not in paths:
                paths.append(p)
    return paths


# Character-device majors of GPU nodes: NVIDIA's fixed 195 (nvidia0.., nvidiactl, nvidia-modeset) and DRM's 226
# (/dev/dri/card*, renderD*); nvidia-uvm, nvidia-caps, nvidia-nvlink and nvidia-nvswitch get a dynamic major,
# which the kernel lists in /proc/devices under their names.
FIXED_GPU_MAJORS = {195, 226}


def gpu_majors(proc_devices: str = "/proc/devices") -> set[int]:
    majors = set(FIXED_GPU_MAJORS)
    try:
        text = Path(proc_devices).read_text()
    except OSError:
        return majors
    for line in text.split("Block devices:")[0].splitlines():
        number, _, name = line.strip().partition(" ")
        if number.isdigit() and (name.startswith("nvidia") or name == "drm"):
            majors.add(int(number))
    return majors


def not_gpu_nodes(paths: list[str]) -> list[str]:
    """The paths that are not a GPU's character device. fuser on any other file lists whoever has it open:
    on /dev/null, every process of the machine would be taken for a GPU holder."""
    majors = gpu_majors()
    bad = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue  # gone since the glob: nothing to inspect
        if not stat.S_ISCHR(st.st_mode) or os.major(st.st_rdev) not in majors:
            bad.append(p)
    return bad


_DEV_INDEX = re.compile(r"nvidia(\d+)$")


def fuser_holders(fuser: str, paths: list[str]) -> dict[int, set[int | None]]:
    """pid -> set of GPU indices (None for control devices such as nvidiactl/uvm).

    fuser prints bare pids on stdout and its table (plus 'Cannot stat' noise) on stderr,
    so we call it once per path and read only stdout: the pid-to-path mapping stays exact.
    """
    holders: dict[int, set[int | None]] = {}
    for path in paths:
        try:
            res = subprocess.run([fuser, "-v", path], capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log(f"fuser failed on {path}: {exc}")
            continue
        m = _DEV_INDEX.search(os.path.basename(path))
        gpu = int(m.group(1)) if m else None
        for tok in res.stdout.split():
            mm = re.match(r"(\d+)", tok)  # tokens like 'kernel' are mounts, not processes
            if mm:
                holders.setdefault(int(mm.group(1)), set()).add(gpu)
    return holders


def _csv_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.split(",")] for line in text.splitlines() if line.strip()]


def _num(s: str) -> float | None:
    try:
        return float(s)
    except ValueError:  # '[N/A]', '[Not Supported]'
        return None


@dataclass
class SmiSnapshot:
    gpus: list[dict] = field(default_factory=list)       # index, uuid, name, used, total
    apps: list[dict] = field(default_factory=list)       # pid, mem, uuid, index
    error: str | None = None


def query_smi(smi: str | None) -> SmiSnapshot:
    snap = SmiSnapshot()
    if not smi:
        return snap
    try:
        g = subprocess.run(
            [smi, "--query-gpu=index,uuid,name,memory.used,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=60)
        a = subprocess.run(
            [smi, "--query-compute-apps=pid,used_memory,gpu_uuid", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        snap.error = f"{smi}: {exc}"
        return snap
    if g.returncode != 0:
        snap.error = f"{smi} exited {g.returncode}: {(g.stderr or g.stdout).strip()[:300]}"
        return snap
    by_uuid = {}
    for row in _csv_rows(g.stdout):
        if len(row) < 5:
            continue
        gpu = {"index": int(row[0]), "uuid": row[1], "name": row[2],
               "used": _num(row[3]), "total": _num(row[4])}
        snap.gpus.append(gpu)
        by_uuid[gpu["uuid"]] = gpu["index"]
    if a.returncode == 0:
        for row in _csv_rows(a.stdout):
            if len(row) < 3 or not row[0].isdigit():
                continue
            snap.apps.append({"pid": int(row[0]), "mem": _num(row[1]) or 0.0,
                              "uuid": row[2], "index": by_uuid.get(row[2])})
    return snap


def load_job_pgids(runs_dir: str | None) -> dict[int, str]:
    """pgid -> job id, from <runs-dir>/<job>/pgid (the job id is meta.json's, else the dir name)."""
    out: dict[int, str] = {}
    if not runs_dir:
        return out
    boot = procfs.boot_id()
    for pg in sorted(glob.glob(os.path.join(runs_dir, "*", "pgid"))):
        job_dir = os.path.dirname(pg)
        try:
            pgid = int(Path(pg).read_text().strip())
        except (OSError, ValueError):
            continue
        job_id = os.path.basename(job_dir)
        meta = {}
        try:
            meta = json.loads(Path(job_dir, "meta.json").read_text())
            job_id = meta.get("job_id") or job_id
            # A pgid recorded before the last reboot names nothing of ours now (pids restart).
            if meta.get("boot_id") and boot and meta["boot_id"] != boot:
                continue
        except (OSError, ValueError, AttributeError):
            pass
        record = {"marker": os.path.join(job_dir, "job.sh"), **(meta if isinstance(meta, dict) else {})}
        # a pgid of 0/1 would mark everything as ours; one whose number now leads another group marks a stranger
        if pgid > 1 and own_group(pgid, record):
            out[pgid] = job_id
    return out


def job_running(run_dir: str | None) -> bool:
    """Is the job of this run dir (in any workdir) running now? ops/jobs.py's own reading of a job's state. An
    `ending` job is not: its shell has exited, and what it left holding a GPU is a stale holder (--stale-only stops
    it; the job keeps its shell's exit code)."""
    if not run_dir or not os.path.isfile(os.path.join(run_dir, "meta.json")):
        return False
    return job_state(run_dir)["state"] == "running"


def classify(pid: int, pgid: int | None, sid: int | None, job_pgids: dict[int, str], runs_dir: str | None) -> tuple[str, str | None, str | None]:
    """(owner, job id, the job's run dir) of a live holder: ours, other-workdir or foreign."""
    for g in (pgid, sid):
        # a group or session of that number whose leader is gone may be a stranger's now (in_job_group)
        if g in job_pgids and in_job_group(pid, g, job_pgids[g], os.path.join(runs_dir, job_pgids[g])):
            return "ours", job_pgids[g], os.path.join(runs_dir, job_pgids[g])
    job_id, run_dir = env_job(pid)
    if not job_id:
        return "foreign", None, None
    if run_dir:
        # The environment names the job's own run dir: ours only when it is under this runs dir.
        if runs_dir and same_dir(os.path.dirname(run_dir.rstrip("/")), runs_dir):
            return "ours", job_id, run_dir
        return "other-workdir", job_id, run_dir
    # A marker without a run dir (a job started by an older version, or a hand-set variable).
    here = os.path.join(runs_dir, job_id) if runs_dir and JOB_ID.fullmatch(job_id) else None
    return "ours", job_id, here if here and os.path.isdir(here) else None


def mark_stopped(run_dir: str | None) -> None:
    if run_dir and os.path.isfile(os.path.join(run_dir, "meta.json")) and not os.path.exists(os.path.join(run_dir, "exit_code")):
        atomic_write(os.path.join(run_dir, "stopped"), json.dumps({"at": time.time(), "by": "kimi-eagle gpu-reset"}))


def default_runs_dir() -> str | None:
    runs = host_runs_dir()
    return runs if runs and os.path.isdir(runs) else None


# ---------------------------------------------------------------------------
# The reset
# ---------------------------------------------------------------------------

def _gone(pid: int, start: int | None) -> bool:
    st = procfs.stat(pid)
    # A zombie holds no device memory; a different start time means the pid was reused.
    return st is None or not st.alive or (start is not None and st.start_ticks != start)


def _signal(h: dict, sig: signal.Signals) -> bool:
    if _gone(h["pid"], h["_start"]):
        return False
    try:
        os.kill(h["pid"], sig)
    except ProcessLookupError:
        return False
    except PermissionError as exc:
        h.setdefault("errors", []).append(f"{sig.name}: {exc}")
        return False
    h["signal_sent"] = sig.name if not h["signal_sent"] else h["signal_sent"] + "," + sig.name
    return True


def _gpu_check(snap: SmiSnapshot, gpu: dict, targets: set[int], watched: set[int]) -> tuple[bool, dict]:
    """Is this GPU's memory back to baseline? Returns (free, details)."""
    now = next((g for g in snap.gpus if g["index"] == gpu["index"]), None)
    if now is None or now["used"] is None:
        return True, {"mem_used_after": None}
    apps = [a for a in snap.apps if a["index"] == gpu["index"]]
    live_targets = [a["pid"] for a in apps if a["pid"] in targets]
    others = sum(a["mem"] for a in apps if a["pid"] not in targets)
    unattributed = now["used"] - others
    limit = max(gpu["threshold_mib"], gpu["baseline_mib"])
    free = (not live_targets) and (gpu["index"] not in watched or unattributed <= limit)
    return free, {"mem_used_after": now["used"], "unattributed_mib_after": unattributed,
                  "target_pids_listed": live_targets}


def gather_holders(snap0, by_fuser: dict, job_pgids, runs_dir) -> tuple[list[dict], dict]:
    """Every process holding a GPU (fuser or nvidia-smi), classified (ours, foreign, invisible); and nvidia-smi's
    memory per pid and GPU."""
    smi_mem: dict[int, dict[int, float]] = {}
    smi_uuid: dict[int, set[str]] = {}
    for a in snap0.apps:
        smi_mem.setdefault(a["pid"], {})
        smi_mem[a["pid"]][a["index"]] = smi_mem[a["pid"]].get(a["index"], 0.0) + a["mem"]
        smi_uuid.setdefault(a["pid"], set()).add(a["uuid"])

    holders: list[dict] = []
    for pid in sorted(set(by_fuser) | set(smi_mem)):
        st = procfs.stat(pid)
        gpus = {i for i in by_fuser.get(pid, set()) if i is not None} | {
            i for i in smi_mem.get(pid, {}) if i is not None}
        mem = smi_mem.get(pid)
        h = {"pid": pid, "user": None, "cmd": "", "gpu": sorted(gpus),
             "gpu_uuid": sorted(smi_uuid.get(pid, ())),
             "mem_mib": round(sum(mem.values()), 1) if mem else None,
             "sources": [s for s, d in (("fuser", by_fuser), ("nvidia-smi", smi_mem)) if pid in d],
             "pgid": None, "sid": None, "state": None, "job_id": None, "owner": "foreign",
             "action": "keep", "planned": "keep", "result": None, "signal_sent": None,
             "_start": None, "start_ticks": None}
        if st is None:
            h["owner"], h["action"], h["result"] = "invisible", "none", "not-visible"
            holders.append(h)
            continue
        # start_ticks in the report: what a person confirms with the pid (--only-pids PID:START)
        h["state"], h["_start"], h["start_ticks"] = st.state, st.start_ticks, st.start_ticks
        h["user"], h["cmd"] = _user(pid), _cmdline(pid)
        h["pgid"], h["sid"] = st.pgid, st.sid
        h["owner"], h["job_id"], h["job_run_dir"] = classify(pid, h["pgid"], h["sid"], job_pgids, runs_dir)
        h["job_running"] = job_running(h["job_run_dir"])
        holders.append(h)
    return holders, smi_mem


def gpu_rows_of(snap0, threshold_mib: float) -> list[dict]:
    """The report's row of each GPU before any signal."""
    gpu_rows = []
    for g in snap0.gpus:
        listed = sum(a["mem"] for a in snap0.apps if a["index"] == g["index"])
        unattributed = (g["used"] - listed) if g["used"] is not None else 0.0
        gpu_rows.append({"index": g["index"], "uuid": g["uuid"], "name": g["name"],
                         "mem_used_before": g["used"], "mem_used_after": None,
                         "mem_total": g["total"], "unattributed_mib_before": unattributed,
                         "baseline_mib": 0.0, "threshold_mib": threshold_mib,
                         "checked": False, "free": None, "held_by": []})
    return gpu_rows


def plan_targets(holders: list[dict], warnings: list, *, stop_all: bool, stale_only: bool, dry_run: bool,
                 only_pids: dict[int, int | None] | None, protected: set[int]) -> list[dict]:
    """The holders to stop (each holder's action and planned say why or why not). only_pids: pid -> the start
    time it had when shown (None: any)."""
    targets: list[dict] = []
    for h in holders:
        if h["owner"] == "invisible":
            continue
        wanted = stop_all or h["owner"] == "ours"
        if wanted and stale_only and h.get("job_running"):
            # --stale-only (`run --reset-gpus`): a running job's processes are never ours to stop here.
            h.setdefault("errors", []).append(f"belongs to running job {h['job_id']}: kept")
            continue
        if wanted and h["pid"] in protected:
            h["action"], h["result"] = "keep", "still-running"
            h.setdefault("errors", []).append("protected pid (this script, its ancestors or init)")
            continue
        if wanted and only_pids is not None and h["pid"] not in only_pids:
            h["action"] = "keep"
            h.setdefault("errors", []).append("outside --only-pids: not signalled")
            continue
        if wanted and only_pids is not None and only_pids[h["pid"]] not in (None, h["_start"]):
            # The process shown and confirmed has gone and its number went to another holder: not the one agreed.
            h["action"] = "keep"
            why = (f"pid {h['pid']} not signalled: it started at tick {h['_start']}, not {only_pids[h['pid']]} as "
                   "when it was shown (another process has that number now)")
            h.setdefault("errors", []).append(why)
            warnings.append(why)
            continue
        if wanted:
            h["action"] = "none" if dry_run else "stop"
            h["planned"] = "stop"
            if not dry_run:
                targets.append(h)
            # Said, not a problem: a process passes through D in its I/O; whether it outlived the signals is
            # verify_stopped's to judge, and a holder we do not stop (or a dry run) fails nothing.
            if h["state"] == "D":
                warnings.append(f"pid {h['pid']} is in D state (uninterruptible I/O): a signal ends it only once "
                                "that I/O ends")
    return targets


def stop_targets(targets: list[dict], grace: float) -> None:
    """SIGTERM, up to `grace` seconds, then SIGKILL; their jobs marked stopped first."""
    for run_dir in sorted({h["job_run_dir"] for h in targets if h.get("job_run_dir")}):
        mark_stopped(run_dir)
    for h in targets:
        _signal(h, signal.SIGTERM)
    deadline_term = time.monotonic() + grace
    while time.monotonic() < deadline_term and not all(_gone(h["pid"], h["_start"]) for h in targets):
        time.sleep(POLL_S)
    for h in targets:
        if not _gone(h["pid"], h["_start"]):
            log(f"pid {h['pid']} survived SIGTERM for {grace}s: SIGKILL")
            _signal(h, signal.SIGKILL)


def verify_stopped(report: dict, holders: list[dict], targets: list[dict], smi, snap0, gpu_rows: list[dict],
                   watched: set[int], timeout: float, t0: float):
    """Wait until the targets are gone and their GPUs' memory is back (or `timeout`); each holder's result. The last
    nvidia-smi snapshot."""
    target_pids = {h["pid"] for h in targets}
    deadline = time.monotonic() + timeout
    snap = snap0
    while True:
        procs_gone = all(_gone(h["pid"], h["_start"]) for h in targets)
        if procs_gone and "t_processes_gone_s" not in report:
            report["t_processes_gone_s"] = round(time.monotonic() - t0, 3)
        mem_free = True
        if smi and procs_gone:
            snap = query_smi(smi)
            mem_free = all(_gpu_check(snap, g, target_pids, watched)[0] for g in gpu_rows)
        if (procs_gone and mem_free) or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S if not procs_gone else 0.25)
    if smi and not procs_gone:
        snap = query_smi(smi)

    for h in targets:
        if _gone(h["pid"], h["_start"]):
            h["result"] = "killed-after-term" if "SIGKILL" in (h["signal_sent"] or "") else "gone"
        else:
            st = procfs.stat(h["pid"])
            h["state"] = st.state if st else h["state"]
            h["result"] = "d-state" if h["state"] == "D" else "still-running"
            report["problems"].append(
                f"pid {h['pid']} ({h['owner']}, {h['cmd'][:80]!r}) is {h['result']} after "
                f"{h['signal_sent'] or 'no signal'}"
                + ("; D state: it waits on the kernel/driver and dies only when that I/O ends "
                   "(a hung GPU may need a node reboot)" if h["result"] == "d-state" else ""))
    for h in holders:
        if h["result"] is None:
            h["result"] = "gone" if _gone(h["pid"], h["_start"]) else "still-running"
    return snap


def find_tools(device_paths: list[str] | None, nvidia_smi: str | None, fuser: str | None):
    """(the device files, nvidia-smi, fuser) this host has: found, or None / empty."""
    paths = expand_device_paths(device_paths or [DEFAULT_DEVICE_GLOB])
    smi = find_nvidia_smi(nvidia_smi)
    fuser_bin = shutil.which(fuser or "fuser") if not (fuser and os.sep in fuser) else (
        fuser if os.access(fuser, os.X_OK) else None)
    return paths, smi, fuser_bin


def missing_tools(report: dict, device_paths, require_gpu: bool) -> bool:
    """True, with the report's note said, when the reset cannot look for holders: then nothing is done. A host
    without an NVIDIA driver is a no-op (a problem under --require-gpu); one with device files but neither fuser
    nor nvidia-smi is a problem, since its GPUs may be held. Without fuser alone, nvidia-smi lists the holders."""
    src = report["sources"]
    if not src["nvidia_smi"] and not src["device_paths"]:
        report["note"] = ("no NVIDIA driver on this host (no nvidia-smi and no device file matches "
                          f"{device_paths or [DEFAULT_DEVICE_GLOB]}): nothing done")
        if require_gpu:
            report["problems"].append(report["note"] + " and --require-gpu was given")
    elif not src["fuser"]:
        # Containers often lack psmisc: nvidia-smi's compute apps are then the only source, which misses a process
        # holding a device file without a CUDA context (said, so "no holder" is read with that in mind).
        report["note"] = "fuser not found (install psmisc: apt-get install psmisc)"
        if src["nvidia_smi"]:
            report["note"] += ": holders from nvidia-smi only"
            log(report["note"])
            return False
        report["note"] += f" and no nvidia-smi: cannot tell which processes hold {', '.join(src['device_paths'])}"
        report["problems"].append(report["note"])
    else:
        return False
    report["ok"] = not report["problems"]
    log(report["note"])
    return True


def watch_gpus(targets: list[dict], gpu_rows: list[dict], smi_mem) -> set[int]:
    """The GPUs to verify: those a target was seen on; all of them when a target's GPU is unknown. Each checked
    GPU's baseline set where it can be trusted."""
    watched: set[int] = set()
    for h in targets:
        watched |= set(h["gpu"]) if h["gpu"] else {g["index"] for g in gpu_rows}
    for g in gpu_rows:
        g["checked"] = g["index"] in watched
        on_gpu = [h for h in targets if g["index"] in h["gpu"] or not h["gpu"]]
        if g["checked"] and all(h["pid"] in smi_mem for h in on_gpu):
            g["baseline_mib"] = max(0.0, g["unattributed_mib_before"])
    return watched


def invisible_problems(holders: list[dict]) -> list[str]:
    """--all: the holders it cannot signal from here, as problems."""
    return [f"pid {h['pid']} holds {h['mem_mib']} MiB on GPU {h['gpu']} but is not in this PID "
            "namespace: it cannot be signalled from here (stop it from the host or container "
            "that runs it)" for h in holders if h["owner"] == "invisible"]


def run_reset(*, device_paths: list[str] | None = None, nvidia_smi: str | None = None,
              fuser: str | None = None, runs_dir: str | None = None, stop_all: bool = False,
              dry_run: bool = False, grace: float = 10.0, timeout: float = 60.0,
              threshold_mib: float = DEFAULT_THRESHOLD_MIB, require_gpu: bool = False,
              only_pids: dict[int, int | None] | None = None, stale_only: bool = False) -> dict:
    """Do one reset and return the report (see the module docstring). Never raises for
    missing tools: the report's ``note`` says what was skipped."""
    t0 = time.monotonic()
    mode = "dry-run" if dry_run else ("all" if stop_all else "ours")
    # problems fail the reset (exit 1); warnings are said and fail nothing.
    report: dict = {"ok": True, "mode": mode, "note": None, "holders": [], "gpus": [],
                    "problems": [], "warnings": [], "elapsed_s": 0.0, "runs_dir": runs_dir}
    paths, smi, fuser_bin = find_tools(device_paths, nvidia_smi, fuser)
    report["sources"] = {"device_paths": paths, "nvidia_smi": smi, "fuser": fuser_bin}
    if missing_tools(report, device_paths, require_gpu):
        return report

    # ---- gather ---------------------------------------------------------------
    snap0 = query_smi(smi)
    if snap0.error:
        report["problems"].append(f"nvidia-smi failed: {snap0.error}")
    by_fuser = fuser_holders(fuser_bin, paths) if fuser_bin else {}
    job_pgids = load_job_pgids(runs_dir)
    protected = _protected_pids()

    holders, smi_mem = gather_holders(snap0, by_fuser, job_pgids, runs_dir)
    report["holders"] = holders

    # Baseline per GPU: memory that no listed process accounts for (driver, other
    # containers). It is only trusted when every target on that GPU was listed by
    # nvidia-smi; otherwise an unlisted target's memory would hide in it.
    gpu_rows = gpu_rows_of(snap0, threshold_mib)
    report["gpus"] = gpu_rows

    # ---- plan -------------------------------------------------------------------
    targets = plan_targets(holders, report["warnings"], stop_all=stop_all, stale_only=stale_only,
                           dry_run=dry_run, only_pids=only_pids, protected=protected)
    target_pids = {h["pid"] for h in targets}
    watched = watch_gpus(targets, gpu_rows, smi_mem)
    if stop_all and not dry_run:
        report["problems"] += invisible_problems(holders)

    log(f"mode={mode}: {len(holders)} holder(s), {len(targets)} target(s), "
        f"{sum(h['owner'] == 'ours' for h in holders)} ours, job pgids={sorted(job_pgids)}")

    if dry_run:
        for h in holders:
            h["action"] = "none"  # 'planned' says what a real run would do
            if h["result"] is None:
                h["result"] = "gone" if _gone(h["pid"], h["_start"]) else "still-running"
        _finish(report, t0, snap0, set(), set())
        return report

    # ---- stop: SIGTERM, wait up to grace, SIGKILL ------------------------------
    # Mark the jobs we stop first, as `kimi-eagle stop` does: their exit (143) then reads "stopped", not "failed".
    stop_targets(targets, grace)

    # ---- verify: processes gone and memory back to baseline --------------------
    # The timeout runs after the signals, so a long --grace cannot eat the verify window.
    snap = verify_stopped(report, holders, targets, smi, snap0, gpu_rows, watched, timeout, t0)
    _finish(report, t0, snap, target_pids, watched)
    return report


def _finish(report: dict, t0: float, snap: SmiSnapshot, target_pids: set[int], watched: set[int]) -> None:
    holders = report["holders"]
    alive = {h["pid"]: h for h in holders if h["result"] in ("still-running", "d-state", "not-visible")}
    for g in report["gpus"]:
        free, det = _gpu_check(snap, g, target_pids, watched)
        g.update(det)
        g["held_by"] = [
            {"pid": a["pid"], "mem_mib": a["mem"],
             "owner": alive[a["pid"]]["owner"] if a["pid"] in alive else "unknown"}
            for a in snap.apps if a["index"] == g["index"]]
        if report["mode"] == "dry-run":
            g["free"] = None
            continue
        g["free"] = free
        if not free:
            names = ", ".join(f"pid {x['pid']} ({x['owner']}, {x['mem_mib']:.0f} MiB)" for x in g["held_by"]) or "nothing listed"
            report["problems"].append(
                f"GPU {g['index']}: {g['mem_used_after']:.0f} MiB used, "
                f"{g.get('unattributed_mib_after', 0):.0f} MiB not accounted for by live processes "
                f"(baseline {g['baseline_mib']:.0f}, threshold {g['threshold_mib']:.0f}); listed: {names}")
    for h in holders:
        h.pop("_start", None)
    report["remaining_foreign"] = [h["pid"] for h in holders
                                   if h["owner"] == "foreign" and h["result"] == "still-running"]
    report["d_state"] = [h["pid"] for h in holders if h["state"] == "D" and h["result"] != "gone"]
    report["elapsed_s"] = round(time.monotonic() - t0, 3)
    report["ok"] = not report["problems"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m kimi_eagle_host.ops.gpu_reset",
        description="Stop the processes holding NVIDIA GPUs (default: only kimi-eagle jobs' ones) "
                    "and verify the memory is free. JSON report on stdout.")
    p.add_argument("--device-path", action="append", default=None, metavar="PATH",
                   help=f"GPU device node or glob to inspect with fuser (repeatable; default $KIMI_EAGLE_GPU_DEVICES "
                        f"split on ':', else {DEFAULT_DEVICE_GLOB})")
    p.add_argument("--nvidia-smi", default=None, metavar="PATH",
                   help="nvidia-smi binary (default: from PATH or /usr/local/nvidia/bin); absent: skip that source")
    p.add_argument("--fuser", default=None, metavar="PATH", help="fuser binary (default: from PATH)")
    p.add_argument("--runs-dir", default=None, metavar="DIR",
                   help="the controller's runs dir holding <job>/pgid (default: <workdir>/runs next to "
                        "the payload dir when it exists)")
    mx = p.add_mutually_exclusive_group()
    mx.add_argument("--all", dest="stop_all", action="store_true",
                    help="stop every holder, not only ours (the controller asks for confirmation)")
    mx.add_argument("--only-ours", dest="stop_all", action="store_false",
                    help="stop only kimi-eagle jobs' processes (the default)")
    p.add_argument("--dry-run", action="store_true", help="show the plan, signal nothing")
    p.add_argument("--grace", type=float, default=10.0, metavar="S",
                   help="seconds between SIGTERM and SIGKILL (default 10)")
    p.add_argument("--timeout", type=float, default=60.0, metavar="S",
                   help="seconds to wait, after the signals, for the processes to be gone and the memory "
                        "free (default 60)")
    p.add_argument("--threshold-mib", type=float, default=DEFAULT_THRESHOLD_MIB, metavar="MIB",
                   help="memory per GPU that may stay used without a live holder "
                        f"(default {DEFAULT_THRESHOLD_MIB}; the pre-reset unattributed baseline wins if larger)")
    p.add_argument("--require-gpu", action="store_true",
                   help="exit 1 (instead of 0) on a host without NVIDIA driver")
    p.add_argument("--stale-only", action="store_true",
                   help="keep the processes of running kimi-eagle jobs (run --reset-gpus: only stale holders of ours)")
    p.add_argument("--only-pids", default=None, metavar="PID[:START],...",
                   help="safety guard: never signal a pid outside this comma list, nor one whose start time (clock "
                        "ticks, /proc/PID/stat field 22) is not START (gpu-reset --all: what was shown)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.grace < 0 or args.timeout < 0:
        print("gpu_reset: --grace and --timeout must be >= 0", file=sys.stderr)
        return 2
    only = None
    if args.only_pids is not None:
        try:
            only = {}
            for item in filter(None, (x.strip() for x in args.only_pids.split(","))):
                pid, _, start = item.partition(":")
                only[int(pid)] = int(start) if start else None
        except ValueError:
            print(f"gpu_reset: --only-pids: not a comma list of PID or PID:START: {args.only_pids!r}", file=sys.stderr)
            return 2
    bad = not_gpu_nodes(expand_device_paths(args.device_path or []))
    if bad:
        print(f"gpu_reset: --device-path {bad[0]} is not a GPU device node (expected a character device "
              f"such as /dev/nvidia0, /dev/nvidiactl, /dev/nvidia-uvm or /dev/dri/renderD128)", file=sys.stderr)
        return 2
    runs_dir = args.runs_dir if args.runs_dir is not None else default_runs_dir()
    # The inventory can point a host at other device files through its env (tests, unusual drivers): the
    # host's own configuration, trusted as given, unlike a command's --device-path.
    env_paths = [p for p in os.environ.get("KIMI_EAGLE_GPU_DEVICES", "").split(":") if p]
    report = run_reset(device_paths=args.device_path or env_paths or None, nvidia_smi=args.nvidia_smi, fuser=args.fuser,
                       runs_dir=runs_dir, stop_all=args.stop_all, dry_run=args.dry_run,
                       grace=args.grace, timeout=args.timeout, threshold_mib=args.threshold_mib,
                       require_gpu=args.require_gpu, only_pids=only, stale_only=args.stale_only)
    print(json.dumps(report, indent=2))
    for prob in report["problems"]:
        log("PROBLEM: " + prob)
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
