"""Scaling from 1 to 2 GPUs on one host: extraction and training tokens/s, a training resumed on
another world size, and `stop` of a torchrun job leaving no process and no GPU memory.

    PYTHON=/path/to/python3 OUT=./out bash bench/gpu/gpu_scaling.sh

Everything goes through the same entry points a job uses: pipeline/launch.py decides one process or torchrun
workers from the visible GPUs (CUDA_VISIBLE_DEVICES picks 1 or 2), the steps are the payloads themselves, and
the stop phase renders the real job (kimi_eagle.jobs.direct.job_files: its script and settings.json, jinja2 only)
and drives the host-side job control (ops/jobs.py start/stop: what `kimi-eagle run`/`stop` call over SSH).

Writes $OUT/gpu_scaling.json after every phase (a timeout still leaves the phases done) and $OUT/gpu_scaling.log.
Sizes from the environment, so the flow can be rehearsed on a CPU box (then: 2 gloo workers instead of GPUs):
GS_HIDDEN (2048) GS_LAYERS (20) GS_VOCAB (32000) GS_ROWS (800) GS_WORDS (600) GS_SEQ (2048) GS_XBATCH (32)
GS_TBATCH (32) GS_TSTEPS (24) GS_DRAFT_VOCAB (8192) GS_WRITERS (16) GS_TIMEOUT_FACTOR (1).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
PAY = ROOT / "kimi_eagle_host"
sys.path.insert(0, str(ROOT))
# The steps run as `python -m kimi_eagle_host...`, as on a host: every process this bench starts finds the package.
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

PY = sys.executable
OUT = Path(os.environ.get("OUT") or ROOT / "out").resolve()
WORK = Path(os.environ.get("WORK", "/tmp/kimi-eagle-scaling"))
# Hidden states in memory, a folder of this run's own (two rehearsals at once, the suite's and a developer's, must
# not share one)
SHM = (Path("/dev/shm") if os.path.isdir("/dev/shm") else WORK) / f"kimi-eagle-scaling-{os.getpid()}"
S = {k: int(os.environ.get(f"GS_{k}", v)) for k, v in {
    "HIDDEN": 2048, "LAYERS": 20, "VOCAB": 32000, "ROWS": 800, "WORDS": 600, "SEQ": 2048, "XBATCH": 32,
    "TBATCH": 32, "TSTEPS": 24, "DRAFT_VOCAB": 8192, "WRITERS": 16}.items()}
LOG = OUT / "gpu_scaling.log"
REPORT = {"sizes": S, "phases": {}}
T0 = time.time()


def payload(rel: str) -> list[str]:
    """How the host's Python runs the host package's `rel` (e.g. "pipeline/train.py"): -m and its module."""
    return ["-m", "kimi_eagle_host." + rel.removesuffix(".py").replace("/", ".")]


def log(msg: str) -> None:
    line = f"[{time.time() - T0:7.1f}s] {msg}"
    print(line, file=sys.stderr, flush=True)
    with open(LOG, "a") as f:
        f.write(line + "\n")


def save() -> None:
    REPORT["elapsed_s"] = round(time.time() - T0, 1)
    tmp = OUT / ".gpu_scaling.json.tmp"
    tmp.write_text(json.dumps(REPORT, indent=1))
    os.replace(tmp, OUT / "gpu_scaling.json")


def run(cmd, env=None, timeout=240, name=""):
    """Run a payload; (exit code, its JSON answer or None, seconds). Its stderr goes to the log file."""
    timeout *= int(os.environ.get("GS_TIMEOUT_FACTOR", "1"))  # a slow CPU rehearsal may need more
    t = time.time()
    with open(LOG, "a") as lf:
        lf.write(f"\n===== {name}: {' '.join(map(str, cmd))}\n")
        lf.flush()
        p = subprocess.run([str(c) for c in cmd], stdout=subprocess.PIPE, stderr=lf, text=True,
                           env={**os.environ, **(env or {})}, timeout=timeout)
    secs = time.time() - t
    doc = None
    for line in reversed(p.stdout.strip().splitlines()):
        try:
            doc = json.loads(line)
            break
        except ValueError:
            continue
    log(f"{name}: exit {p.returncode} in {secs:.1f}s")
    return p.returncode, doc, secs


def gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def gpu_memory_used() -> list[int]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
        return [int(x) for x in out.split()]
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


def gpu_apps() -> list[str]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout
        return [line.strip() for line in out.splitlines() if line.strip()]
    except (OSError, subprocess.SubprocessError):
        return []


GPUS = gpu_count()
CPU_REHEARSAL = GPUS == 0
# Without GPUs, 2 gloo workers stand in for 2 GPUs (the flow, not the numbers).
NPROC = {1: ["--nproc-per-node", "1"], 2: ["--nproc-per-node", "2"]} if CPU_REHEARSAL else {1: [], 2: []}


def visible(n: int) -> dict:
    return {} if CPU_REHEARSAL else {"CUDA_VISIBLE_DEVICES": ",".join(str(i) for i in range(n))}


# ----------------------------------------------------------------------------------------------------

def setup() -> dict:
    model = WORK / "model"
    t = time.time()
    if not (model / "config.json").is_file():
        rc, doc, _ = run([PY, *payload("pipeline/tiny_model.py"), "--kind", "llama", "--hidden", S["HIDDEN"],
                          "--layers", S["LAYERS"], "--vocab", S["VOCAB"], "--heads", 16, "--dtype", "bf16",
                          "--out", model], name="build model", timeout=300)
        assert rc == 0, "model build failed (see the log)"
    run([PY, ROOT / "bench" / "make_chat_dataset.py", "--rows", S["ROWS"], "--words", S["WORDS"],
         "--out", WORK / "chat.jsonl"], name="dataset")
    rc, prep, _ = run([PY, *payload("pipeline/prepare.py"), "--model", model, "--dataset", WORK / "chat.jsonl",
                       "--output-dir", WORK, "--seq-len", S["SEQ"]], name="prepare")
    assert rc == 0, "prepare failed"
    rc, voc, _ = run([PY, *payload("pipeline/vocab.py"), "--model", model, "--output-dir", WORK,
                      "--draft-vocab-size", S["DRAFT_VOCAB"]], name="vocab")
    assert rc == 0, "vocab failed"
    import torch

    names = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           capture_output=True, text=True).stdout.strip().splitlines() if GPUS else []
    return {"model": str(model), "samples": prep.get("count"), "tokens": prep.get("tokens"),
            "seconds": round(time.time() - t, 1), "gpus": GPUS, "gpu_names": names, "cpu_rehearsal": CPU_REHEARSAL,
            "torch": torch.__version__, "cpus": os.cpu_count()}


def extract_run(label: str, n: int) -> dict:
    out = SHM / f"hs_{label}"
    shutil.rmtree(out, ignore_errors=True)
    cmd = [PY, *payload("pipeline/launch.py"), *NPROC[n], "--gpus-per-replica", "auto", "--",
           *payload("pipeline/extract.py"), "--model", WORK / "model", "--prepared-dir", WORK / "prepared",
           "--out", out, "--batch-size", S["XBATCH"], "--seq-len", S["SEQ"], "--writers", S["WRITERS"]]
    rc, doc, secs = run(cmd, env=visible(n), name=f"extract {label} ({n} GPU)", timeout=300)
    assert rc == 0 and doc and doc.get("ok"), f"extract {label} failed: {doc}"
    return {"gpus": n, "processes": doc.get("processes"), "tokens": doc["tokens"],
            "extract_tokens_per_s": doc["extract_tokens_per_s"], "extract_seconds": doc["extract_seconds"],
            "step_seconds": round(secs, 1), "out": str(out)}


def compare_outputs(a: Path, b: Path, count: int = 24) -> dict:
    """The same samples from 1 and 2 GPUs: token ids and masks equal; hidden states within bf16 noise
    (the batches differ, so the matmul shapes do)."""
    import torch
    from safetensors.torch import load_file

    names = sorted(p.name for p in a.glob("hs_*.safetensors"))
    step = max(1, len(names) // count)
    worst, exact, n = 0.0, 0, 0
    for name in names[::step]:
        x, y = load_file(str(a / name)), load_file(str(b / name))
        assert torch.equal(x["token_ids"], y["token_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"]), name
        d = (x["hidden_states"].float() - y["hidden_states"].float()).abs().max().item()
        scale = x["hidden_states"].float().abs().max().item() or 1.0
        worst = max(worst, d / scale)
        exact += int(torch.equal(x["hidden_states"], y["hidden_states"]))
        n += 1
    return {"files_1gpu": len(names), "files_2gpu": len(list(b.glob("hs_*.safetensors"))), "compared": n,
            "bitwise_equal": exact, "max_rel_diff": round(worst, 5)}


def extraction() -> dict:
    res = {"warmup_1gpu": extract_run("warmup", 1)}  # a fresh VM's RAM grows on first touch: warm it first
    shutil.rmtree(SHM / "hs_warmup", ignore_errors=True)
    save()
    res["one_gpu"] = extract_run("1gpu", 1)
    res["two_gpus"] = extract_run("2gpu", 2)
    res["speedup"] = round(res["two_gpus"]["extract_tokens_per_s"] / res["one_gpu"]["extract_tokens_per_s"], 2)
    res["same_outputs"] = compare_outputs(SHM / "hs_1gpu", SHM / "hs_2gpu")
    shutil.rmtree(SHM / "hs_1gpu", ignore_errors=True)
    return res


def train_dir(name: str) -> Path:
    d = WORK / name
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    (d / "hidden_states").symlink_to(SHM / "hs_2gpu")
    (d / "vocab").symlink_to(WORK / "vocab")
    return d


def step_rate(doc: dict) -> float | None:
    """Tokens/s of the logged steps after each run's first (CUDA/NCCL warm-up): their tokens over their time, so a
    slow step counts as it cost (train.py's history gives each interval's tokens and seconds)."""
    spans = [(h["tokens"], h["seconds"]) for h in doc.get("history", [])[1:] if h.get("seconds")]
    return round(sum(t for t, _ in spans) / sum(s for _, s in spans), 1) if spans else None


def training() -> dict:
    d = train_dir("train")
    half = S["TSTEPS"] // 2
    base = [*payload("pipeline/train.py"), "--model", WORK / "model", "--output-dir", d, "--batch-size", S["TBATCH"],
            "--ttt-steps", 3, "--epochs", 100, "--max-steps", S["TSTEPS"], "--log-every", 1, "--save-every", 1000]
    rc, a, _ = run([PY, *payload("pipeline/launch.py"), *NPROC[2], "--", *base, "--stop-at-step", half],
                   env=visible(2), name="train 2 GPUs, steps 1..half", timeout=300)
    assert rc == 0 and a and a.get("ok"), f"2-GPU training failed: {a}"
    rc, b, _ = run([PY, *payload("pipeline/launch.py"), *NPROC[1], "--", *base, "--resume"],
                   env=visible(1), name="train 1 GPU, resumed", timeout=300)
    assert rc == 0 and b and b.get("ok"), f"1-GPU resumed training failed: {b}"
    r2, r1 = step_rate(a), step_rate(b)
    return {
        "two_gpus": {"world_size": a["world_size"], "parallel": a["parallel"], "steps": [1, a["step"]],
                     "tokens_per_s": r2, "loop_tokens_per_s": a.get("train_tokens_per_s"),
                     "last_loss": a["history"][-1]["loss"], "peak_mem_gb": a.get("cuda_peak_mem_gb")},
        "one_gpu_resumed": {"world_size": b["world_size"], "resumed_from_step": b["resumed_from_step"],
                            "steps": [b["resumed_from_step"] + 1, b["step"]], "finished": b["finished"],
                            "tokens_per_s": r1, "loop_tokens_per_s": b.get("train_tokens_per_s"),
                            "first_loss": b["history"][0]["loss"], "last_loss": b["history"][-1]["loss"],
                            "exported": bool(b.get("export_dir")) and os.path.isfile(
                                os.path.join(b["export_dir"], "model.safetensors")),
                            "peak_mem_gb": b.get("cuda_peak_mem_gb")},
        "speedup": round(r2 / r1, 2) if r1 and r2 else None,
        "batch_size_global": S["TBATCH"],
    }


def job_processes(job_id: str) -> list[int]:
    """Pids still carrying the job's id: jobctl's own search for a job's processes outside its group."""
    from kimi_eagle_host.ops import jobs as jobctl

    return jobctl.group_members(-1, job_id)


class Unset(SimpleNamespace):
    """An inventory section as kimi_eagle reads it (attributes), without pydantic (not on the GPU machine): a
    setting not given here reads as unset (None), like one an inventory does not mention. A SimpleNamespace
    of the settings of the day broke each time the inventory gained one (model_source, steps, ...)."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None

    def model_dump(self) -> dict:   # what the run records as its settings (pydantic's name for it)
        return {k: (v.model_dump() if isinstance(v, Unset) else v) for k, v in vars(self).items()}


def train_job_files(host_dir: Path, d: Path, job_id: str):
    """(host, {path relative to host_dir: text}): what `kimi-eagle run train` uploads to start this job (its script,
    its settings.json and the record of its output folder). The script alone, as this bench wrote it until the
    settings moved into settings.json, started a job whose steps found no settings and exited 2."""
    from kimi_eagle.config import step_plan
    from kimi_eagle.hosts.session import payload_set
    from kimi_eagle.jobs import direct

    pipe = Unset(model=str(WORK / "model"), dataset=None, output_dir=str(d), engine="hf", seq_len=S["SEQ"],
                 batch_size=S["TBATCH"], tp_size=1, draft_vocab_size=S["DRAFT_VOCAB"], epochs=1000, lr=1e-4,
                 ttt_steps=3, nproc_per_node=2 if CPU_REHEARSAL else None, steps={}, report_to="none")
    env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    host = Unset(name="gpu-scaling", workdir=str(host_dir), env=env, python=PY, pipeline=pipe)
    session = Unset(host=host, payloads=payload_set().folder)   # the folder the job's scripts name
    files = direct.job_files(session, "train", ["--log-every", "1", "--save-every", "100000", "--max-steps", "100000"],
                             job_id)
    files.update(step_plan.output_record("train", session, job_id))
    return host, files


def stop_phase() -> dict:
    """A detached torchrun training job, stopped as `kimi-eagle stop` stops it, on the host side."""
    from kimi_eagle.hosts.session import payload_set
    from kimi_eagle.jobs import job_info

    host_dir = WORK / "jobhost"
    shutil.rmtree(host_dir, ignore_errors=True)
    (host_dir / ".kimi-eagle").mkdir(parents=True)
    # where `run` would deploy this checkout's payload set: its own folder, which the job's scripts name
    shutil.copytree(PAY, host_dir / payload_set().folder / "kimi_eagle_host", ignore=shutil.ignore_patterns("__pycache__"))
    d = train_dir("train_stop")
    job_id = job_info.new_job_id("train")
    host, files = train_job_files(host_dir, d, job_id)
    for rel, text in files.items():
        (host_dir / rel).parent.mkdir(parents=True, exist_ok=True)
        (host_dir / rel).write_text(text)
    jobctl = [PY, *payload("ops/jobs.py"), "--runs-dir", host_dir / "runs"]
    base_mem = gpu_memory_used()
    rc, started, _ = run([*jobctl, "start", "--job-id", job_id, "--step", "train", "--host", host.name,
                          "--workdir", host_dir, "--gpu"], name="job start")
    assert rc == 0 and started.get("started"), f"job did not start: {started}"
    logf = host_dir / "runs" / job_id / "log"
    t = time.time()
    try:
        while time.time() - t < 180:
            text = logf.read_text(errors="replace") if logf.exists() else ""
            if "step 3/" in text:
                break
            if "exited with code" in text:
                raise AssertionError("the job ended before it was stopped; see " + str(logf))
            time.sleep(0.5)
        else:
            raise AssertionError("the job logged no step 3 within 180 s")
        running_mem = gpu_memory_used()
        running_apps = gpu_apps()
        procs_before = job_processes(job_id)
        t_stop = time.time()
        rc, stopped, _ = run([*jobctl, "stop", "--job", job_id, "--grace", "60"], name="job stop")
        stop_s = time.time() - t_stop
    except BaseException:
        run([*jobctl, "stop", "--job", job_id, "--grace", "10"], name="job stop (cleanup)")  # leave nothing behind
        raise
    left = job_processes(job_id)
    mem_after, apps_after = gpu_memory_used(), gpu_apps()
    for _ in range(20):  # the driver may release memory a moment after the processes are gone
        if not apps_after and (not base_mem or all(m <= b + 64 for m, b in zip(mem_after, base_mem))):
            break
        time.sleep(0.5)
        mem_after, apps_after = gpu_memory_used(), gpu_apps()
    log_text = logf.read_text(errors="replace")
    ckpts = sorted((d / "draft" / "checkpoints").glob("step_*.pt"))
    return {
        "job_id": job_id, "job_processes_while_running": len(procs_before), "gpu_apps_while_running": running_apps,
        "gpu_mem_mib_before": base_mem, "gpu_mem_mib_running": running_mem, "gpu_mem_mib_after": mem_after,
        "gpu_apps_after": apps_after, "processes_left": left, "stop_exit": rc,
        "stop_reply": {k: (stopped or {}).get(k) for k in ("stopped", "state", "sent", "remaining", "elapsed_s")},
        "stop_seconds": round(stop_s, 2), "sigterm_checkpoint": ckpts[-1].name if ckpts else None,
        "log_says_sigterm": "SIGTERM received" in log_text,
        "torchrun_line": next((line for line in log_text.splitlines() if "==> kimi-eagle: torchrun" in line), None),
        "ok": rc == 0 and not left and not apps_after and bool(ckpts),
    }


def fsdp() -> dict:
    """The same training with FSDP2 on 2 GPUs (what --parallel auto picks for a draft too big for one GPU)."""
    d = train_dir("train_fsdp")
    rc, a, _ = run([PY, *payload("pipeline/launch.py"), *NPROC[2], "--", *payload("pipeline/train.py"), "--model",
                    WORK / "model", "--output-dir", d, "--batch-size", S["TBATCH"], "--ttt-steps", 3, "--epochs", 100,
                    "--max-steps", S["TSTEPS"], "--stop-at-step", S["TSTEPS"] // 2, "--log-every", 1,
                    "--save-every", 1000, "--parallel", "fsdp"], env=visible(2), name="train 2 GPUs FSDP", timeout=300)
    assert rc == 0 and a and a.get("ok"), f"FSDP training failed: {a}"
    ddp = REPORT["phases"].get("training", {}).get("two_gpus", {})
    return {"parallel": a["parallel"], "world_size": a["world_size"], "tokens_per_s": step_rate(a),
            "peak_mem_gb": a.get("cuda_peak_mem_gb"), "losses": [round(h["loss"], 4) for h in a["history"]],
            "ddp_last_loss_same_steps": ddp.get("last_loss")}


def main() -> int:
    OUT.mkdir(parents=True, exist_ok=True)
    WORK.mkdir(parents=True, exist_ok=True)
    SHM.mkdir(parents=True, exist_ok=True)
    LOG.write_text("")
    os.environ.update({"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
                       "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"})
    code = 0
    for name, fn in (("setup", setup), ("extraction", extraction), ("training", training), ("stop", stop_phase),
                     ("fsdp", fsdp)):
        try:
            REPORT["phases"][name] = fn()
        except Exception as e:  # noqa: BLE001 - record and go on: the other phases' numbers still count
            REPORT["phases"][name] = {"error": f"{type(e).__name__}: {e}"}
            log(f"{name} FAILED: {type(e).__name__}: {e}")
            code = 1
            if name in ("setup", "extraction"):  # the later phases need the model / the hidden states
                break
        save()
        log(f"{name}: {json.dumps(REPORT['phases'][name])[:600]}")
    shutil.rmtree(SHM, ignore_errors=True)
    save()
    if LOG.stat().st_size > 12 << 20:  # what comes back from the GPU machine is capped: keep the end
        with open(LOG, "rb") as f:
            f.seek(-(12 << 20), os.SEEK_END)
            tail = f.read()
        LOG.write_bytes(b"[... log truncated to its last 12 MiB ...]\n" + tail)
    print(json.dumps(REPORT, indent=1))
    return code


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))
    sys.exit(main())
