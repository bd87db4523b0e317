"""Which conversations of a prompt set are kept: repeats removed, first turns of unusable length and text in other
scripts dropped, and every drop counted by reason (the provenance that prepare and regenerate record).

A conversation is judged by its user text only (its assistant turns are the target's to write), first come first
kept, so the result depends only on the input's order: the same input and settings always keep the same rows.

- exact duplicates: the user turns, normalised (NFKC, case-folded, runs of non-word characters as one space),
  hashed together; a second conversation with the same normalised user text is dropped.
- near duplicates: MinHash over the normalised user text's shingles (word 5-grams; character 5-grams for text
  with few spaces, e.g. Chinese), 64 permutations of a 32-bit hash (XOR with a salt, then a multiply by an odd
  constant modulo 2^32: each a bijection), banded 16 x 4 for candidates; a candidate whose signatures agree on
  >= NEAR_THRESHOLD of the permutations (the Jaccard estimate) is a repeat of the kept one. Needs numpy.
- length: the first user turn, trimmed, has at least min_chars and at most max_chars characters.
- script: a character heuristic, not a language model. Each letter (str.isalpha) of the user text (the first
  SCRIPT_SAMPLE characters) is given the script its Unicode name starts with (LATIN, CYRILLIC, CJK -> han,
  HIRAGANA/KATAKANA -> kana, HANGUL, ARABIC, ...); the conversation is kept when at least SCRIPT_SHARE of its
  letters are in the allowed scripts. Text without letters (numbers, symbols) is kept: nothing to judge.
"""
from __future__ import annotations

import hashlib
import random
import re
import unicodedata
import zlib
from dataclasses import dataclass

from kimi_eagle_host.settings import SCRIPTS, SETTINGS, SettingError, check
from kimi_eagle_host.step_runtime import BadInput

NEAR_THRESHOLD = 0.8
PERMUTATIONS, BANDS = 64, 16
SHINGLE = 5
MAX_SHINGLE_WORDS = 2000  # a long paste is judged by its first 2000 words: enough to tell a repeat
MAX_NORMALISED_CHARS = 40000  # exact repeats: judged on the first 40k characters
SCRIPT_SHARE = 0.8
SCRIPT_SAMPLE = 4000
_SCRIPT_OF_NAME = {"CJK": "han", "HIRAGANA": "kana", "KATAKANA": "kana", "HANGUL": "hangul"}
_NON_WORD = re.compile(r"[\W_]+")
# reasons, in the order a conversation is tested (the first that applies is counted)
REASONS = ("no_user_turn", "too_short", "too_long", "other_script", "exact_duplicate", "near_duplicate")
EXAMPLES_PER_REASON = 5


@dataclass(frozen=True)
class Policy:
    dedupe: str = "off"  # near | exact | off
    min_chars: int = 0
    max_chars: int | None = None
    scripts: tuple | None = None  # allowed scripts; None = any

    def active(self) -> bool:
        return self.dedupe != "off" or self.min_chars > 0 or self.max_chars is not None or bool(self.scripts)

    def record(self) -> dict:
        return {"dedupe": self.dedupe, "near_threshold": NEAR_THRESHOLD if self.dedupe == "near" else None,
                "min_prompt_chars": self.min_chars, "max_prompt_chars": self.max_chars,
                "scripts": list(self.scripts) if self.scripts else None}


def policy_of(dedupe: str, min_chars: int | None, max_chars: int | None, scripts: str | None, named: bool) -> Policy:
    """The policy the settings ask for; dedupe `auto` is near for a dataset by name (or a set the target adds its
    own prompts to: `named` true) and off for a file (the user's own data, already chosen)."""
    if dedupe == "auto":
        dedupe = "near" if named else "off"
    allowed = tuple(s.strip() for s in scripts.split(",") if s.strip()) if scripts else None
    return Policy(dedupe, int(min_chars or 0), max_chars, allowed)


def policy_from_args(args, named: bool) -> Policy:
    """The policy of a step's flags (--dedupe, --min-prompt-chars, --max-prompt-chars, --scripts: add_arguments)."""
    try:
        scripts = check(SETTINGS["scripts"], args.scripts, "--scripts")
    except SettingError as e:
        raise BadInput(str(e)) from None
    return policy_of(args.dedupe, args.min_prompt_chars, args.max_prompt_chars, scripts, named)


def add_arguments(ap) -> None:
    """The curation flags of the steps that read a dataset (prepare, regenerate)."""
    ap.add_argument("--dedupe", choices=["auto", "near", "exact", "off"], default="auto",
                    help="drop repeated conversations: near (MinHash, and exact), exact, off; auto: near for a "
                         "dataset name or with --self-prompts, off for a file")
    ap.add_argument("--min-prompt-chars", type=int, default=0, help="drop first user turns shorter than this")
    ap.add_argument("--max-prompt-chars", type=int, default=None, help="drop first user turns longer than this")
    ap.add_argument("--scripts", default=None,
                    help=f"keep user text in these scripts (comma list of {', '.join(SCRIPTS)}; default any)")


def curate_conversations(convs, curator: "Curator") -> list:
    """The Conversations (data/prompts.py) the curator keeps, judged by their user turns."""
    return [c for c in convs if curator.judge(c.id, c.user_turns) is None]


def normalized(text: str) -> str:
    return _NON_WORD.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()


_script_cache: dict[str, str] = {}


def script_of(ch: str) -> str:
    s = _script_cache.get(ch)
    if s is None:
        head = unicodedata.name(ch, "").split(" ")[0]
        s = _SCRIPT_OF_NAME.get(head, head.lower())
        s = _script_cache[ch] = s if s in SCRIPTS else "other"
    return s


def script_share(text: str, allowed: tuple) -> float | None:
    """Share of the letters of `text` (its first SCRIPT_SAMPLE characters) in the `allowed` scripts; None
    without letters."""
    text = text[:SCRIPT_SAMPLE]
    ascii_letters = sum(1 for c in text if c.isascii() and c.isalpha())  # Latin without a name lookup
    other = [script_of(c) for c in text if not c.isascii() and c.isalpha()]
    total = ascii_letters + len(other)
    if not total:
        return None
    ok = (ascii_letters if "latin" in allowed else 0) + sum(1 for s in other if s in allowed)
    return ok / total


def shingles(norm: str) -> list[int]:
    words = norm.split()[:MAX_SHINGLE_WORDS]
    if len(words) >= 2 * SHINGLE or len(norm) < 4 * SHINGLE:
        grams = [" ".join(words[i:i + SHINGLE]) for i in range(max(len(words) - SHINGLE + 1, 1))]
    else:  # few spaces for its length (Chinese, Japanese, a long token): character grams
        text = norm.replace(" ", "")[:4 * MAX_SHINGLE_WORDS]
        grams = [text[i:i + SHINGLE] for i in range(max(len(text) - SHINGLE + 1, 1))]
    return [zlib.crc32(g.encode("utf-8")) for g in grams]


class MinHasher:
    def __init__(self, seed: int = 0x5EED):
        import numpy as np

        rng = random.Random(seed)
        self.np = np
        self.salts = np.array([rng.getrandbits(32) for _ in range(PERMUTATIONS)], dtype=np.uint64)
        self.mults = np.array([rng.getrandbits(32) | 1 for _ in range(PERMUTATIONS)], dtype=np.uint64)

    def signature(self, hashes: list[int]):
        np = self.np
        x = np.asarray(hashes, dtype=np.uint64)[:, None]
        return (((x ^ self.salts) * self.mults) & np.uint64(0xFFFFFFFF)).min(axis=0)


class Curator:
    """Judges conversations one at a time against those kept so far (so prompts written later, e.g. by the target,
    are checked against the whole set), counting every drop by reason."""

    def __init__(self, policy: Policy):
        self.policy = policy
        self.kept = self.seen = 0
        self.dropped: dict[str, int] = {}
        self.examples: dict[str, list[str]] = {}
        self.exact: dict[str, str] = {}
        self.hasher = MinHasher() if policy.dedupe == "near" else None
        self.bands: dict[tuple, int] = {}
        self.signatures: list = []
        self.kept_ids: list[str] = []

    def judge(self, cid: str, user_turns: list[str]) -> str | None:
        """None when the conversation is kept (and remembered), else the reason it is dropped."""
        self.seen += 1
        reason, near_of = self._reason(cid, user_turns)
        if reason is None:
            self.kept += 1
            return None
        self.dropped[reason] = self.dropped.get(reason, 0) + 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < EXAMPLES_PER_REASON:
            shown.append(f"{cid} (repeats {near_of})" if near_of else cid)
        return reason

    def _reason(self, cid, user_turns):
        p = self.policy
        if not user_turns:
            return "no_user_turn", None
        first = user_turns[0].strip()
        if len(first) < max(p.min_chars, 1):
            return "too_short", None
        if p.max_chars is not None and len(first) > p.max_chars:
            return "too_long", None
        text = "\n".join(user_turns)
        if p.scripts:
            share = script_share(text, p.scripts)
            if share is not None and share < SCRIPT_SHARE:
                return "other_script", None
        if p.dedupe == "off":
            return None, None
        norm = normalized(text[:MAX_NORMALISED_CHARS])
        key = hashlib.sha256(norm.encode("utf-8")).hexdigest()
        if key in self.exact:
            return "exact_duplicate", self.exact[key]
        sig = self.hasher.signature(shingles(norm)) if self.hasher else None
        if sig is not None:
            near = self._near(sig)
            if near is not None:
                return "near_duplicate", self.kept_ids[near]
        self.exact[key] = cid
        self._remember(sig, cid)
        return None, None

    def _band_keys(self, sig):
        rows = PERMUTATIONS // BANDS
        return [(b, sig[b * rows:(b + 1) * rows].tobytes()) for b in range(BANDS)]

    def _near(self, sig):
        for band in self._band_keys(sig):
            k = self.bands.get(band)
            if k is not None and float((self.signatures[k] == sig).mean()) >= NEAR_THRESHOLD:
                return k
        return None

    def _remember(self, sig, cid) -> None:
        if sig is not None:
            index = len(self.signatures)
            self.signatures.append(sig)
            self.kept_ids.append(cid)
            for band in self._band_keys(sig):
                self.bands.setdefault(band, index)

    def report(self) -> dict:
        return {**self.policy.record(), "in": self.seen, "out": self.kept, "dropped": dict(self.dropped),
                "dropped_examples": {k: list(v) for k, v in self.examples.items()}}


def curate(items, policy: Policy):
    """(indices of the kept items, the report) for [(id, [user turn, ...])] in order."""
    cur = Curator(policy)
    kept = []
    for i, (cid, turns) in enumerate(items):
        if cur.judge(cid, turns) is None:
            kept.append(i)
    return kept, cur.report()
