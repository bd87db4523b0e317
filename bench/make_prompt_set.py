"""Build the bundled prompt set (kimi_eagle_host/sample_data/prompts_{train,eval}.jsonl) from word lists.

Every prompt is written here from templates and word lists of our own, so the set is ours to ship. The
split is by a hash of the prompt text (about 1 in 20 to eval), so a prompt never lands in both files and
re-running gives byte-identical files. Rows are OpenAI-style chat rows with only the user turn; the
`regenerate` step adds the target's own answer.

    python bench/make_prompt_set.py            # rewrites the two files in kimi_eagle_host/sample_data/
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "kimi_eagle_host" / "sample_data"

SCIENCE = ["photosynthesis", "gravity", "the water cycle", "volcanoes", "earthquakes", "magnetism", "rainbows",
           "the tides", "black holes", "DNA", "vaccines", "electricity", "sound waves", "the seasons",
           "plate tectonics", "evaporation", "friction", "the immune system", "climate change", "batteries",
           "solar panels", "the moon's phases", "clouds", "fossils", "chemical reactions", "atoms", "lightning",
           "bacteria", "the human heart", "digestion", "sleep", "muscles", "glaciers", "coral reefs", "bees"]
TECH = ["a computer network", "the internet", "a database", "encryption", "a compiler", "cloud computing",
        "machine learning", "a web browser", "email", "GPS", "a search engine", "version control",
        "an operating system", "a spreadsheet", "recursion", "a hash table", "binary numbers", "a password manager",
        "an API", "a smartphone camera", "Wi-Fi", "open source software", "a CPU", "memory in a computer"]
HISTORY = ["the printing press", "the Roman Empire", "the Industrial Revolution", "ancient Egypt", "the Renaissance",
           "the invention of the telephone", "the first flight", "the Silk Road", "the steam engine",
           "the Olympic Games", "the history of writing", "the invention of paper", "early sailing ships",
           "the first computers", "the history of money", "medieval castles", "the invention of the wheel"]
HOBBIES = ["gardening", "baking bread", "running", "learning the guitar", "painting with watercolors", "chess",
           "photography", "knitting", "hiking", "swimming", "cooking rice", "bird watching", "yoga", "cycling",
           "writing a journal", "learning a new language", "playing the piano", "drawing", "camping", "fishing"]
GOALS = ["sleep better", "save money", "study for an exam", "stay focused at work", "drink more water",
         "keep a clean kitchen", "make new friends", "prepare for a job interview", "reduce stress",
         "wake up earlier", "read more books", "eat more vegetables", "organize a closet", "plan a trip",
         "learn to cook", "get fit at home", "manage time better", "write a good resume", "speak in public"]
ANIMALS = ["a cat", "a dog", "an elephant", "a dolphin", "an owl", "a penguin", "a fox", "a turtle", "a horse",
           "a rabbit", "a bee", "a whale", "a lion", "a parrot", "a frog", "a squirrel", "a goat", "an octopus"]
PLACES = ["a small village", "a busy city", "a quiet forest", "a desert", "a mountain top", "an island",
          "a library", "a train station", "a farm", "a space station", "a beach", "an old lighthouse",
          "a school", "a bakery", "a museum", "a river boat", "a garden"]
MOODS = ["happy", "sad", "funny", "mysterious", "calm", "exciting", "hopeful", "cozy", "surprising"]
FORMS = ["a short poem", "a short story", "a haiku", "a limerick", "a two-sentence story", "a diary entry",
         "a short dialogue", "a fable"]
WRITING = ["an email to a colleague asking for a meeting", "a thank-you note to a teacher",
           "a short product description for a water bottle", "an invitation to a birthday party",
           "a polite complaint about a late delivery", "a welcome message for new club members",
           "a short speech for a friend's wedding", "a note to a neighbor about a lost cat",
           "a reminder to the team about a deadline", "a review of a cozy cafe", "a cover letter opening",
           "an apology for missing a meeting", "a short bio for a conference speaker"]
PAIRS = [("cats", "dogs"), ("tea", "coffee"), ("summer", "winter"), ("trains", "planes"), ("books", "movies"),
         ("city life", "country life"), ("renting", "buying a home"), ("email", "phone calls"),
         ("running", "swimming"), ("laptops", "desktops"), ("paper books", "e-readers"), ("the sun", "the moon"),
         ("rivers", "lakes"), ("working from home", "working in an office"), ("Python", "JavaScript")]
WORDS = ["serendipity", "resilience", "ephemeral", "curiosity", "empathy", "gravity", "harmony", "momentum",
         "nostalgia", "patience", "metaphor", "algorithm", "ecosystem", "democracy", "inflation", "habitat"]
AUDIENCES = ["a five-year-old", "a high school student", "a beginner", "a busy parent", "someone new to the topic"]
NUMBERS = ["three", "four", "five"]
FOODS = ["pancakes", "a tomato soup", "a fruit salad", "fried rice", "a simple pasta", "guacamole", "an omelette",
         "banana bread", "a vegetable curry", "lemonade", "a sandwich", "oatmeal cookies"]
NAMES = ["Anna", "Ben", "Carla", "David", "Emma", "Farid", "Grace", "Hugo", "Ines", "Jonas", "Kai", "Lena"]

TEMPLATES = [
    ("Explain {science} in simple terms.", ["science"]),
    ("Explain {science} to {audience}.", ["science", "audience"]),
    ("What is {tech} and how does it work?", ["tech"]),
    ("Explain {tech} to {audience}.", ["tech", "audience"]),
    ("Give me {number} interesting facts about {science}.", ["number", "science"]),
    ("Tell me briefly about {history}.", ["history"]),
    ("Why was {history} important?", ["history"]),
    ("Give me {number} tips for {hobby}.", ["number", "hobby"]),
    ("How do I get started with {hobby}?", ["hobby"]),
    ("How can I {goal}?", ["goal"]),
    ("Give me {number} practical tips to {goal}.", ["number", "goal"]),
    ("Write {form} about {animal} in {place}.", ["form", "animal", "place"]),
    ("Write a {mood} story about {animal} who lives near {place}.", ["mood", "animal", "place"]),
    ("Write {form} about {science}.", ["form", "science"]),
    ("Write {writing}.", ["writing"]),
    ("Compare {a} and {b}.", ["pair"]),
    ("What are the pros and cons of {a} versus {b}?", ["pair"]),
    ("What does the word \"{word}\" mean? Use it in a sentence.", ["word"]),
    ("How do I make {food}?", ["food"]),
    ("Give me a simple recipe for {food}.", ["food"]),
    ("Describe {place} in a few sentences.", ["place"]),
    ("What do {animal_plural} eat and where do they live?", ["animal"]),
    ("{name} has {n1} apples and buys {n2} more. How many apples does {name} have now?", ["name", "n1", "n2"]),
    ("A train travels {n1} kilometers in {n2} hours. What is its average speed?", ["n1", "n2"]),
    ("What is {n1} times {n2}? Show your steps.", ["n1", "n2"]),
    ("Summarize the main idea of {science} in two sentences.", ["science"]),
    ("Write a short plan for a day of {hobby}.", ["hobby"]),
    ("What are common mistakes beginners make in {hobby}?", ["hobby"]),
    ("List {number} reasons why people enjoy {hobby}.", ["number", "hobby"]),
    ("My friend {name} wants to {goal}. What should {name} do first?", ["name", "goal"]),
]


def plural(animal: str) -> str:
    word = animal.split(" ", 1)[1]
    return {"fox": "foxes", "octopus": "octopuses", "goat": "goats"}.get(word, word + "s")


SLOTS = {"science": SCIENCE, "tech": TECH, "history": HISTORY, "hobby": HOBBIES, "goal": GOALS, "place": PLACES,
         "mood": MOODS, "form": FORMS, "writing": WRITING, "word": WORDS, "audience": AUDIENCES,
         "number": NUMBERS, "food": FOODS, "name": NAMES}


def fill(template: str, slots: list[str], rng: random.Random) -> str:
    v = {}
    for s in slots:
        if s in SLOTS:
            v[s] = rng.choice(SLOTS[s])
        elif s == "animal":
            v["animal"] = rng.choice(ANIMALS)
            v["animal_plural"] = plural(v["animal"])
        elif s == "pair":
            v["a"], v["b"] = rng.choice(PAIRS)
        elif s in ("n1", "n2"):
            v[s] = str(rng.randint(2, 99))
    text = template.format(**v)
    return text[0].upper() + text[1:]


def build(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    seen, out = set(), []
    tries = 0
    while len(out) < n and tries < 50 * n:
        tries += 1
        t, slots = TEMPLATES[rng.randrange(len(TEMPLATES))]
        p = fill(t, slots, rng)
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def is_eval(prompt: str, every: int) -> bool:
    return int(hashlib.sha256(prompt.encode()).hexdigest(), 16) % every == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--count", type=int, default=4000, help="distinct prompts in total (default 4000)")
    ap.add_argument("--eval-every", type=int, default=20, help="about 1 in N prompts goes to the eval split")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out-dir", default=str(OUT))
    a = ap.parse_args()
    prompts = build(a.count, a.seed)
    out = Path(a.out_dir)
    splits = {"train": [], "eval": []}
    for p in prompts:
        splits["eval" if is_eval(p, a.eval_every) else "train"].append(p)
    for name, rows in splits.items():
        with open(out / f"prompts_{name}.jsonl", "w") as f:
            for i, p in enumerate(rows):
                f.write(json.dumps({"id": f"{name}_{i}", "messages": [{"role": "user", "content": p}]}) + "\n")
        print(f"{out / f'prompts_{name}.jsonl'}: {len(rows)} prompts")


if __name__ == "__main__":
    main()
