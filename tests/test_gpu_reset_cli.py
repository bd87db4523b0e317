"""kimi-eagle gpu-reset over the real sshd: device paths point at files held open by real processes."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import make_env, one_line_usage_error
from kimi_eagle.hosts.session import payload_set

PY = sys.executable

HOLDER = """
import signal, sys, time
f = open(sys.argv[1], "rb")
if len(sys.argv) > 2 and sys.argv[2] == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(600)
"""


@pytest.fixture
def gpu_env(tmp_path, sshd):
    dev = tmp_path / "nvidia0"
    dev.write_bytes(b"")
    e = make_env(tmp_path, sshd, host_env={"KIMI_EAGLE_GPU_DEVICES": str(dev)})
    e.dev = dev
    e.procs = []
    yield e
    for p in e.procs:
        p.kill()


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def holding(path: Path) -> set[int]:
    out = subprocess.run(["fuser", str(path)], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def foreign_holder(env, *mode):
    p = subprocess.Popen([PY, "-c", HOLDER, str(env.dev), *mode], start_new_session=True)
    env.procs.append(p)
    return p.pid


def our_stale_holder(env, *mode):
    """A job that leaves a child holding the device after it exits: ours, and stale."""
    script = env.root / "leaver.py"
    script.write_text(f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {HOLDER!r}, {str(env.dev)!r}, *{list(mode)!r}])\n")
    r = env.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", PY, str(script))
    assert r.code == 0, r.stderr
    deadline = time.monotonic() + 20
    while len(holding(env.dev)) < 1 + len([p for p in env.procs if alive(p.pid)]):
        assert time.monotonic() < deadline, "holder never opened the device"
        time.sleep(0.05)
    return r.json()["id"]


def wait_held(env, n):
    deadline = time.monotonic() + 20
    while len(holding(env.dev)) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_default_stops_only_ours_escalating_to_sigkill(gpu_env):
    foreign = foreign_holder(gpu_env)
    wait_held(gpu_env, 1)
    our_stale_holder(gpu_env, "stubborn")
    ours = holding(gpu_env.dev) - {foreign}
    assert len(ours) == 1
    r = gpu_env.cli("--json", "gpu-reset", "--host", "gpu", "--grace", "1")
    assert r.code == 0, r.stdout + r.stderr
    by_pid = {h["pid"]: h for h in r.json()[0]["holders"]}
    (our_pid,) = ours
    assert by_pid[our_pid]["owner"] == "ours" and by_pid[our_pid]["result"] == "killed-after-term"
    assert by_pid[foreign]["owner"] == "foreign" and by_pid[foreign]["action"] == "keep"
    assert not alive(our_pid) and alive(foreign)
    # --all without --yes and without a terminal: refused, nothing stopped.
    refused = gpu_env.cli("gpu-reset", "--host", "gpu", "--all")
    assert refused.code == 2 and "--yes" in refused.stderr and alive(foreign)
    # --dry-run stops nothing, even with --all.
    dry = gpu_env.cli("--json", "gpu-reset", "--host", "gpu", "--all", "--dry-run")
    assert dry.code == 0 and alive(foreign)
    assert dry.json()[0]["holders"][0]["planned"] == "stop"
    # --all --yes stops the foreign holder too.
    r = gpu_env.cli("gpu-reset", "--host", "gpu", "--all", "--yes", "--grace", "1")
    assert r.code == 0, r.stdout + r.stderr
    assert not alive(foreign)
    assert "foreign" in r.stdout and str(foreign) in r.stdout


def test_all_confirmed_by_pid_and_start_time_spares_a_process_that_took_the_pid(gpu_env):
    """What `gpu-reset --all` does after the question: signal the holders shown, each checked by its start time on
    the host. A confirmed pid whose start time differs (its process exited and the number went to another holder)
    is not signalled, and the reset says why in one line."""
    from kimi_eagle.api import Controller

    foreign = foreign_holder(gpu_env)
    wait_held(gpu_env, 1)
    api = Controller(str(gpu_env.inventory))
    (plan,) = api.gpu_reset("gpu", stop_all=True, dry_run=True)
    (shown,) = plan.value.holders
    assert shown["pid"] == foreign and shown["start_ticks"] > 0
    (o,) = api.gpu_reset("gpu", stop_all=True, grace=1, only_pids={"gpu": [(foreign, shown["start_ticks"] - 1)]})
    assert o.ok and o.value.ok and alive(foreign)
    (said,) = o.value.data["warnings"]
    assert said.startswith(f"pid {foreign} not signalled: it started at tick {shown['start_ticks']}, not "), said
    (o,) = api.gpu_reset("gpu", stop_all=True, grace=1, only_pids={"gpu": [(foreign, shown["start_ticks"])]})
    assert o.ok and o.value.ok and o.value.data["warnings"] == []
    deadline = time.monotonic() + 5
    while alive(foreign):
        assert time.monotonic() < deadline, "the confirmed holder was not stopped"
        time.sleep(0.05)


def test_run_reset_gpus_frees_our_stale_holder_first(gpu_env):
    our_stale_holder(gpu_env)
    (stale,) = holding(gpu_env.dev)
    foreign = foreign_holder(gpu_env)
    wait_held(gpu_env, 2)
    r = gpu_env.cli("run", "exec", "--host", "gpu", "--reset-gpus", "--", "true")
    assert r.code == 0, r.stdout + r.stderr
    assert not alive(stale) and alive(foreign)
    assert f"pid {stale}" in r.stdout


@pytest.mark.parametrize("path", ["/dev/null", "/dev/nvidia0/../null", "/dev/*", "relative/nvidia0"])
def test_a_device_path_that_is_no_gpu_node_is_refused_before_the_host(gpu_env, path):
    """fuser on /dev/null lists every process of the host; the dry run listed them all as GPU holders. Only
    --dry-run here: without the check, a stop would signal every process of the machine."""
    foreign = foreign_holder(gpu_env)
    r = gpu_env.cli("gpu-reset", "--host", "gpu", "--device-path", path, "--dry-run")
    line = one_line_usage_error(r)
    assert f"--device-path {path}: not a GPU device node" in line and r.stdout == "", (line, r.stdout)
    assert alive(foreign)


def test_host_without_gpu_is_a_clear_no_op(tmp_path, sshd):
    e = make_env(tmp_path, sshd, host_env={"KIMI_EAGLE_GPU_DEVICES": str(tmp_path / "no-such-device*"), "PATH": "/usr/bin:/bin"})
    r = e.cli("gpu-reset", "--host", "gpu")
    assert r.code == 0 and "no NVIDIA driver" in r.stdout
    assert e.cli("gpu-reset", "--host", "gpu", "--require-gpu").code == 1


def test_a_gpu_whose_memory_nvidia_smi_does_not_report_reads_memory_unknown(tmp_path, sshd):
    """[N/A] memory (unified-memory GPUs: GB10, Grace Hopper) is said as such, not as "None -> None MiB"."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\ncase \"$*\" in *--query-gpu=*) echo '0, GPU-gb10, NVIDIA GB10, "
                                        "[N/A], [N/A]';; esac\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    e = make_env(tmp_path, sshd, host_env={"PATH": f"{bin_dir}:/usr/bin:/bin",
                                            "KIMI_EAGLE_GPU_DEVICES": str(tmp_path / "no-such-device*")})
    r = e.cli("gpu-reset", "--host", "gpu", "--dry-run")
    assert r.code == 0, r.stdout + r.stderr
    assert "[gpu] GPU 0: memory unknown" in r.stdout and "None" not in r.stdout, r.stdout


@pytest.mark.parametrize("flag,value", [("--grace", "inf"), ("--grace", "1e300"), ("--timeout", "1e9"),
                                        ("--grace", "3601")])
def test_a_grace_or_timeout_that_would_wait_forever_is_refused_before_the_host(tmp_path, sshd, flag, value):
    e = make_env(tmp_path, sshd)
    line = one_line_usage_error(e.cli("gpu-reset", "--host", "gpu", flag, value))
    assert line.startswith(f"error: {flag} ") and "from 0 to 3600" in line, line
    assert not e.workdir.exists(), "the command reached the host"


@pytest.mark.parametrize("kw", [{"grace": float("inf")}, {"grace": float("nan")}, {"timeout": float("nan")},
                                {"timeout": float("inf")}, {"timeout": -1.0}])
def test_the_api_bounds_gpu_reset_as_the_cli_does(tmp_path, sshd, kw):
    from kimi_eagle.api import Controller
    from kimi_eagle.errors import ConfigError

    e = make_env(tmp_path, sshd)
    with pytest.raises(ConfigError, match=r"^--(grace|timeout) (inf|nan|-1\.0): .*from 0 to 3600$"):
        Controller(str(e.inventory)).gpu_reset("gpu", **kw)
    assert not e.workdir.exists()


def tree(root: Path) -> dict:
    """Every path under root with its size, mode and modification time: what a write would change."""
    return {str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mode, p.lstat().st_mtime_ns)
            for p in root.rglob("*")} if root.exists() else {}


def test_a_dry_run_writes_nothing_on_the_host(tmp_path, sshd):
    """gpu-reset --dry-run on a host kimi-eagle never used lists the holders and leaves no workdir behind (it uploaded
    the host package there); on a used host whose payload set is older, it leaves every file as it was and still
    tells our stale holder from a foreign one. The host's Python cannot import the package from anywhere else."""
    dev = tmp_path / "nvidia0"
    dev.write_bytes(b"")
    e = make_env(tmp_path, sshd, host_env={"KIMI_EAGLE_GPU_DEVICES": str(dev), "PYTHONPATH": str(tmp_path / "none")})
    e.dev, e.procs = dev, []
    try:
        foreign = foreign_holder(e)
        wait_held(e, 1)
        dry = e.cli("--json", "gpu-reset", "--host", "gpu", "--all", "--dry-run")
        assert dry.code == 0, dry.stderr
        (held,) = dry.json()[0]["holders"]
        assert held["pid"] == foreign and held["planned"] == "stop" and alive(foreign)
        assert not e.workdir.exists()

        our_stale_holder(e)
        (ours,) = holding(dev) - {foreign}
        (e.workdir / payload_set().folder / "MANIFEST").write_text("an older set\n")  # this set, not whole
        before = tree(e.workdir)
        dry = e.cli("--json", "gpu-reset", "--host", "gpu", "--dry-run")
        assert dry.code == 0, dry.stderr
        owners = {h["pid"]: (h["owner"], h["planned"]) for h in dry.json()[0]["holders"]}
        assert owners == {ours: ("ours", "stop"), foreign: ("foreign", "keep")}, owners
        assert tree(e.workdir) == before and alive(ours) and alive(foreign)
    finally:
        for p in e.procs:
            p.kill()
        for pid in holding(dev):
            subprocess.run(["kill", "-9", str(pid)])
