"""A synthetic chat dataset of a chosen size, for throughput runs (words drawn from the bundled sample).

    python bench/make_chat_dataset.py --rows 800 --words 600 --out /tmp/chat.jsonl
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

SAMPLE = Path(__file__).resolve().parents[1] / "kimi_eagle_host" / "sample_data" / "chat.jsonl"


def words() -> list[str]:
    out = []
    for line in SAMPLE.read_text().splitlines():
        row = json.loads(line)
        for m in row.get("messages", []) + row.get("conversations", []):
            out += str(m.get("content") or m.get("value") or "").split()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=800)
    ap.add_argument("--words", type=int, default=600, help="mean words per assistant answer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    rng, vocab = random.Random(a.seed), words()
    with open(a.out, "w") as f:
        for i in range(a.rows):
            q = " ".join(rng.choices(vocab, k=rng.randint(10, 60)))
            ans = " ".join(rng.choices(vocab, k=max(20, int(rng.gauss(a.words, a.words / 3)))))
            if i % 2:
                row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans}]}
            else:
                row = {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": ans}]}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
