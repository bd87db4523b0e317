"""CPU scaling of sharded extraction across loopback "hosts": `run extract` on one host vs the same samples
sharded over two hosts (`run extract --group`), each host one sshd with its own workdir and one CPU thread.

    python bench/group_extract_scaling.py [--rows 160] [--words 300] [--seq-len 512]

Both runs extract the same prepared samples with the same tiny random Kimi-style model; the prepared data is
made once and copied to the second host. Reports wall time from `run` to the last host's exit, and the
tokens/s of the extraction phase the step itself reports (model loading excluded).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from sshd import Sshd  # noqa: E402


def cli(inv: Path, home: Path, *args) -> subprocess.CompletedProcess:
    env = {**os.environ, "NO_COLOR": "1", "PYTHONPATH": str(REPO), "HOME": str(home)}
    return subprocess.run([sys.executable, "-m", "kimi_eagle", "--inventory", str(inv), *args], capture_output=True,
                          text=True, env=env, timeout=3600)


def results(stdout: str) -> list[dict]:
    out = []
    for line in stdout.splitlines():
        m = re.match(r"^\[[^\]]+\] (\{.*\"step\": \"extract\".*\})$", line)
        if m:
            out.append(json.loads(m.group(1)))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=160)
    ap.add_argument("--words", type=int, default=300)
    ap.add_argument("--seq-len", type=int, default=512)
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="kimi-eagle-bench-"))
    servers = {n: Sshd(tmp / f"sshd-{n}").start() for n in "ab"}
    try:
        home = tmp / "home"
        (home / ".ssh").mkdir(parents=True)
        known = tmp / "known_hosts"
        known.write_text("".join(s.host_key_line() for s in servers.values()))
        data = tmp / "chat.jsonl"
        subprocess.run([sys.executable, str(REPO / "bench" / "make_chat_dataset.py"), "--rows", str(a.rows),
                        "--words", str(a.words), "--out", str(data)], check=True)
        hosts = "".join(f"""  {n}:
    address: 127.0.0.1
    port: {s.port}
    user: root
    identity_file: {s.client_key}
    known_hosts: {known}
    python: {sys.executable}
    workdir: {tmp / f"work-{n}"}
    env: {{PYTHONPATH: "{REPO}", OMP_NUM_THREADS: "1", MKL_NUM_THREADS: "1", HF_HUB_OFFLINE: "1"}}
""" for n, s in servers.items())
        inv = tmp / "inventory.yaml"
        inv.write_text(f"""hosts:
{hosts}groups:
  pair: [a, b]
pipeline:
  tiny_model: kimi
  model: "{{workdir}}/models/tiny"
  dataset: {json.dumps(str(data))}
  engine: hf
  seq_len: {a.seq_len}
  batch_size: 4
""")
        r = cli(inv, home, "run", "prepare", "--host", "a", "--no-preflight")
        assert r.returncode == 0, r.stderr
        for sub in ("models", "out/prepared"):
            shutil.copytree(tmp / "work-a" / sub, tmp / "work-b" / sub)
        rows = {}
        for label, args in (("1 host", ["--host", "a"]), ("2 hosts", ["--group", "pair"])):
            for n in "ab":
                shutil.rmtree(tmp / f"work-{n}" / "out" / "hidden_states", ignore_errors=True)
            t0 = time.monotonic()
            r = cli(inv, home, "run", "extract", *args, "--no-preflight", "--no-gpu")
            wall = time.monotonic() - t0
            assert r.returncode == 0, r.stderr[-2000:]
            res = results(r.stdout)
            tokens = sum(x["tokens"] for x in res)
            phase = max(x["extract_seconds"] for x in res)
            rows[label] = (wall, tokens, tokens / phase)
            print(f"{label}: wall {wall:.1f}s, {tokens} tokens, extraction phase {tokens / phase:.0f} tokens/s "
                  f"({len(res)} shard(s))")
        (w1, _, t1), (w2, _, t2) = rows["1 host"], rows["2 hosts"]
        print(f"2 hosts vs 1: wall {w1 / w2:.2f}x faster, extraction phase {t2 / t1:.2f}x the tokens/s")
    finally:
        for s in servers.values():
            s.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
