"""The target answers conversations turn by turn: regenerate's core, in rounds or as a stream.

A conversation's turn r can only be asked once the target's answer to turn r-1 is in (each answer is conditioned on
the target's own earlier answers). Two ways to keep an engine busy under that rule:

- rounds (any engine): round r asks turn r of every conversation of a chunk in one batched call. Simple, but a
  round waits for its longest answer, and the rounds of a chunk's few long conversations run nearly alone: on
  ShareGPT, where a conversation has 1 to 100+ turns, most of the engine's batch is idle most of the time.
- a stream (an engine with continuous batching, vLLM's `LLMEngine.add_request`/`step`): a conversation's next
  turn is queued the moment its answer arrives, and a new conversation starts whenever one ends, so the engine
  always holds `window` conversations.

Both give each turn the same prompt and the same sampling seed (its chunk's seed + the turn index), so they give
the same answers for the same engine (up to the engine's batch-order numerics), and a chunk's file does not depend
on how it was scheduled. Every turn's prompt must fit the context with --max-tokens to spare; the first turn that
does not ends its conversation there (counted as cut).
"""
from __future__ import annotations

from collections import deque


class Dialogue:
    """One conversation being answered: the answers so far and the tokens its next prompt holds."""

    __slots__ = ("conv", "answers", "used", "turn_tokens", "cut")

    def __init__(self, conv, turn_tokens):
        self.conv, self.answers, self.used, self.cut = conv, [], conv.first_tokens, False
        self.turn_tokens = turn_tokens  # tokens of each user turn's text

    def next_turn(self, budget, max_turns):
        """The chat to send for the next turn, or None when the conversation is done: every turn answered,
        --max-turns reached, or the next turn no longer fits the context (then `cut`)."""
        r = len(self.answers)
        if r >= len(self.conv.user_turns) or (max_turns and r >= max_turns):
            return None
        if r > 0:
            self.used += self.turn_tokens[r] + budget.per_message
            if not budget.fits(self.used):
                self.cut = True
                return None
        return self.conv.messages(self.answers)

    def take(self, text, tokens, budget):
        self.answers.append(budget.reply(text))   # an assistant message, a thinking target's reasoning apart
        self.used += tokens + budget.per_message


def dialogues(convs, budget):
    """Dialogues for `convs`, their user turns counted in one tokenizer call."""
    counts = iter(budget.count([t for c in convs for t in c.user_turns]))
    return [Dialogue(c, [next(counts) for _ in c.user_turns]) for c in convs]


def answer_in_rounds(gen, convs, budget, seed, max_turns):
    """Each conversation's answers, round r asking turn r of all of them in one call `gen(chats, seed + r)`:
    (answers per conversation, conversations cut for the context)."""
    every = dialogues(convs, budget)
    live, r = every, 0
    while live:
        asks = [(d, d.next_turn(budget, max_turns)) for d in live]
        asks = [(d, chat) for d, chat in asks if chat is not None]
        for (d, _), (text, n) in zip(asks, gen([chat for _, chat in asks], seed + r) if asks else []):
            d.take(text, n, budget)
        live, r = [d for d, _ in asks], r + 1
    return [d.answers for d in every], sum(d.cut for d in every)


class Stream:
    """Conversations of several chunks answered with continuous batching.

    `engine` has `start(request_id, chat, seed)` (queue one turn) and `finished()` (run one engine step; the
    requests it finished as (request_id, text, tokens)). `chunks` yields (chunk index, conversations, seed) in
    order, and is asked for the next one only when the engine has room for more conversations (so that engines
    sharing the chunks take each as late as they can); `done(chunk index, answers, cut)` is called as each chunk's
    last conversation ends (so a chunk is written while later ones are still being answered). At most `window`
    conversations are in the engine."""

    def __init__(self, engine, budget, max_turns, window):
        self.engine, self.budget, self.max_turns, self.window = engine, budget, max_turns, max(1, int(window))

    def run(self, chunks, done):
        chunks = iter(chunks)
        waiting = deque()  # (chunk index, position) of conversations not started yet, in order
        state = {}  # chunk index -> [dialogues, conversations still open, seed]
        asked = {}  # request id -> (chunk index, position)
        open_convs = 0
        more = True

        def pull():
            """The next chunk's conversations queued; False when there is none."""
            item = next(chunks, None)
            if item is None:
                return False
            index, convs, seed = item
            state[index] = [dialogues(convs, self.budget), len(convs), seed]
            waiting.extend((index, k) for k in range(len(convs)))
            return True

        def ask(index, k):
            """Queue the conversation's next turn; False when it has ended."""
            d = state[index][0][k]
            chat = d.next_turn(self.budget, self.max_turns)
            if chat is None:
                return False
            rid = f"{index}.{k}.{len(d.answers)}"
            asked[rid] = (index, k)
            self.engine.start(rid, chat, state[index][2] + len(d.answers))
            return True

        def ended(index):
            entry = state[index]
            entry[1] -= 1
            if entry[1] == 0:
                done(index, [d.answers for d in entry[0]], sum(d.cut for d in entry[0]))
                del state[index]

        while True:
            while open_convs < self.window and (waiting or (more and (more := pull()))):
                if not waiting:
                    continue
                index, k = waiting.popleft()
                if ask(index, k):
                    open_convs += 1
                else:
                    ended(index)
            if not asked:
                if not waiting and not more:
                    return
                continue
            for rid, text, n in self.engine.finished():
                index, k = asked.pop(rid)
                state[index][0][k].take(text, n, self.budget)
                if not ask(index, k):
                    open_convs -= 1
                    ended(index)
