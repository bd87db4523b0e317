"""Curation of a prompt set (kimi_eagle_host/data/curation.py): repeats found exactly and nearly, first turns of
unusable length and text in other scripts dropped, each drop counted by reason, and the same input always keeping
the same conversations."""
from __future__ import annotations

import random

import pytest

from kimi_eagle_host.data.curation import Policy, curate, script_share
from kimi_eagle_host.settings import SETTINGS, SettingError, check

WORDS = ("river mountain engine paper garden window silver basket orange candle rocket pillow forest ladder "
         "harbor violin marble thunder button castle lantern meadow needle oyster pepper quartz saddle tunnel").split()


def paragraph(seed: int, n: int = 150) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n)) + "."


def kept_ids(items, policy):
    kept, report = curate(items, policy)
    return [items[i][0] for i in kept], report


def test_exact_and_near_repeats_are_dropped_and_the_first_is_kept():
    base = paragraph(1)
    words = base.split()
    words[70] = "zeppelin"  # one word of 150 changed: ~97 % of the word 5-grams shared
    items = [
        ("a", [base]),
        ("b", [paragraph(2)]),
        ("a-shouted", [base.upper().replace(" ", "  ") + "!!"]),  # the same text once normalised
        ("a-edited", [" ".join(words)]),
        ("a-then-more", [base, paragraph(4)]),  # the same first turn, then a conversation of its own
        ("c", [paragraph(3)]),
    ]
    ids, report = kept_ids(items, Policy("near"))
    assert ids == ["a", "b", "a-then-more", "c"]
    assert report["in"] == 6 and report["out"] == 4
    assert report["dropped"] == {"exact_duplicate": 1, "near_duplicate": 1}
    assert report["dropped_examples"] == {"exact_duplicate": ["a-shouted (repeats a)"],
                                          "near_duplicate": ["a-edited (repeats a)"]}
    # exact alone keeps the edited copy; off keeps everything
    assert kept_ids(items, Policy("exact"))[0] == ["a", "b", "a-edited", "a-then-more", "c"]
    assert kept_ids(items, Policy("off"))[0] == [i for i, _ in items]


def test_texts_that_merely_share_words_are_not_repeats():
    # the same vocabulary in another order: shingles of five words differ, so nothing is a near repeat
    items = [(str(s), [paragraph(s)]) for s in range(40)]
    ids, report = kept_ids(items, Policy("near"))
    assert len(ids) == 40 and report["dropped"] == {}


def test_near_repeats_in_a_language_without_spaces_are_found_by_characters():
    rng = random.Random(5)
    text = "".join(rng.choice("天地玄黄宇宙洪荒日月盈昃辰宿列张寒来暑往秋收冬藏") for _ in range(400))
    edited = text[:200] + "龙" + text[201:]
    ids, report = kept_ids([("zh", [text]), ("zh-edited", [edited])], Policy("near"))
    assert ids == ["zh"] and report["dropped"] == {"near_duplicate": 1}


def test_length_and_script_filters_drop_with_their_reason():
    items = [
        ("ok", ["Explain how a rainbow forms, please."]),
        ("short", ["hi"]),
        ("long", ["x" * 5000]),
        ("russian", ["Объясните, пожалуйста, как образуется радуга на небе."]),
        ("chinese", ["请解释一下彩虹是怎样形成的。"]),
        ("numbers", ["12345 + 67890 = ?"]),  # no letters: nothing to judge, kept
        ("mixed", ["Translate to French: 'Объясните' means explain, and the rest of this sentence is English."]),
        ("none", []),
    ]
    ids, report = kept_ids(items, Policy("off", min_chars=8, max_chars=1000, scripts=("latin",)))
    assert ids == ["ok", "numbers", "mixed"]
    assert report["dropped"] == {"too_short": 1, "too_long": 1, "other_script": 2, "no_user_turn": 1}
    assert report["dropped_examples"]["other_script"] == ["russian", "chinese"]
    ids, _ = kept_ids(items, Policy("off", scripts=("latin", "han")))
    assert "chinese" in ids and "russian" not in ids
    assert script_share("Привет мир", ("cyrillic",)) == 1.0 and script_share("42", ("latin",)) is None


def test_the_same_input_keeps_the_same_conversations_and_order_decides_which():
    items = [(f"r{i}", [paragraph(i % 7, 60)]) for i in range(30)]  # 7 distinct texts, each repeated
    first, report = kept_ids(items, Policy("near"))
    assert first == [f"r{i}" for i in range(7)] and report["out"] == 7
    assert kept_ids(items, Policy("near"))[0] == first
    reversed_items = items[::-1]
    assert kept_ids(reversed_items, Policy("near"))[0] == [f"r{i}" for i in range(29, 22, -1)]


@pytest.mark.parametrize("value, ok", [("latin", "latin"), ("latin, han,latin", "latin,han"), ("klingon", None),
                                       ("", None)])
def test_the_scripts_setting_accepts_known_scripts_only(value, ok):
    if ok:
        assert check(SETTINGS["scripts"], value) == ok
    else:
        with pytest.raises(SettingError, match="scripts: .*latin"):
            check(SETTINGS["scripts"], value)
