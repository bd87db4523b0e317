"""Uploads under pressure, against the real sshd: two at once, killed midway, a full disk, a read-only folder.

Every temporary file is unique to its call; what is renamed into place is exactly what that call sent.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO


def _sha(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _start_upload(env, src: Path, host: str = "gpu", to: str = "incoming"):
    e = {**os.environ, "HOME": str(env.home), "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "kimi_eagle", "--inventory", str(env.inventory), "upload", str(src),
                             "--host", host, "--to", to], env=e, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("size", [300_000, 40 << 20], ids=["sftp", "openssh"])
def test_two_uploads_of_one_name_at_once_never_mix(env, tmp_path, size):
    """Different bytes to one name at once, several rounds: the file holds one upload's bytes whole; an upload that
    says it succeeded alone left its own bytes; no temporary file is left behind."""
    target = env.workdir / "incoming" / "blob.bin"
    for rnd in range(3):
        srcs = []
        for k in range(2):
            d = tmp_path / f"r{rnd}-{k}"
            d.mkdir()
            (d / "blob.bin").write_bytes(os.urandom(size))
            srcs.append(d / "blob.bin")
        procs = [_start_upload(env, s) for s in srcs]
        results = [(p.wait(120), *p.communicate()) for p in procs]
        ok = [i for i, (rc, _, _) in enumerate(results) if rc == 0]
        for rc, out, err in results:
            assert rc in (0, 1) and "Traceback" not in err, err
            if rc:  # a failed host is one line, labelled by host
                assert len((out + err).strip().splitlines()) == 1, out + err
        assert ok, results
        digest = _sha(target)
        assert digest in {_sha(s) for s in srcs}, f"round {rnd}: the file holds neither upload whole"
        if len(ok) == 1:
            assert digest == _sha(srcs[ok[0]]), f"round {rnd}: the upload that succeeded alone does not hold the path"
        assert not list(target.parent.glob("*.part")), list(target.parent.iterdir())


def test_killed_upload_leaves_no_part_file(env, tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as f:
        for _ in range(48):
            f.write(os.urandom(4 << 20))
    target_dir = env.workdir / "incoming"
    for rnd in range(2):
        proc = _start_upload(env, big)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            parts = list(target_dir.glob(".big.bin.*.part")) if target_dir.exists() else []
            if parts and parts[0].stat().st_size > (8 << 20):
                break
            time.sleep(0.02)
        else:
            pytest.fail("upload never started")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert not (target_dir / "big.bin").exists()
        # The host side notices the controller is gone and removes what it was writing.
        deadline = time.monotonic() + 10
        while list(target_dir.glob("*.part")) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not list(target_dir.glob("*.part")), list(target_dir.iterdir())


def test_a_stale_part_from_an_older_upload_is_removed_by_the_next_one(env, tmp_path):
    """A .part whose writer died with the host side (no lease holds it) is swept by the next upload of that name."""
    target_dir = env.workdir / "incoming"
    target_dir.mkdir(parents=True)
    stale = [target_dir / ".f.txt.0123456789ab.part", target_dir / ".f.txt.part"]  # this version's and the old name
    for s in stale:
        s.write_bytes(b"half")
        os.utime(s, (time.time() - 60, time.time() - 60))
    other = target_dir / ".g.txt.0123456789ab.part"  # another name's: not ours to touch
    other.write_bytes(b"x")
    src = tmp_path / "f.txt"
    src.write_text("hello\n")
    r = env.cli("upload", str(src), "--host", "gpu", "--to", "incoming")
    assert r.code == 0, r.stderr
    assert not any(s.exists() for s in stale) and other.exists()


def _mount_tmpfs(path: Path, opts: str):
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(path)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {r.stderr.strip()}")


@pytest.mark.parametrize("size", [3 << 20, 40 << 20], ids=["sftp", "openssh"])
def test_disk_full_is_one_line_and_leaves_nothing(env, tmp_path, size):
    small = env.workdir / "small"
    _mount_tmpfs(small, "size=2m")
    try:
        (small / "keep.txt").write_text("before\n")
        src = tmp_path / "big.bin"
        src.write_bytes(os.urandom(size))
        r = env.cli("upload", str(src), "--host", "gpu", "--to", str(small))
        assert r.code == 1, (r.stdout, r.stderr)
        msg = (r.stdout + r.stderr).strip()
        assert len(msg.splitlines()) == 1 and f"no space left on gpu:{small}" in msg, msg
        assert sorted(p.name for p in small.iterdir()) == ["keep.txt"]
    finally:
        subprocess.run(["umount", "-l", str(small)])


def test_read_only_folder_is_one_line(env, tmp_path):
    ro = env.workdir / "ro"
    _mount_tmpfs(ro, "size=1m,ro")
    try:
        src = tmp_path / "f.txt"
        src.write_text("x\n")
        r = env.cli("upload", str(src), "--host", "gpu", "--to", str(ro))
        assert r.code == 1, (r.stdout, r.stderr)
        msg = (r.stdout + r.stderr).strip()
        assert len(msg.splitlines()) == 1 and f"gpu:{ro} is read-only" in msg, msg
    finally:
        subprocess.run(["umount", "-l", str(ro)])


def test_a_folder_in_the_way_of_one_file_replaces_none_of_them(env, tmp_path):
    """`upload d` where the host's d/b.txt is a folder: the files before it were replaced, then the rename failed
    naming a temporary file (exit 1). Every destination is checked before the first rename: one line, exit 2."""
    src = tmp_path / "d"
    src.mkdir()
    (src / "a.txt").write_text("new a\n")
    (src / "b.txt").write_text("new b\n")
    dest = env.workdir / "incoming" / "d"
    (dest / "b.txt").mkdir(parents=True)
    (dest / "a.txt").write_text("old a\n")
    r = env.cli("upload", str(src), "--host", "gpu", "--to", "incoming")
    msg = (r.stdout + r.stderr).strip()
    assert r.code == 2 and len(msg.splitlines()) == 1, (r.code, msg)
    assert f"gpu:{dest / 'b.txt'} is a folder" in msg and "nothing was replaced" in msg, msg
    assert (dest / "a.txt").read_text() == "old a\n" and sorted(p.name for p in dest.iterdir()) == ["a.txt", "b.txt"]
