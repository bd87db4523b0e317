"""bench/gpu/side_by_side.py, the GPU campaign's runner, on a bare machine. A device machine idle for 30 s is given
back and the next call gets a bare one; in the twenty-fifth session such a call sat out its whole wait (560 s of the
session's 1,800 s of device time) for pieces nobody carried. A wait that cannot end in progress now ends at once and
says what has to be carried; a restart with no runner says so instead of a traceback."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "bench" / "gpu" / "side_by_side.py"


def campaign_env(tmp_path: Path, **knobs: str) -> dict:
    return {**os.environ, "KE_WORK": str(tmp_path / "work"), "KE_SHM": str(tmp_path / "shm"), "KE_TINY": "1",
            "KE_GPUS": "1", "KE_STAGES": "smol_model,scale_data", "PYTHON": sys.executable, **knobs}


def campaign(tmp_path: Path, *args: str, timeout: float = 200, **knobs: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(RUNNER), *args], env=campaign_env(tmp_path, **knobs),
                          capture_output=True, text=True, timeout=timeout)


def stop_runner(tmp_path: Path) -> None:
    pid_file = tmp_path / "work" / "runner.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
        except ProcessLookupError:
            pass


def run_to_the_end(tmp_path: Path, flags=(), **knobs: str) -> None:
    """A runner started on a bare machine (nothing carried; `flags` as if their bundles were installed), until it
    has finished."""
    nothing = tmp_path / "carried"
    nothing.mkdir()
    try:
        assert campaign(tmp_path, "absorb", "--from", str(nothing), **knobs).returncode == 0
        for flag in flags:
            (tmp_path / "work" / "flags" / f"{flag}.done").write_text("0")
        assert "runner started" in campaign(tmp_path, "start", **knobs).stdout
        deadline = time.monotonic() + 120
        while not (tmp_path / "work" / "runner.finished").exists() and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        stop_runner(tmp_path)


def test_a_wait_on_a_bare_machine_ends_saying_what_to_carry(tmp_path):
    nothing = tmp_path / "carried"
    nothing.mkdir()
    try:
        assert campaign(tmp_path, "absorb", "--from", str(nothing)).returncode == 0
        started = campaign(tmp_path, "start")
        assert "runner started" in started.stdout, started.stdout + started.stderr
        t0 = time.monotonic()
        waited = campaign(tmp_path, "wait", "--seconds", "150", "--out", str(tmp_path / "out"))
        took = time.monotonic() - t0
    finally:
        stop_runner(tmp_path)
    assert waited.returncode == 0, waited.stderr
    assert "nothing runs until a call carries bundle-early (manifest.json and its pieces not here)" in waited.stdout
    assert took < 100, f"the wait sat for {took:.0f} s on what no call had carried"
    # the report the call hands back is still written
    assert (tmp_path / "out" / "side_by_side.json").exists()


def test_a_wait_names_the_pieces_a_bundle_still_lacks(tmp_path):
    carried = tmp_path / "carried"
    carried.mkdir()
    piece = 1024
    manifest = {"piece_bytes": piece, "total_bytes": 3 * piece,
                "bundles": [{"name": "early", "format": "tar-of-wheels", "offset": 0, "bytes": 2 * piece,
                             "sha256": "0" * 64},
                            {"name": "vllm", "format": "tar-of-wheels", "offset": 2 * piece, "bytes": piece,
                             "sha256": "0" * 64}],
                "pieces": [{"name": f"p{i}", "bytes": piece, "sha256": "0" * 64} for i in range(3)]}
    (carried / "manifest.json").write_text(json.dumps(manifest))
    try:
        campaign(tmp_path, "absorb", "--from", str(carried))
        campaign(tmp_path, "start")
        waited = campaign(tmp_path, "wait", "--seconds", "150", "--out", str(tmp_path / "out"))
    finally:
        stop_runner(tmp_path)
    assert "bundle-early (p0 p1 not here)" in waited.stdout, waited.stdout
    # a wait is not stuck while a stage runs: the same runner with its first stage running waits its time out
    flags = tmp_path / "work" / "flags"
    (flags / "smol_model.running").write_text("0")
    t0 = time.monotonic()
    again = campaign(tmp_path, "wait", "--seconds", "12", "--out", str(tmp_path / "out"))
    assert "nothing runs" not in again.stdout and time.monotonic() - t0 >= 12


def test_restart_on_a_bare_machine_says_there_is_no_runner(tmp_path):
    res = campaign(tmp_path, "restart")
    assert res.returncode != 0
    assert "no runner was started" in res.stderr and "carry .gpu/manifest.json" in res.stderr
    assert "Traceback" not in res.stderr


def test_conversations_carried_by_the_first_call_are_seen(tmp_path):
    """A first call may carry .scale/ (the scale stages' conversations) with everything else: start copies it into
    the runner's copy after absorb has looked. The runner must see it there, not wait for ever on parts it has (a
    rehearsal in one call did: `data-scale (.scale/ parts not here)`)."""
    import shutil

    checkout = tmp_path / "checkout"
    shutil.copytree(REPO, checkout, ignore=shutil.ignore_patterns(".git", ".gpu", ".scale", ".whl", ".debs", ".specwhl",
                                                                   "out", "__pycache__", ".pytest_cache", "*.egg-info"))
    kept = json.loads((REPO / "docs" / "results" / "regen_scale_kept.json").read_text())["regen_scale"]["packed"]
    scale = checkout / ".scale"
    scale.mkdir()
    sizes = [kept["bytes"] // len(kept["parts"])] * len(kept["parts"])
    sizes[-1] += kept["bytes"] - sum(sizes)
    for name, size in zip(kept["parts"], sizes):   # the sizes the record names (their sha256 is checked when read)
        with open(scale / name, "wb") as f:
            f.truncate(size)
    runner = checkout / "bench" / "gpu" / "side_by_side.py"
    env = {**os.environ, "KE_WORK": str(tmp_path / "work"), "KE_SHM": str(tmp_path / "shm"), "KE_TINY": "1",
           "KE_GPUS": "1", "KE_STAGES": "smol_model,scale_data", "PYTHON": sys.executable}

    def call(*args):
        return subprocess.run([sys.executable, str(runner), *args], env=env, capture_output=True, text=True,
                              timeout=200, cwd=checkout)

    nothing = tmp_path / "carried"
    nothing.mkdir()
    try:
        call("absorb", "--from", str(nothing))
        call("start")
        waited = call("wait", "--seconds", "150", "--out", str(tmp_path / "out"))
    finally:
        stop_runner(tmp_path)
    assert "nothing runs until a call carries bundle-early" in waited.stdout, waited.stdout + waited.stderr
    assert "data-scale" not in waited.stdout, waited.stdout


def test_no_stage_starts_after_the_budget_even_with_its_needs_done(tmp_path):
    """KE_BUDGET_S is when the runner starts nothing more: a stage whose needs are already done must not start after
    it either (it did: a late stage then ran past the session's device time, and the call reading it got nothing)."""
    run_to_the_end(tmp_path, flags=("bundle-early",), KE_BUDGET_S="0")   # smol_model's one need, met
    result = json.loads((tmp_path / "work" / "results" / "smol_model.json").read_text())
    assert result == {"ok": False, "skipped": True, "why": "out of time"}, result


def test_each_stage_records_its_host_memory_peak_and_the_trend_comes_back_with_the_logs(tmp_path):
    """A machine lost mid-stage gives nothing back from that call: the memory trend must already be in the logs an
    earlier call brought back, and each finished stage says how much host memory it peaked at."""
    run_to_the_end(tmp_path, KE_STAGES="matmul", KE_MEM_SAMPLE_S="0.1")
    result = json.loads((tmp_path / "work" / "results" / "matmul.json").read_text())
    assert result["ok"], result
    with open("/proc/meminfo") as f:
        total_gb = int(f.readline().split()[1]) * 1024 / 1e9
    # matmul's process imports torch: its peak is above an idle interpreter's and below the machine's memory
    assert 0.05 < result["host_mem_peak_gb"] <= total_gb, result
    trend = (tmp_path / "work" / "logs" / "host_memory.log").read_text().splitlines()
    assert any(line.endswith("stages matmul") for line in trend), trend
    out = tmp_path / "out"
    assert campaign(tmp_path, "wait", "--seconds", "0", "--out", str(out), KE_STAGES="matmul").returncode == 0
    import tarfile
    with tarfile.open(out / "side_by_side_logs.tar.gz") as tar:
        assert "host_memory.log" in tar.getnames()


def test_a_call_brings_back_the_parts_it_names(tmp_path):
    """A call brings back 8 files and 64 MiB at most, so the candidates handed back for a later session's choose
    (~19 parts of 15 MiB) come back over several calls: KE_OUT_FILES, globs joined by commas, is each call's share;
    unset, all."""
    nothing = tmp_path / "carried"
    nothing.mkdir()
    assert campaign(tmp_path, "absorb", "--from", str(nothing)).returncode == 0
    handed = tmp_path / "work" / "out_files"
    handed.mkdir(parents=True)
    names = [f"scale_candidates.tar.xz.{i:02d}" for i in range(6)]
    for name in names:
        (handed / name).write_bytes(name.encode())
    got = {}
    for share, glob in (("first", "scale_candidates.tar.xz.0[0-3]"), ("rest", "*.0[4],*.0[5-9]"), ("all", "")):
        r = campaign(tmp_path, "wait", "--seconds", "0", "--out", str(tmp_path / share), KE_OUT_FILES=glob)
        assert r.returncode == 0, r.stderr
        got[share] = sorted(p.name for p in (tmp_path / share).glob("scale_candidates.*"))
    assert got == {"first": names[:4], "rest": names[4:], "all": names}
    assert (tmp_path / "first" / names[0]).read_bytes() == names[0].encode()


def carried(tmp_path: Path, name: str, files: dict[str, str], env_name: str, call: str):
    """<name>.tar.xz.00/.01 in a checkout's .scale/ holding `files` (archive path: text), and restore(sha), which
    runs side_by_side's `call` there with env_name=sha and gives what it printed (its record, or 'failed: ...')."""
    import hashlib
    import tarfile

    src = tmp_path / "src"
    for path, text in files.items():
        (src / path).parent.mkdir(parents=True, exist_ok=True)
        (src / path).write_text(text)
    tar = tmp_path / "c.tar"
    with tarfile.open(tar, "w") as t:
        for top in sorted({p.split("/")[0] for p in files}):
            t.add(src / top, arcname=top)
    data = tar.read_bytes()
    checkout = tmp_path / "checkout"
    (checkout / "bench" / "gpu").mkdir(parents=True)
    (checkout / "bench" / "gpu" / "side_by_side.py").write_text(RUNNER.read_text())
    (checkout / ".scale").mkdir()
    half = len(data) // 2
    (checkout / ".scale" / f"{name}.tar.xz.00").write_bytes(data[:half])
    (checkout / ".scale" / f"{name}.tar.xz.01").write_bytes(data[half:])
    code = ("import sys; sys.path.insert(0, sys.argv[1]); sys.argv = sys.argv[:1]\n"
            "import json, side_by_side as s\n"
            f"try:\n    print(json.dumps({call}))\nexcept s.StageFailed as e:\n    print('failed:', e)\n")

    def restore(sha):
        env = {**os.environ, "KE_WORK": str(tmp_path / "work"), "KE_SHM": str(tmp_path / "shm"), "KE_TINY": "1",
               env_name: sha, "PYTHONPATH": str(REPO)}
        (tmp_path / "work").mkdir(exist_ok=True)
        r = subprocess.run([sys.executable, "-c", code, str(checkout / "bench" / "gpu")], env=env,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return r.stdout.strip()

    return restore, hashlib.sha256(data).hexdigest()


def test_carried_candidates_are_checked_before_choose_serves_them(tmp_path):
    """The judged run over two sessions: the later one's scale_choose joins the carried parts, and parts that do not
    join to the sha256 the first session recorded (one missing, another run's) fail the stage in one line before
    anything is served; the right ones are unpacked where train writes its candidates."""
    restore, right = carried(tmp_path, "scale_candidates", {"draft/candidates/step_00000001/config.json": "{}"},
                             "KE_SCALE_CARRIED_CANDIDATES", "s.restore_candidates()")
    said = restore("0" * 64)
    assert said.startswith("failed: carried candidates: 2 part(s) join to sha256 ") and "0" * 64 in said, said
    assert not (tmp_path / "shm" / "scale" / "draft").exists()
    assert right in restore(right)
    assert (tmp_path / "shm" / "scale" / "draft" / "candidates" / "step_00000001" / "config.json").is_file()


def test_a_carried_export_is_checked_and_evaluated_without_training_or_serving_again(tmp_path):
    """Train and choose in one session (KE_SCALE_PACK_EXPORT=1), the evaluations in the next: with
    KE_SCALE_CARRIED_EXPORT, scale_choose needs only the target and vLLM (no scale_data, no scale_train), puts the
    chosen export back where choose installs it (eval reads its training record and choice there) and names the
    choice; parts of another run fail it in one line."""
    choice = {"chosen_step": 2286, "why": "highest acceptance length at k=5"}
    restore, right = carried(tmp_path, "scale_export", {"export/config.json": "{}",
                                                        "export/selection.json": json.dumps(choice)},
                             "KE_SCALE_CARRIED_EXPORT", "s.st_scale_choose(None) | "
                             "{'needs': dict((n, w) for n, _, w in s.LANE0 + s.LANE1)['scale_choose']}")
    said = restore("0" * 64)
    assert said.startswith("failed: carried export: 2 part(s) join to sha256 ") and "KE_SCALE_CARRIED_EXPORT" in said
    assert not (tmp_path / "shm" / "scale" / "draft").exists()
    rec = json.loads(restore(right))
    assert rec["carried_export"]["sha256"] == right and rec["chosen_step"] == 2286 and rec["why"] == choice["why"]
    assert rec["needs"] == ["smol_model", "bundle-vllm"]
    assert json.loads((tmp_path / "shm" / "scale" / "draft" / "export" / "selection.json").read_text()) == choice


def test_a_call_whose_output_is_cut_short_does_not_start_a_second_runner(tmp_path):
    """`... | head -3` closes the call's stdout: "runner already running" then raises BrokenPipeError. That error once
    read as "no runner", so each such call started another runner on the same stages and folders."""
    nothing = tmp_path / "carried"
    nothing.mkdir()
    pid_file = tmp_path / "work" / "runner.pid"
    try:
        assert campaign(tmp_path, "absorb", "--from", str(nothing)).returncode == 0
        assert "runner started" in campaign(tmp_path, "start").stdout
        first = pid_file.read_text()
        for _ in range(2):
            read_end, write_end = os.pipe()
            os.close(read_end)   # whatever the call prints meets a closed pipe
            subprocess.run([sys.executable, str(RUNNER), "start"], env=campaign_env(tmp_path, PYTHONUNBUFFERED="1"),
                           stdout=write_end, stderr=subprocess.DEVNULL, timeout=60)
            os.close(write_end)
        assert pid_file.read_text() == first, "a second runner was started beside the first"
        os.kill(int(first), 0)   # and the first still runs
    finally:
        stop_runner(tmp_path)
