"""Conversations to be answered by the target, for the steps that generate: regenerate, eval.

A row of a chat JSONL file (the format `prepare` reads) becomes a Conversation: its system messages and its
user turns, in order. The target answers every user turn in turn, each answer conditioned on its own earlier
answers; assistant turns in the file are not used (regenerate replaces them: self-distillation; eval measures
the target's own continuation, as MT-Bench's second turn does). Consecutive user messages are separate turns
(MT-Bench rows are written that way).

Bad input is found here, before any model loads: bytes that are not UTF-8, a lone surrogate (JSON allows
"\\ud800"; no tokenizer can encode it), a row without a user turn; and, once the tokenizer is loaded, a first
turn longer than the engine's context (check_lengths).
"""
import json
from dataclasses import dataclass, field

from kimi_eagle_host.data.reasoning import AnswerText, assistant_message, opens_reasoning, renders_reasoning
from kimi_eagle_host.step_runtime import BadInput

ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
         "system": "system"}


@dataclass
class Conversation:
    id: str
    line: int
    user_turns: list
    system: list = field(default_factory=list)  # [{'role': 'system', 'content'}] before the first turn
    category: str | None = None
    first_tokens: int = 0  # the first turn's prompt in tokens (check_lengths counts it)

    def messages(self, answers):
        """The chat to send for the next turn: system, then user/assistant pairs, ending with a user turn. An answer
        is an assistant message (TokenBudget.reply) or its text."""
        out = list(self.system)
        for r, a in enumerate(answers):
            out += [{"role": "user", "content": self.user_turns[r]},
                    a if isinstance(a, dict) else {"role": "assistant", "content": a}]
        return out + [{"role": "user", "content": self.user_turns[len(answers)]}]


def _text(content, where):
    if isinstance(content, str):
        text = content
    elif isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
        text = "".join(str(p.get("text", "")) for p in content)
    else:
        raise ValueError(f"{where}: expected a string or a list of text parts")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{where}: a lone surrogate ({text[e.start]!a} at character {e.start}) is not text a "
                         "tokenizer can encode") from None
    return text


def conversation_of(row, line):
    """A Conversation, or ValueError naming the field."""
    if not isinstance(row, dict):
        raise ValueError("row is not a JSON object")
    key, rk, tk = ("conversations", "from", "value") if "conversations" in row else ("messages", "role", "content")
    turns = row.get(key)
    if not isinstance(turns, list) or not turns:
        raise ValueError("row has neither a non-empty 'conversations' (ShareGPT) nor 'messages' (OpenAI) list")
    conv = Conversation(id=str(row.get("id") or f"line{line}"), line=line, user_turns=[],
                        category=row.get("category") if isinstance(row.get("category"), str) else None)
    for j, t in enumerate(turns):
        role = ROLES.get(t.get(rk)) if isinstance(t, dict) else None
        if role is None:
            raise ValueError(f"{key}[{j}].{rk}: missing or unsupported role")
        text = _text(t.get(tk), f"{key}[{j}].{tk}")
        if role == "system" and not conv.user_turns:
            conv.system.append({"role": "system", "content": text})
        elif role == "user":
            conv.user_turns.append(text)
    if not conv.user_turns:
        raise ValueError(f"'{key}' has no user turn to answer")
    return conv


def read_conversations(path, limit=0, label=None):
    """[Conversation] in file order; anything malformed is bad input naming FILE:LINE (label: what to call
    the file in messages, e.g. the dataset's name)."""
    label = label or path
    out = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise BadInput(f"{label}: {e.strerror}") from None
    with f:
        for lineno, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise BadInput(f"{label}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                               "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                out.append(conversation_of(json.loads(line), lineno))
            except ValueError as e:
                raise BadInput(f"{label}:{lineno}: {e}") from None
            if limit and len(out) >= limit:
                break
    if not out:
        raise BadInput(f"{label}: no prompts")
    return out


def spread_over_categories(convs, n):
    """The first n conversations taken round-robin over categories (in order of first appearance), so a
    subset of a benchmark sorted by category still covers every category; plain order without categories."""
    if not n or n >= len(convs) or not any(c.category for c in convs):
        return convs[:n] if n else convs
    groups = {}
    for c in convs:
        groups.setdefault(c.category, []).append(c)
    picked, r = [], 0
    while len(picked) < n:
        for g in groups.values():
            if r < len(g) and len(picked) < n:
                picked.append(g[r])
        r += 1
    return sorted(picked, key=lambda c: c.line)


class TokenBudget:
    """Token counts for the context check without rendering every turn's whole chat: the chat template's own
    tokens are measured once (`base` for a one-turn prompt with its generation prompt, `per_message` for each
    further message, rounded up), and a message's text is tokenized once."""

    def __init__(self, tok, max_model_len, max_tokens):
        self.tok, self.limit, self.max_tokens = tok, max_model_len, max_tokens

        def n(msgs):
            ids = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)
            return len(ids["input_ids"] if hasattr(ids, "keys") else ids)

        one = n([{"role": "user", "content": "x"}])
        three = n([{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"},
                   {"role": "user", "content": "z"}])
        self.base = one
        self.per_message = max((three - one + 1) // 2, 1) + 1  # +1: a text's edge may merge differently
        # a thinking target's answers go back to its template as reasoning and answer (data/reasoning.py)
        self.opens_reasoning, self.splits_reasoning = opens_reasoning(tok), renders_reasoning(tok)
        self.answer_text = AnswerText(tok)

    def reply(self, text, ids=None):
        """The target's answer `text` (decoded as served; `ids`, its tokens, where the think markers may be special)
        as the assistant message its chat template renders back as generated."""
        text = self.answer_text(text, ids) if ids is not None else text
        return assistant_message(text, opened=self.opens_reasoning, split=self.splits_reasoning)

    def count(self, texts):
        if not texts:
            return []
        return [len(ids) for ids in self.tok(list(texts), add_special_tokens=False)["input_ids"]]

    def fits(self, used):
        """Whether a prompt of `used` tokens leaves room for an answer of --max-tokens."""
        return used + self.max_tokens <= self.limit


def check_lengths(convs, budget, label, on_long):
    """(kept conversations, dropped count). A first turn that cannot be answered within the context is bad
    input (on_long='fail', the default for files: one line naming FILE:LINE) or dropped (on_long='skip')."""
    kept, dropped = [], 0
    firsts = budget.count([" ".join(m["content"] for m in c.system) + c.user_turns[0] for c in convs])
    for c, n in zip(convs, firsts):
        need = budget.base + n + budget.per_message * len(c.system)
        if budget.fits(need):
            c.first_tokens = need
            kept.append(c)
        elif on_long == "skip":
            dropped += 1
        else:
            raise BadInput(f"{label}:{c.line}: the first user turn is about {need} tokens; with --max-tokens "
                           f"{budget.max_tokens} it does not fit the engine's context (--max-model-len "
                           f"{budget.limit}); shorten it or pass --long-prompts skip")
    if not kept:
        raise BadInput(f"{label}: no prompt fits the context (--max-model-len {budget.limit}, --max-tokens "
                       f"{budget.max_tokens})")
    return kept, dropped
