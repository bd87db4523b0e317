"""Prompts from a chat JSONL file (the format `prepare` reads), for the steps that generate: regenerate, eval.

A row's prompt is its conversation without trailing assistant turns (earlier turns stay as context), so the
same file serves as training data, as prompts to regenerate, and as held-out eval prompts.
"""
import json

from step_runtime import BadInput

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
         "system": "system"}


def _text(content, where):
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    raise ValueError(f"{where}: expected a string or a list of text parts")


def prompt_messages(row):
    """[{'role', 'content'}] ending with a user turn; ValueError naming the field when the row has none."""
    if not isinstance(row, dict):
        raise ValueError("row is not a JSON object")
    key, rk, tk = ("conversations", "from", "value") if "conversations" in row else ("messages", "role", "content")
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        raise ValueError("row has neither a non-empty 'conversations' (ShareGPT) nor 'messages' (OpenAI) list")
    msgs = []
    for j, t in enumerate(turns):
        if not isinstance(t, dict) or ROLES.get(t.get(rk)) is None:
            raise ValueError(f"{key}[{j}].{rk}: missing or unsupported role")
        msgs.append({"role": ROLES[t[rk]], "content": _text(t.get(tk), f"{key}[{j}].{tk}")})
    while msgs and msgs[-1]["role"] == "assistant":
        msgs.pop()
    if not msgs or msgs[-1]["role"] != "user":
        raise ValueError(f"'{key}' has no user turn to answer")
    return msgs


def read_prompts(path, limit=0):
    """[(row id, messages)] in file order; a malformed row is bad input naming FILE:LINE."""
    out = []
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise BadInput(f"{path}: {e.strerror}") from None
    with f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                msgs = prompt_messages(row)
            except ValueError as e:
                raise BadInput(f"{path}:{lineno}: {e}") from None
            out.append((str(row.get("id", f"line{lineno}")), msgs))
            if limit and len(out) >= limit:
                break
    if not out:
        raise BadInput(f"{path}: no prompts")
    return out
