#!/usr/bin/env python3
"""Pipeline step 1: chat JSONL → token ids + assistant-only loss masks, ready for hidden-state extraction.

--dataset is a chat JSONL file or a dataset name (`sharegpt`: see data_sources.py, which records where it came
from). Input rows (one JSON object per line, blank lines ignored), either shape:
  ShareGPT: {"conversations": [{"from": "system"|"human"|"gpt", "value": "..."}, ...]}
  OpenAI:   {"messages": [{"role": "system"|"user"|"assistant", "content": "..." | [{"type": "text", "text": ...}]}]}
            an assistant message may carry "reasoning_content" (a thinking target's reasoning apart from its answer, as
            regenerate writes it: data/reasoning.py), handed to templates that render it

Each row is rendered with the target tokenizer's chat template (trust_remote_code) and tokenized; the loss
mask is 1 exactly on the tokens the template emits for assistant messages (their content and the template's
end-of-turn marker), found by rendering the conversation incrementally: the text between
render(messages[:k], add_generation_prompt=True) and render(messages[:k+1]) is assistant message k. A template that
renders earlier turns otherwise than the last (Qwen3, DeepSeek-R1: without their <think> reasoning) is not
incremental: message k is then looked for in the whole rendering after its own generation header, as written or as
such templates keep it (the text after its last </think>), followed by the end-of-turn marker the template writes
after a last message.

Output under <output-dir>/prepared/ (every file written atomically, manifest.json last):
  shard_00000.safetensors  input_ids int64 [sum T], loss_mask uint8 [sum T], offsets int64 [n+1],
                           source_line int64 [n]   (sample j of the shard = input_ids[offsets[j]:offsets[j+1]])
  token_freq.npy           int64 [vocab_size], counts of loss-masked target tokens
  manifest.json            count, model, seq_len, source + sha256, shards, token totals, bad rows
Sample index i (used by extract's hs_{i}.safetensors) is the position in this prepared dataset.

stdout: one JSON summary. stderr: progress. Exit 0 ok, 1 failure, 2 bad input
(with --on-bad-row fail, the first malformed row is reported as FILE:LINE: what is wrong).
"""
import hashlib
import json
import os
import sys

from kimi_eagle_host.data.curation import curate, policy_from_args
from kimi_eagle_host.data.prepared_data import FORMAT
from kimi_eagle_host.target.tokenizer import chat_template_sha256, load_tokenizer
from kimi_eagle_host.step_runtime import (BadInput, atomic_save_npy, atomic_write, atomic_write_json, log,
                                          parse_step_args, progress, run_step, sha256_file)

SHARE_GPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                   "assistant": "assistant", "system": "system"}
OPENAI_ROLES = {"system", "user", "assistant"}


class BadRow(ValueError):
    pass


# ----------------------------------------------------------------------------------------------------
# rows → messages

def _text_of(content, where):
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts; only text makes sense for a text-only target
        parts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise BadRow(f"{where}[{j}]: only text parts ({{'type': 'text', 'text': str}}) are supported")
            parts.append(part["text"])
        return "".join(parts)
    raise BadRow(f"{where}: expected a string, got {type(content).__name__ if content is not None else 'null'}")


def normalize_row(row):
    """Return [{'role', 'content'}] for either input shape, or raise BadRow naming the offending field."""
    if not isinstance(row, dict):
        raise BadRow(f"row is a JSON {type(row).__name__}, expected an object with 'conversations' or 'messages'")
    if "conversations" in row:
        key, role_key, text_key = "conversations", "from", "value"
    elif "messages" in row:
        key, role_key, text_key = "messages", "role", "content"
    else:
        raise BadRow("row has neither 'conversations' (ShareGPT) nor 'messages' (OpenAI)")
    turns = row[key]
    if not isinstance(turns, list) or not turns:
        raise BadRow(f"'{key}' must be a non-empty list")
    messages = []
    for j, turn in enumerate(turns):
        where = f"{key}[{j}]"
        if not isinstance(turn, dict):
            raise BadRow(f"{where}: expected an object, got {type(turn).__name__}")
        if role_key not in turn:
            raise BadRow(f"{where}: missing field '{role_key}'")
        if text_key not in turn:
            raise BadRow(f"{where}: missing field '{text_key}'")
        raw_role = turn[role_key]
        if key == "conversations":
            role = SHARE_GPT_ROLES.get(raw_role) if isinstance(raw_role, str) else None
            allowed = "human/gpt/system"
        else:
            role = raw_role if raw_role in OPENAI_ROLES else None
            allowed = "system/user/assistant"
        if role is None:
            raise BadRow(f"{where}.{role_key}: {raw_role!r} is not supported (expected {allowed})")
        message = {"role": role, "content": _text_of(turn[text_key], f"{where}.{text_key}")}
        if role == "assistant" and turn.get("reasoning_content") is not None:
            # a thinking target's reasoning apart from its answer (regenerate writes it so: data/reasoning.py), for
            # the templates that render it
            message["reasoning_content"] = _text_of(turn["reasoning_content"], f"{where}.reasoning_content")
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise BadRow(f"'{key}' has no assistant turn (nothing to train on)")
    return messages


# ----------------------------------------------------------------------------------------------------
# messages → token ids + loss mask

def _render(tok, messages, add_generation_prompt):
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def assistant_char_spans(tok, messages):
    """Render the conversation; return (text, [(start, end)) character spans of assistant output]."""
    try:
        full = _render(tok, messages, False)
    except Exception as e:  # templates raise on e.g. non-alternating roles
        raise BadRow(f"chat template failed: {type(e).__name__}: {e}") from None
    spans, cursor = [], 0
    for k, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = upto = None
        try:
            prefix = _render(tok, messages[:k], True)
            upto = _render(tok, messages[:k + 1], False)
        except Exception:
            pass  # e.g. templates that refuse an empty/partial conversation: located in the full text below
        if upto is not None and upto.startswith(prefix) and full.startswith(upto) and len(prefix) >= cursor:
            span = (len(prefix), len(upto))
        else:
            span = _located_span(tok, full, m["content"], cursor, prefix, upto)
            if span is None and not m["content"] and m.get("reasoning_content") is not None:
                continue   # an earlier answer cut inside its reasoning: the history shows nothing of it to train on
            if span is None:
                raise BadRow(f"cannot locate assistant message {k} in the rendered chat template")
        spans.append(span)
        cursor = span[1]
    return full, spans


def _history_forms(content):
    """What a template may show of an assistant message in the history: the message, and for a reasoning answer
    what templates that drop old reasoning (Qwen3, DeepSeek-R1) keep: the text after the last </think>, without the
    newlines that follow it."""
    forms = [content] if content else []
    if "</think>" in content:
        kept = content.split("</think>")[-1].lstrip("\n")
        if kept and kept != content:
            forms.append(kept)
    return forms


def _located_span(tok, full, content, cursor, prefix, upto):
    """Assistant message `content` in `full` when the template is not incremental (it renders earlier turns otherwise
    than the last, e.g. without their reasoning): (start, end) or None.

    The full text runs as the conversation so far with the generation prompt up to `lo`: a match that ends there is the
    user's or system's text or the turn's header (an answer the question also holds, "Yes", would be masked in the
    question), so the message must end after `lo`. It may begin before: a generation prompt that goes on past the
    header (QwQ's and DeepSeek-R1's "<think>\\n") shares the first characters of an answer like "<b>...". Of the forms
    the message may take, the earliest found is this turn's (a later one is a later turn's), the whole message before
    its kept tail."""
    lo = len(os.path.commonprefix([prefix, full])) if prefix is not None else 0
    found = [(pos, text) for text in _history_forms(content)
             if (pos := full.find(text, max(cursor, lo - len(text) + 1))) >= 0]
    if not found:
        return None
    pos, text = min(found, key=lambda f: (f[0], -len(f[1])))
    end = pos + len(text)
    return pos, end + _turn_end_length(tok, full, end, text, prefix, upto)


def _turn_end_length(tok, full, end, text, prefix, upto):
    """Characters of the end-of-turn marker at full[end:], trained on as on the incremental path: what the template
    writes after the message when it is the last one (e.g. Qwen3's '<|im_end|>\\n'), else the eos token, else 0."""
    if prefix is not None and upto is not None and upto.startswith(prefix):
        i = upto.rfind(text)
        marker = upto[i + len(text):] if i >= len(prefix) else ""  # only what follows it inside its own turn
        if marker and full.startswith(marker, end):
            return len(marker)
    eos = getattr(tok, "eos_token", None)
    return len(eos) if eos and full.startswith(eos, end) else 0


def tokenize_with_mask(tok, messages):
    import numpy as np

    text, spans = assistant_char_spans(tok, messages)
    if getattr(tok, "is_fast", False):
        # One tokenization of the whole text (identical to what the model sees); a token is trained on when
        # it starts inside an assistant span.
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], dtype=np.int64)
        starts = np.asarray([s for s, _ in enc["offset_mapping"]], dtype=np.int64)
        mask = np.zeros(len(ids), dtype=np.uint8)
        for a, b in spans:
            mask |= ((starts >= a) & (starts < b)).astype(np.uint8)
        return ids, mask
    # Slow tokenizers (e.g. tiktoken-based remote code) have no offsets: encode segment by segment.
    # Span boundaries sit at role markers, so this matches whole-text tokenization in practice.
    ids, mask, pos = [], [], 0
    for a, b in spans:
        for seg, m in ((text[pos:a], 0), (text[a:b], 1)):
            if seg:
                seg_ids = tok.encode(seg, add_special_tokens=False)
                ids += seg_ids
                mask += [m] * len(seg_ids)
        pos = b
    if text[pos:]:
        seg_ids = tok.encode(text[pos:], add_special_tokens=False)
        ids += seg_ids
        mask += [0] * len(seg_ids)
    return np.asarray(ids, dtype=np.int64), np.asarray(mask, dtype=np.uint8)


# ----------------------------------------------------------------------------------------------------

def target_vocab_size(model, tok):
    """Rows of the target's embedding (config vocab_size), never less than the tokenizer's id range."""
    n = len(tok)
    try:
        from kimi_eagle_host.target.target_config import read_target_config, states

        n = max(n, int(read_target_config(model, states("vocab_size"))[0]["vocab_size"]))
    except Exception as e:  # tokenizer-only dirs are fine for prepare
        log(f"[prepare] note: could not read vocab_size from the model config ({e}); using len(tokenizer)={n}")
    return n


def write_shards(out_dir, samples, shard_size):
    import numpy as np
    from safetensors.numpy import save

    shards = []
    for k, start in enumerate(range(0, len(samples), shard_size)):
        chunk = samples[start:start + shard_size]
        lengths = [len(ids) for ids, _, _ in chunk]
        tensors = {
            "input_ids": np.concatenate([ids for ids, _, _ in chunk]).astype(np.int64),
            "loss_mask": np.concatenate([m for _, m, _ in chunk]).astype(np.uint8),
            "offsets": np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
            "source_line": np.asarray([line for _, _, line in chunk], dtype=np.int64),
        }
        name = f"shard_{k:05d}.safetensors"
        raw = save(tensors, metadata={"start": str(start)})
        atomic_write(os.path.join(out_dir, name), raw)
        # the manifest names each shard's content: its digest is the prepared data's identity (extract, train)
        shards.append({"file": name, "start": start, "count": len(chunk), "sha256": hashlib.sha256(raw).hexdigest()})
    return shards


def curated(rows, policy):
    """(the rows the curation policy keeps, its report; None when it asks for nothing): data/curation.py."""
    if not policy.active():
        return rows, None
    kept, report = curate([(str(rid) if rid else f"line{lineno}", [m["content"] for m in msgs if m["role"] == "user"])
                           for lineno, msgs, rid in rows], policy)
    log(f"[prepare] curation: {report['out']} of {report['in']} conversations kept"
        + "".join(f", {n} {why.replace('_', ' ')}" for why, n in sorted(report["dropped"].items())))
    return [rows[i] for i in kept], report


def replaced(out_dir):
    """One line: prepare always starts clean; what it replaces (extract and vocab start clean after it when the
    data differs: they know it by the manifest's sha256)."""
    path = os.path.join(out_dir, "manifest.json")
    try:
        with open(path) as f:
            before = json.load(f).get("count")
    except (OSError, ValueError):
        return f"new prepared data in {out_dir}"
    return f"starting clean in {out_dir}: replaces the prepared data of an earlier run ({before} samples)"


def read_rows(path: str, bad_row) -> list:
    """(line number, messages, the row's id) of each well-formed row of a chat JSONL file; `bad_row(lineno, error)` hears of the
    others (and may raise)."""
    rows = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise BadRow(f"not valid UTF-8 ({e})") from None
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise BadRow(f"invalid JSON ({e})") from None
                rows.append((lineno, normalize_row(row), row.get("id")))
            except BadRow as e:
                bad_row(lineno, e)
    return rows


def bad_row_handler(args, bad: list):
    """`bad_row(lineno, error)`: a row left out, recorded in `bad`; BadInput instead with --on-bad-row fail."""
    def bad_row(lineno, err):
        msg = f"{args.dataset}:{lineno}: {err}"
        if args.on_bad_row == "fail":
            raise BadInput(msg + " (use --on-bad-row skip to skip such rows)")
        if len(bad) < 20:  # a public dataset may hold hundreds: the manifest lists them
            log(f"[prepare] skipping {msg}")
        bad.append({"line": lineno, "error": str(err)})
    return bad_row


# Rows per task handed to a worker: large enough that pickling is a small part of the work, small enough that the
# progress bar moves and --max-samples stops soon after it is reached.
BLOCK_ROWS = 256
# (tokenizer, seq_len, blocks of rows): what a forked worker inherits from the parent, so that a task is a block's
# index. Tasks that carried the rows themselves filled the pipe to the workers, and stopping early (--max-samples)
# then hung in Pool.terminate, its feeder thread blocked on that pipe.
_worker_job = None


def worker_count(setting: int, rows: int) -> int:
    """Processes that tokenize: `setting`, or 0 = one per CPU core this process may use (at most 16); one for a
    small input, where starting them costs more than it saves."""
    if setting:
        return setting
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:   # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(cores, 16, rows // (4 * BLOCK_ROWS)))


def _tokenize_block(index: int):
    """(line number, ids, mask) of each row of block `index`, cut to seq_len; (line number, None, why) for a bad one."""
    tok, seq_len, blocks = _worker_job
    out = []
    for lineno, messages in blocks[index]:
        try:
            ids, mask = tokenize_with_mask(tok, messages)
        except BadRow as e:
            out.append((lineno, None, str(e)))
            continue
        out.append((lineno, ids[:seq_len], mask[:seq_len]))
    return out


def tokenized(args, tok, rows):
    """_tokenize_block's triples for every row, in row order whatever --workers is: the chat template is Python
    (Jinja) and runs once per assistant turn, so 50k multi-turn conversations take minutes in one process."""
    global _worker_job
    blocks = [[(lineno, messages) for lineno, messages, _ in rows[i:i + BLOCK_ROWS]]
              for i in range(0, len(rows), BLOCK_ROWS)]
    _worker_job = (tok, args.seq_len, blocks)
    workers = worker_count(args.workers, len(rows))
    if workers == 1:
        for i in range(len(blocks)):
            yield from _tokenize_block(i)
        return
    import multiprocessing

    # The workers fork with the loaded tokenizer; its own thread pool must not be running across a fork.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    log(f"[prepare] tokenizing in {workers} processes")
    with multiprocessing.get_context("fork").Pool(workers) as pool:
        for result in pool.imap(_tokenize_block, range(len(blocks))):
            yield from result


def tokenize_rows(args, tok, rows, bad_row) -> tuple[list, int]:
    """(samples: (ids, mask, line number) cut to --seq-len, rows dropped for having no trained token left)."""
    rows_out = tokenized(args, tok, rows)
    try:
        return take_samples(args, progress(rows_out, total=len(rows), desc="prepare"), bad_row)
    finally:
        rows_out.close()   # stops the workers now when --max-samples ended it early


def take_samples(args, triples, bad_row) -> tuple[list, int]:
    """The samples among tokenized()'s triples, up to --max-samples."""
    samples, dropped = [], 0
    for lineno, ids, mask in triples:
        if ids is None:   # a row the template refused: `mask` holds why
            bad_row(lineno, BadRow(mask))
            continue
        if not mask.any():  # everything trainable was truncated away
            dropped += 1
            continue
        samples.append((ids, mask, lineno))
        if args.max_samples and len(samples) >= args.max_samples:
            break
    return samples, dropped


def write_prepared(args, out_dir, samples, tok, vocab, freq, provenance, bad, dropped, kept_report) -> dict:
    """The shards, token_freq.npy and manifest.json (last) in out_dir; leftovers of a larger run removed. The
    manifest."""
    os.makedirs(out_dir, exist_ok=True)
    log(f"[prepare] {replaced(out_dir)}")
    old = {n for n in os.listdir(out_dir) if n.startswith("shard_") and n.endswith(".safetensors")}
    # The manifest goes before the shards change and comes back last: a prepare that fails in between leaves the
    # folder without one (the steps after it refuse: "run the prepare step first"), never an old manifest over
    # new shards.
    if os.path.exists(os.path.join(out_dir, "manifest.json")):
        os.unlink(os.path.join(out_dir, "manifest.json"))
    shards = write_shards(out_dir, samples, args.shard_size)
    atomic_save_npy(os.path.join(out_dir, "token_freq.npy"), freq)
    manifest = {
        "format": FORMAT,
        "count": len(samples),
        "model": args.model,
        "tokenizer_class": type(tok).__name__,
        "chat_template_sha256": chat_template_sha256(tok),
        "seq_len": args.seq_len,
        "source": os.path.abspath(args.dataset),
        "source_sha256": provenance["sha256"],
        "dataset": provenance,
        "vocab_size": vocab,
        "tokens": int(sum(len(s[0]) for s in samples)),
        "loss_tokens": int(freq.sum()),
        "bad_rows": bad[:1000],
        "skipped_bad_rows": len(bad),
        "dropped_no_loss_tokens": dropped,
        "curation": kept_report,
        "shards": shards,
        "token_freq": "token_freq.npy",
        "token_freq_sha256": sha256_file(os.path.join(out_dir, "token_freq.npy")),
    }
    atomic_write_json(os.path.join(out_dir, "manifest.json"), manifest)
    for name in old - {s["file"] for s in shards}:  # leftovers of an earlier, larger run
        os.unlink(os.path.join(out_dir, name))
    return manifest


def run(args):
    import numpy as np

    from kimi_eagle_host.data.data_sources import is_source_name, resolve

    named = is_source_name(args.dataset)
    policy = policy_from_args(args, named)
    if args.on_bad_row == "auto":  # a public dataset has rows without an answer to train on: those are skipped
        args.on_bad_row = "skip" if named else "fail"
    args.dataset, provenance = resolve(args.dataset)  # a chat JSONL file, or a dataset name (e.g. sharegpt)
    out_dir = args.out or os.path.join(args.output_dir, "prepared")

    # Pass 1, structure only (no transformers import, so a bad file fails in a fraction of a second).
    # Nothing is written before both passes succeed: with --on-bad-row fail, the output dir is untouched.
    bad = []
    bad_row = bad_row_handler(args, bad)
    rows = read_rows(args.dataset, bad_row)
    rows, kept_report = curated(rows, policy)
    tok = load_tokenizer(args.model)

    # Pass 2: chat template + tokenization (a template may still reject a row, e.g. non-alternating roles).
    samples, dropped = tokenize_rows(args, tok, rows, bad_row)
    if not samples:
        raise BadInput(f"{args.dataset}: no usable samples ({len(bad)} bad rows, {dropped} without assistant tokens "
                       f"after truncation to {args.seq_len})")

    bad.sort(key=lambda b: b["line"])
    vocab = target_vocab_size(args.model, tok)
    freq = np.zeros(vocab, dtype=np.int64)
    for ids, mask, _ in samples:
        np.add.at(freq, ids[mask.astype(bool)], 1)

    manifest = write_prepared(args, out_dir, samples, tok, vocab, freq, provenance, bad, dropped, kept_report)
    log(f"[prepare] {len(samples)} samples, {manifest['tokens']} tokens ({manifest['loss_tokens']} trained), "
        f"{len(bad)} bad rows skipped → {out_dir}")
    return {"ok": True, "step": "prepare", "out_dir": os.path.abspath(out_dir), "count": len(samples),
            "tokens": manifest["tokens"], "loss_tokens": manifest["loss_tokens"], "vocab_size": vocab,
            "skipped_bad_rows": len(bad), "dropped_no_loss_tokens": dropped, "shards": len(manifest["shards"]),
            "curation": kept_report and {k: kept_report[k] for k in ("in", "out", "dropped")}}


def main(argv=None):
    return run_step("prepare", run, parse_step_args("prepare", argv, __doc__))


if __name__ == "__main__":
    sys.exit(main())
