"""The context (--max-model-len) the steps that generate (regenerate, eval, choose) ask their engine for.

Not given, it is what the longest conversation needs in full (its prompts, the chat template's tokens, and an
answer of --max-tokens to every turn), at least PREFLIGHT_CONTEXT, at most the model's positions
(max_position_embeddings of the config, a wrapper's text config for a multimodal model). The floor makes the engines
of one run ask for the same context whatever their prompts: vLLM keys its compile cache on the context, and on an
H100 each engine whose context was new compiled for 21-44 s (choose on held-out documents asked for 1,123, eval on
MT-Bench 963, on HumanEval 629: three contexts, every engine compiled), where one found in the cache took 4-6 s.
Given, it must fit the model: vLLM refuses a longer context at engine start with a validation traceback; here it is
one line naming the flag and the model's limit (exit 2).
"""
import os

from kimi_eagle_host.step_runtime import BadInput
from kimi_eagle_host.model_size import read_text_config

FLAG = "--max-model-len"
# What preflight sizes an engine for when the step will derive its context from the prompts (it has none), and the
# least context a step derives (derived): the same for every engine of a run whose prompts need no more.
PREFLIGHT_CONTEXT = 2048
# The config fields a model states its positions in (the first one present wins).
POSITION_FIELDS = ("max_position_embeddings", "max_sequence_length", "seq_length", "n_positions")


def model_positions(model_dir: str) -> tuple[int | None, str | None]:
    """(positions the model can attend over, the config field that says so); (None, None) where none says."""
    tc = read_text_config(model_dir) or {}
    for name in POSITION_FIELDS:
        value = tc.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, name
    return None, None


def conversation_need(conv, budget, max_turns: int = 0) -> int:
    """Tokens conversation `conv` takes at its last answered turn: every prompt text, the template's tokens per
    message and an answer of the budget's max_tokens to each turn."""
    turns = conv.user_turns[:max_turns] if max_turns else conv.user_turns
    texts = [m["content"] for m in conv.system] + list(turns)
    messages = len(conv.system) + 2 * len(turns) - 1
    return budget.base + sum(budget.count(texts)) + budget.per_message * messages + budget.max_tokens * len(turns)


def resolve(given: int | None, model_dir: str, convs, budget, max_turns: int = 0, least: int = 0) -> int:
    """The context to use: `given` when it fits the model (else BadInput naming the flag and the limit), or the
    longest conversation's need (at least `least`: prompts still to be written) capped by the model's positions."""
    limit, field = model_positions(model_dir)
    if given is not None:
        if given < 1:
            raise BadInput(f"{FLAG} {given}: must be >= 1")
        if limit is not None and given > limit:
            raise BadInput(f"{FLAG} {given}: more than the model's {limit} positions ({field} in "
                           f"{os.path.join(model_dir, 'config.json')}); pass at most {limit} or leave it unset")
        return given
    need = max((conversation_need(c, budget, max_turns) for c in convs), default=budget.base + budget.max_tokens)
    return derived(max(need, least), model_dir)


def derived(need: int, model_dir: str) -> int:
    """The context for what the prompts `need` when none was given: at least PREFLIGHT_CONTEXT (one context, hence
    one vLLM compile, for the engines of a run), at most the model's positions."""
    limit, _ = model_positions(model_dir)
    need = max(need, PREFLIGHT_CONTEXT)
    return min(need, limit) if limit is not None else need
