"""A thinking target's answer as its chat template wants it back: reasoning apart from the answer.

A thinking target (Kimi-K2.5, Qwen3, GLM-4.5) generates `<think>reasoning</think>answer`, and its chat template
renders an assistant message from two fields: `reasoning_content` inside the think block where the model would show
it (the last turn), and `content`, the answer, alone in the history (Kimi-K2.5 writes an empty `<think></think>`
before it). The generated text kept whole as `content` was rendered by such a template as
`<think></think>reasoning</think>answer`: a context the target never sees, on which extract computes hidden states
and the draft trains (nothing fails; the draft learns what serving never shows it), and, as an earlier turn, history
no client ever sends.

So where the template renders `reasoning_content`, an answer is stored as the two fields, split at `</think>`;
where the generation prompt already opened the block (Kimi-K2.5 and QwQ end it with `<think>`), the text starts
inside the reasoning. Rendering the message back then gives exactly what the target generated. A template that does
not render the field (DeepSeek-R1's drops old reasoning from `content` itself) keeps the whole text as `content`, as
before.

Decoded as served clients read it (skip_special_tokens), a tokenizer that marks the markers special drops them: the
answer could not be split, and would be stored as all reasoning with an empty answer. AnswerText decodes such a
tokenizer's answers from their token ids with the markers kept.
"""
from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"
_PROBE = "kimi-eagle reasoning probe 7f3a"


def opens_reasoning(tok) -> bool:
    """Whether the template's generation prompt ends inside an open think block (the answer begins in reasoning)."""
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "x"}], tokenize=False, add_generation_prompt=True)
    except Exception:  # noqa: BLE001 - a template that cannot render a lone user turn: no reasoning handling
        return False
    return isinstance(text, str) and text.rstrip().endswith(OPEN)


def renders_reasoning(tok) -> bool:
    """Whether the template shows an assistant message's `reasoning_content` (as the last turn)."""
    try:
        text = tok.apply_chat_template([{"role": "user", "content": "x"},
                                        {"role": "assistant", "content": "y", "reasoning_content": _PROBE}],
                                       tokenize=False)
    except Exception:  # noqa: BLE001
        return False
    return isinstance(text, str) and _PROBE in text


def assistant_message(text: str, *, opened: bool, split: bool) -> dict:
    """The target's answer `text` as an assistant message: with `split` (the template renders reasoning_content),
    its reasoning and its answer apart, `opened` saying the generation prompt opened the think block. An answer cut
    inside its reasoning (--max-tokens) is all reasoning, with an empty answer, as a served client would get it."""
    if not split:
        return {"role": "assistant", "content": text}
    body = text
    if not opened and body.lstrip().startswith(OPEN):
        body, opened = body.lstrip()[len(OPEN):], True
    if CLOSE in body:
        reasoning, _, answer = body.partition(CLOSE)
        return {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    if opened:
        return {"role": "assistant", "content": "", "reasoning_content": body}
    return {"role": "assistant", "content": text}


class AnswerText:
    """An answer's text as a served client reads it (special tokens skipped), the think markers kept. Where the
    tokenizer keeps them as text (Qwen3's, most), that is the engine's own text; where it marks them special, the
    answer's ids are decoded in the parts between the markers and the markers put back."""

    def __init__(self, tok):
        self.tok, self.marks = tok, {}
        for mark in (OPEN, CLOSE):
            try:
                ids = tok.encode(mark, add_special_tokens=False)
                if len(ids) == 1 and mark not in tok.decode(ids, skip_special_tokens=True):
                    self.marks[ids[0]] = mark
            except Exception:  # noqa: BLE001 - a tokenizer that cannot say: its text as decoded
                pass

    def __call__(self, text: str, ids) -> str:
        if not self.marks:
            return text
        parts, run = [], []
        for i in ids:
            if i in self.marks:
                parts += [self.tok.decode(run, skip_special_tokens=True), self.marks[i]]
                run = []
            else:
                run.append(i)
        return "".join(parts + [self.tok.decode(run, skip_special_tokens=True)])
