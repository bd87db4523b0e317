"""End to end on a real GPU host over SSH, driven through the CLI as a user would.

Run by bench/gpu/gpu_e2e.sh (which provides sshd/ssh from carried Debian packages and the wheels).
Sizes come from the environment so the same flow can be rehearsed on a CPU box:
E2E_HIDDEN (2048), E2E_LAYERS (20), E2E_VOCAB (32000), E2E_ROWS (600), E2E_WORDS (600), E2E_BATCH (16).
Writes $OUT/report.json, $OUT/report.md and $OUT/cli.log.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from loopback_host import controller_site, host_entry, openssh_on_path, start_sshd  # noqa: E402

PY = sys.executable
OUT = Path(os.environ.get("OUT") or ROOT / "out").resolve()
OUT.mkdir(parents=True, exist_ok=True)
E = {k: int(os.environ.get(f"E2E_{k}", v)) for k, v in
     dict(HIDDEN=2048, LAYERS=20, VOCAB=32000, ROWS=600, WORDS=600, BATCH=16, SEQ=2048).items()}
SMI = shutil.which("nvidia-smi") or ("/usr/local/nvidia/bin/nvidia-smi" if os.path.exists("/usr/local/nvidia/bin/nvidia-smi") else None)
TMP = Path(tempfile.mkdtemp(prefix="kimi-eagle-e2e-"))
WORK = TMP / "work"
SPEC_SITE = TMP / "spec-site"
LOG = open(OUT / "cli.log", "w")
report: dict = {"sizes": E, "steps": {}}


def cli(*args, check=True, timeout=900, env=None):
    e = {**os.environ, "KIMI_EAGLE_INVENTORY": str(TMP / "inventory.yaml"), "NO_COLOR": "1", "COLUMNS": "160",
         "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(TMP / "ctl-site"), str(ROOT)])),
         **(env or {})}
    t0 = time.perf_counter()
    p = subprocess.run([PY, "-m", "kimi_eagle", *args], capture_output=True, text=True, env=e, timeout=timeout)
    secs = time.perf_counter() - t0
    LOG.write(f"\n$ kimi-eagle {' '.join(args)}   # exit {p.returncode}, {secs:.2f}s\n{p.stdout}{p.stderr}")
    LOG.flush()
    if check and p.returncode != 0:
        raise SystemExit(f"kimi-eagle {' '.join(args)} exited {p.returncode}: {p.stderr[-1500:]}")
    return p.returncode, p.stdout, p.stderr, secs


def step(name, **fields):
    report["steps"][name] = fields
    print(f"[e2e] {name}: {json.dumps(fields)[:300]}", flush=True)


def gpu_mem():
    if not SMI:
        return None
    out = subprocess.run([SMI, "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    return [int(x) for x in out.split()]


def follow(job_id, timeout=1800):
    return cli("logs", job_id, "--follow", timeout=timeout, check=False)


def main():
    controller_site(PY, TMP / "ctl-site")   # cli() puts TMP/ctl-site on PYTHONPATH
    openssh_on_path(TMP)
    sshd, known = start_sshd(TMP)
    subprocess.run([PY, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(SPEC_SITE),
                    *map(str, (ROOT / ".whl" / "spec").glob("speculators-0.3.0-*.whl"))], check=True)
    (TMP / "inventory.yaml").write_text("hosts:\n" + host_entry("h200", sshd, known, python=PY, workdir=WORK,
                                                               env={"PYTHONPATH": str(SPEC_SITE)}) + f"""pipeline:
  model: "{{workdir}}/models/llama-1b"
  dataset: "{{workdir}}/data/chat.jsonl"
  output_dir: "{{workdir}}/out"
  engine: hf
  seq_len: {E['SEQ']}
  batch_size: {E['BATCH']}
  draft_vocab_size: {min(8192, E['VOCAB'] // 2)}
  epochs: 1
  lr: 0.0003
  ttt_steps: 3
""")
    # 1. Host keys: refused until trusted, then every command connects.
    rc, out, err, _ = cli("hosts", "check", "h200", check=False)
    refused = rc == 1 and "unknown host key" in (out + err)
    cli("hosts", "trust", "h200", "--yes")
    _, out, _, secs = cli("--json", "hosts", "check", "h200")
    probe = json.loads(out)[0]
    step("hosts_check", unknown_key_refused=refused, seconds=round(secs, 2), python=probe["python"],
         torch=probe["packages"]["torch"], torch_cuda=probe["torch_cuda"], gpus=probe["gpus"])

    # 2. The dataset travels by upload; a second upload sends nothing.
    data = TMP / "chat.jsonl"
    subprocess.run([PY, str(ROOT / "bench" / "make_chat_dataset.py"), "--rows", str(E["ROWS"]), "--words", str(E["WORDS"]),
                    "--out", str(data)], check=True)
    _, out, _, secs = cli("--json", "upload", str(data), "--host", "h200", "--to", "data")
    _, out2, _, secs2 = cli("--json", "upload", str(data), "--host", "h200", "--to", "data")
    step("upload_dataset", bytes=data.stat().st_size, seconds=round(secs, 2), second_bytes_sent=json.loads(out2)[0]["bytes_sent"],
         second_seconds=round(secs2, 2))

    # 3. deploy-patch against the real speculators 0.3.0 sources.
    res = {}
    for mode in (["--check"], [], []):
        rc, out, _, secs = cli("--json", "deploy-patch", "--host", "h200", *mode, check=False)
        res.setdefault("runs", []).append({"mode": mode[0] if mode else "apply", "exit": rc, "seconds": round(secs, 2),
                                           "statuses": [f["status"] for f in json.loads(out)[0].get("files", [])]})
    step("deploy_patch", **res)

    # 4. A ~1B-parameter random model (bf16), built on the host by a detached job.
    _, out, _, _ = cli("--json", "run", "exec", "--host", "h200", "--detach", "--no-gpu", "--", PY,
                       "-m", "kimi_eagle_host.pipeline.tiny_model", "--kind", "llama", "--hidden", str(E["HIDDEN"]),
                       "--layers", str(E["LAYERS"]), "--vocab", str(E["VOCAB"]), "--heads", str(max(1, E["HIDDEN"] // 128)),
                       "--dtype", "bf16", "--out", "models/llama-1b")
    job = json.loads(out)["id"]
    rc, out, _, secs = follow(job)
    params = re.search(r'"parameters": (\d+)', out)
    step("build_model", exit=rc, seconds=round(secs, 1), parameters=int(params.group(1)) if params else None)

    # 5. gpu-reset with a stale holder of ours (a job's orphan) and a foreign holder.
    if SMI:
        before = gpu_mem()
        ready_ours, ready_foreign = TMP / "ours.ready", TMP / "foreign.ready"
        holder = str(ROOT / "bench" / "gpu" / "gpu_holder.py")
        cli("run", "exec", "--host", "h200", "--detach", "--no-gpu", "--", PY, "-c",
            "import subprocess, sys; subprocess.Popen([sys.executable, %r, '--gib', '8', '--ready-file', %r])" % (holder, str(ready_ours)))
        foreign = subprocess.Popen([PY, holder, "--gib", "4", "--new-session", "--ready-file", str(ready_foreign)])
        deadline = time.time() + 120
        while not (ready_ours.exists() and ready_foreign.exists()) and time.time() < deadline:
            time.sleep(0.2)
        held = gpu_mem()
        rc, out, _, secs = cli("--json", "gpu-reset", "--host", "h200", "--grace", "5", check=False)
        after = gpu_mem()
        doc = json.loads(out)[0]
        step("gpu_reset", exit=rc, seconds_command_to_verified_free=round(secs, 2), payload_elapsed_s=doc.get("elapsed_s"),
             mem_before_mib=before, mem_with_holders_mib=held, mem_after_mib=after,
             holders=[{k: h.get(k) for k in ("pid", "owner", "action", "result", "mem_mib")} for h in doc.get("holders", [])],
             foreign_alive=foreign.poll() is None)
        # --all --yes: the holders its own dry run listed (pid and start time) are stopped, the foreign one among them
        rc, out, _, secs = cli("--json", "gpu-reset", "--host", "h200", "--all", "--yes", "--grace", "5", check=False)
        doc = json.loads(out)[0]
        time.sleep(0.5)
        step("gpu_reset_all", exit=rc, seconds=round(secs, 2), mem_after_mib=gpu_mem(),
             holders=[{k: h.get(k) for k in ("pid", "owner", "action", "result", "mem_mib")} for h in doc.get("holders", [])],
             foreign_alive=foreign.poll() is None)
        foreign.kill()
        foreign.wait()
    else:
        step("gpu_reset", skipped="no nvidia-smi on this machine")

    # 6. preflight, then the whole pipeline as one detached chain, followed through a forced SSH drop.
    rc, out, _, secs = cli("--json", "preflight", "all", "--host", "h200", check=False)
    checks = json.loads(out)[0]["checks"]
    step("preflight", exit=rc, seconds=round(secs, 2), checks={c["name"]: c["status"] for c in checks},
         details={c["name"]: c["detail"] for c in checks if c["name"] in ("gpu", "trainer", "gpu_lock", "storage")})
    _, out, _, _ = cli("--json", "run", "all", "--host", "h200", "--detach", "--no-preflight")
    job = json.loads(out)
    env = {**os.environ, "KIMI_EAGLE_INVENTORY": str(TMP / "inventory.yaml"), "NO_COLOR": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("PYTHONPATH"), str(TMP / "ctl-site"), str(ROOT)]))}
    t0 = time.perf_counter()
    follower = subprocess.Popen([PY, "-m", "kimi_eagle", "logs", job["id"], "--follow"], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
    log_path = Path(job["log"])
    # (a job that ends before its extract, e.g. a failed prepare, ends the wait too: the follower has returned)
    while time.perf_counter() - t0 < 600 and follower.poll() is None and \
            "step extract" not in (log_path.read_text(errors="replace") if log_path.exists() else ""):
        time.sleep(0.2)
    dropped_at = round(time.perf_counter() - t0, 1)
    sshd.restart()  # every SSH connection dies; the job must not notice, the follower must resume
    fout, ferr = follower.communicate(timeout=1800)
    LOG.write(f"\n$ kimi-eagle logs {job['id']} --follow   # exit {follower.returncode}\n{fout}{ferr}")
    # Every log line exactly once: what the follower printed vs the log file split the same way
    # (progress-bar redraws excluded on both sides; the follower prints a finished bar as "k/n done").
    from kimi_eagle.jobs.log_stream import LineSplitter
    from kimi_eagle.jobs.log_printer import POINT_MARK, parse_progress

    events = []
    splitter = LineSplitter(lambda kind, text: events.append((kind, text)))
    splitter.feed(log_path.read_bytes())
    splitter.flush()
    on_disk = [t for k, t in events if k == "line" and not parse_progress(t) and not t.startswith(POINT_MARK)]
    # (the follower shows a progress point off a terminal as "name k/n (p%) ..." or "name: k/n done")
    followed_lines = [ln[len("[h200] "):] for ln in fout.splitlines()
                      if ln.startswith("[h200] ") and not re.search(r": \d+/\d+ done$|^\S+ \d+/\d+ \(\d+%\)", ln[7:])]
    # the controller's last word after the job (where the draft is, what to run next) is not the log's
    last_word = next((i for i, ln in enumerate(followed_lines) if ln.startswith("draft exported to ")), None)
    followed_lines = followed_lines[:last_word]
    _, out, _, _ = cli("--json", "status", job["id"], "--host", "h200", check=False)
    st = json.loads(out)["jobs"][0]
    text = log_path.read_text(errors="replace")
    ex = re.search(r'\{"ok": true, "step": "extract".*\}', text)
    tr = [float(x) for x in re.findall(r"tok/s (\d+)", text)]
    step("run_all", exit=follower.returncode, state=st["state"], exit_code=st["exit_code"], runtime_s=st["runtime_s"],
         ssh_dropped_after_s=dropped_at, reconnected="reconnecting" in ferr,
         lines_followed=len(followed_lines), lines_in_log=len(on_disk), every_line_exactly_once=followed_lines == on_disk,
         not_followed=[ln for ln in on_disk if ln not in followed_lines][:5],
         not_in_log=[ln for ln in followed_lines if ln not in on_disk][:5],
         extract=json.loads(ex.group(0)) if ex else None,
         train_tokens_per_s_median=sorted(tr)[len(tr) // 2] if tr else None)

    # 7. stop a running GPU job: its whole process group goes, its GPU memory comes back.
    _, out, _, _ = cli("--json", "run", "train", "--host", "h200", "--detach", "--no-preflight", "--",
                       "--epochs", "1000", "--save-every", "1000000")
    job2 = json.loads(out)["id"]
    time.sleep(25)
    mem_running = gpu_mem()
    rc, out, _, secs = cli("--json", "stop", job2, "--host", "h200", "--grace", "10", check=False)
    time.sleep(1)
    step("stop", exit=rc, seconds=round(secs, 2), result={k: json.loads(out).get(k) for k in ("stopped", "sent", "remaining", "elapsed_s", "state")},
         mem_running_mib=mem_running, mem_after_mib=gpu_mem())

    # 8. Extraction throughput against the naive loop, and of the GPU's peak.
    if SMI:
        shm = Path("/dev/shm") / "kimi-eagle-extract-bench"
        res = subprocess.run([PY, str(ROOT / "bench" / "gpu" / "extract_bench.py"), "--model", str(WORK / "models" / "llama-1b"),
                              "--prepared", str(WORK / "out" / "prepared"), "--out", str(shm), "--batch-size", str(E["BATCH"]),
                              "--seq-len", str(E["SEQ"])], capture_output=True, text=True)
        LOG.write(f"\n$ extract_bench\n{res.stdout}{res.stderr[-3000:]}")
        step("extract_bench", **(json.loads(res.stdout) if res.returncode == 0 else {"error": res.stderr[-1500:]}))
        shutil.rmtree(shm, ignore_errors=True)
    sshd.stop()
    (OUT / "report.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    try:
        main()
    finally:
        (OUT / "report.json").write_text(json.dumps(report, indent=2))
        LOG.close()
        shutil.rmtree(TMP, ignore_errors=True)
