"""YAML files built to exhaust the loader, given as the inventory or as a recipe (`-c`): a few hundred bytes
of nested aliases (a "billion laughs"), 100,000 nested brackets, a recursive alias, a file without end. Each
is one line naming the file, exit 2, in seconds, and nothing is done; ordinary anchors and merge keys still work.
"""

from __future__ import annotations

import json

import time

import pytest

from conftest import make_env, one_line_usage_error

# Nine levels of nine aliases: 9^9 (~387 million) values from ~400 bytes of text.
BOMB = "a0: &a0 [x,x,x,x,x,x,x,x,x]\n" + "".join(
    f"a{i}: &a{i} [{','.join([f'*a{i - 1}'] * 9)}]\n" for i in range(1, 10))
DEEP = "epochs: " + "[" * 100_000 + "\n"
LOOP = "epochs: &a [1, *a]\n"
# Generous on a loaded 2-core machine; before the bounds the bomb ran for minutes.
SECONDS = 60


def _refused(env, tmp_path, text: str, given_as: str) -> str:
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    render = ["render", "job", "train", "--host", "local", "--out", str(tmp_path / "out")]
    t0 = time.monotonic()
    if given_as == "inventory":
        r = env.cli("--inventory", str(bad), *render, timeout=SECONDS)
    else:
        r = env.cli(*render, "-c", str(bad), timeout=SECONDS)
    took = time.monotonic() - t0
    line = one_line_usage_error(r)
    assert str(bad) in line and took < SECONDS / 2, (line, took)
    assert not (tmp_path / "out").exists()  # nothing rendered
    return line


@pytest.mark.parametrize("given_as", ["inventory", "recipe"])
def test_an_alias_bomb_is_one_line_in_seconds(tmp_path, given_as):
    assert len(BOMB) < 500
    env = make_env(tmp_path, None)
    assert "aliases expand to more than" in _refused(env, tmp_path, BOMB, given_as)


@pytest.mark.parametrize("given_as", ["inventory", "recipe"])
def test_deep_nesting_is_one_line_not_a_recursion_error(tmp_path, given_as):
    env = make_env(tmp_path, None)
    assert "nested deeper than" in _refused(env, tmp_path, DEEP, given_as)


@pytest.mark.parametrize("given_as", ["inventory", "recipe"])
def test_an_alias_inside_its_own_anchor_is_one_line(tmp_path, given_as):
    env = make_env(tmp_path, None)
    assert "contains it" in _refused(env, tmp_path, LOOP, given_as)


@pytest.mark.parametrize("what", ["a 2 MiB file", "a file without end"])
def test_a_file_beyond_the_size_cap_is_refused_without_reading_it_whole(tmp_path, what):
    env = make_env(tmp_path, None)
    recipe = "/dev/zero"
    if what == "a 2 MiB file":
        recipe = tmp_path / "big.yaml"
        recipe.write_text("epochs: 2\n" + "# padding\n" * 200_000)
    r = env.cli("render", "job", "train", "--host", "local", "--out", str(tmp_path / "out"), "-c", str(recipe),
                timeout=SECONDS)
    assert f"{recipe}: larger than 1 MiB" in one_line_usage_error(r)


def test_ordinary_anchors_and_merge_keys_still_work(tmp_path):
    env = make_env(tmp_path, None)
    env.write_inventory(f"""
defaults: &common
  python: python3
hosts:
  local:
    <<: *common
    transport: local
    workdir: {tmp_path / 'w'}
    pipeline: &small {{model: /models/m, dataset: /d.jsonl, epochs: 5}}
  other:
    address: other.example
    workdir: /srv/w
    pipeline: *small
""")
    out = tmp_path / "out"
    r = env.cli("render", "job", "train", "--host", "local", "--out", str(out))
    assert r.code == 0, r.stderr
    assert json.loads(next(out.rglob("settings.json")).read_text())["steps"]["train"]["epochs"] == 5


# A scalar YAML reads by its form but cannot build: an impossible date, an int past Python's 4300 digits.
UNREADABLE = {"impossible date": ("2024-02-30", "'2024-02-30' cannot be read as timestamp"),
              "5000 digits": ("1" * 5000, "'11111111111111111111'... (5000 characters) cannot be read as int")}


@pytest.mark.parametrize("case", sorted(UNREADABLE))
@pytest.mark.parametrize("given_as", ["inventory", "recipe"])
def test_a_value_yaml_cannot_build_is_one_line_with_its_line(tmp_path, given_as, case):
    value, words = UNREADABLE[case]
    env = make_env(tmp_path, None)
    text = f"hosts:\n  local:\n    transport: local\n    port: {value}\n" if given_as == "inventory" else \
        f"epochs: 2\nseq_len: {value}\n"
    line = _refused(env, tmp_path, text, given_as)
    assert f"bad.yaml:{4 if given_as == 'inventory' else 2}: {words}" in line and "quote it" in line, line


def test_a_number_beyond_any_float_is_refused_naming_the_key(tmp_path):
    env = make_env(tmp_path, None)
    line = _refused(env, tmp_path, f"lr: {'1' * 4000}\n", "recipe")
    assert "field lr: expected a finite number (got an integer of 4000 digits)" in line, line


def test_an_override_yaml_cannot_build_is_the_text_as_written(tmp_path):
    """`dataset=2024-02-30` names a dataset (a date-like folder), not an impossible date."""
    env = make_env(tmp_path, None)
    out = tmp_path / "out"
    r = env.cli("render", "job", "prepare", "--host", "local", "--out", str(out), "model=/models/m",
                "dataset=2024-02-30")
    assert r.code == 0, r.stderr
    assert json.loads(next(out.rglob("settings.json")).read_text())["pipeline"]["dataset"] == "2024-02-30"
    line = one_line_usage_error(env.cli("render", "job", "train", "--host", "local", "--out", str(tmp_path / "o2"),
                                        "seq_len=" + "1" * 5000))
    assert "override seq_len=" in line and "expected an integer (got '1111" in line and "(5000 characters)" in line
    assert not (tmp_path / "o2").exists()
