"""The checkpoints a training run exports for the choose step to serve (choose_checkpoints = N):

  <output-dir>/draft/candidates/step_XXXXXXXX/      config.json + model.safetensors (speculators Eagle3, as export/)
  <output-dir>/draft/candidates/candidates.json     the exported steps, the held-out documents (prepared sample
                                                    indices train never trained on) and the prepared data's sha256

They are exports, not resumable checkpoints (draft/checkpoints/ keeps those, pruned to keep_checkpoints): N of them,
spread evenly over the run, because served acceptance can peak early and fall (DeepSpec #84), so the best is often
not among the last few checkpoints. Written by rank 0 of train; read by pipeline/choose.py.
"""
import json
import math
import os
import re
import shutil

from kimi_eagle_host.step_runtime import BadInput, atomic_write_json

FOLDER = os.path.join("draft", "candidates")
RECORD = "candidates.json"
FORMAT = "kimi-eagle-candidates/1"
STEP_DIR_RE = re.compile(r"^step_(\d{8})$")


def steps(total: int, n: int) -> list[int]:
    """The optimizer steps (1-based, the last one included) whose weights are exported: n spread evenly."""
    if n <= 0:
        return []
    return sorted({max(1, math.ceil(total * i / n)) for i in range(1, n + 1)})


def folder(out: str, step: int | None = None) -> str:
    base = os.path.join(out, FOLDER)
    return base if step is None else os.path.join(base, f"step_{step:08d}")


def reset(out: str) -> None:
    """A run that starts from step 0 removes an earlier run's candidates: they were trained otherwise."""
    shutil.rmtree(folder(out), ignore_errors=True)


def record(out: str, held_docs: list[int], prepared_sha256: str | None, total: int) -> dict:
    """candidates.json from the exported folders now present (a resumed run keeps those of its first part)."""
    base = folder(out)
    found = sorted(int(m.group(1)) for n in os.listdir(base) if (m := STEP_DIR_RE.match(n))
                   and os.path.isfile(os.path.join(base, n, "config.json")))
    doc = {"format": FORMAT, "total_steps": total, "prepared_sha256": prepared_sha256,
           "heldout_documents": [int(d) for d in held_docs],
           "candidates": [{"step": s, "dir": os.path.basename(folder(out, s))} for s in found]}
    atomic_write_json(os.path.join(base, RECORD), doc)
    return doc


def read(out: str) -> dict:
    """candidates.json, each candidate's dir made absolute; BadInput when there is none to serve."""
    path = os.path.join(folder(out), RECORD)
    if not os.path.isfile(path):
        raise BadInput(f"{path}: missing (train with choose_checkpoints=N exports the checkpoints the choose step serves)")
    try:
        with open(path) as f:
            doc = json.load(f)
    except ValueError as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None
    if doc.get("format") != FORMAT or not doc.get("candidates"):
        raise BadInput(f"{path}: format {doc.get('format')!r} with {len(doc.get('candidates') or [])} candidates: "
                       f"expected {FORMAT!r} naming at least one")
    for c in doc["candidates"]:
        c["dir"] = os.path.join(folder(out), c["dir"])
    return doc
