"""1 GiB upload through kimi-eagle vs OpenSSH scp to the same loopback sshd, in the same run.

    python bench/upload_vs_scp.py [--size-mib 1024] [--repeat 3]

Prints a JSON report: MiB/s of each, their ratio, and what a second deploy of the unchanged file sends.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _common import REPO, Bench, median


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--size-mib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    b = Bench()
    try:
        src = b.tmp / "payload.bin"
        with open(src, "wb") as f:
            for _ in range(a.size_mib):
                f.write(os.urandom(1 << 20))
        env = {**os.environ, "PYTHONPATH": str(REPO), "KIMI_EAGLE_INVENTORY": str(b.inventory)}
        scp_base = ["scp", "-q", "-o", "BatchMode=yes", "-o", f"UserKnownHostsFile={b.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                    "-i", str(b.sshd.client_key), "-P", str(b.sshd.port)]
        runs = {"scp (default cipher)": [], "scp -c aes128-gcm": [], "kimi-eagle upload": [], "kimi-eagle upload (paramiko only)": []}
        for i in range(a.repeat):
            for name in runs:
                dest = b.tmp / f"dest-{i}-{len(runs[name])}-{abs(hash(name))}"
                t0 = time.perf_counter()
                if name.startswith("scp"):
                    extra = ["-c", "aes128-gcm@openssh.com"] if "gcm" in name else []
                    subprocess.run(scp_base + extra + [str(src), f"root@127.0.0.1:{dest}.bin"], check=True)
                else:
                    e = dict(env, KIMI_EAGLE_OPENSSH="0" if "paramiko" in name else "1")
                    subprocess.run([sys.executable, "-m", "kimi_eagle", "upload", str(src), "--host", "gpu", "--to", str(dest)],
                                   check=True, env=e, stdout=subprocess.DEVNULL)
                runs[name].append(a.size_mib / (time.perf_counter() - t0))
                for leftover in b.tmp.glob("dest-*"):  # keep the disk from filling up across repeats
                    subprocess.run(["rm", "-rf", str(leftover)], check=True)
        # A second deploy of the unchanged file: nothing may travel.
        dest = b.tmp / "again"
        subprocess.run([sys.executable, "-m", "kimi_eagle", "upload", str(src), "--host", "gpu", "--to", str(dest)], check=True, env=env,
                       stdout=subprocess.DEVNULL)
        t0 = time.perf_counter()
        again = subprocess.run([sys.executable, "-m", "kimi_eagle", "--json", "upload", str(src), "--host", "gpu", "--to", str(dest)],
                               check=True, env=env, capture_output=True, text=True)
        again_s = time.perf_counter() - t0
        mibs = {k: round(median(v), 1) for k, v in runs.items()}
        report = {
            "size_mib": a.size_mib,
            "repeat": a.repeat,
            "median_mib_s": mibs,
            "ratio_vs_scp_default": round(mibs["kimi-eagle upload"] / mibs["scp (default cipher)"], 2),
            "ratio_vs_scp_gcm": round(mibs["kimi-eagle upload"] / mibs["scp -c aes128-gcm"], 2),
            "ratio_paramiko_only_vs_scp_default": round(mibs["kimi-eagle upload (paramiko only)"] / mibs["scp (default cipher)"], 2),
            "second_deploy_bytes_sent": json.loads(again.stdout)[0]["bytes_sent"],
            "second_deploy_seconds": round(again_s, 2),
            "note": "kimi-eagle times include process start, connect, hashing on both sides and the atomic rename",
        }
        print(json.dumps(report, indent=2))
    finally:
        b.close()


if __name__ == "__main__":
    main()
