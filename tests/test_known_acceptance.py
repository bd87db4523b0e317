"""eval's counting, checked with drafts whose acceptance is known by construction (tests/drafts.py, "Known
acceptance"): on a tiny target that walks a cycle of tokens, a draft that proposes the target's own next tokens is
accepted at every position (acceptance length k + 1) and one that always runs a token ahead is never accepted
(exactly 1.00). Both go through the eval step as a user runs it, with the transformers evaluator and with a real
vLLM 0.32 serving them; the two evaluators must report the same figures, far closer than the 0.3 a trained draft
gains over an untrained one on the quality run. A draft of two decoder layers (`draft_layers` 2) that reaches the
target's own tokens only through both layers is counted k + 1 by both evaluators too.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from drafts import LAYER_SHARES, cycle_target, known_draft

K = 3
PROMPTS = [{"id": f"q{i}", "category": cat, "messages": [{"role": "user", "content": text}]}
           for i, (cat, text) in enumerate([("writing", "Write a short poem about rain."),
                                            ("math", "What is 12 times 7?"),
                                            ("coding", "How do I reverse a list in Python?")])]

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """(cycle target, always-accepted draft, never-accepted draft, prompts file, always-accepted two-layer draft)."""
    root = tmp_path_factory.mktemp("known")
    target = cycle_target(root)
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return (target, known_draft(target, root / "exact", lead=1), known_draft(target, root / "ahead", lead=2), prompts,
            known_draft(target, root / "deep", lead=1, layers=2))


def evaluate(target, draft, prompts, out, engine, python=sys.executable, max_tokens=16):
    extra = ["--threads", "1"] if engine == "hf" else ["--max-model-len", "256"]
    p = subprocess.run([str(python), "-m", "kimi_eagle_host.pipeline.eval", "--model", str(target), "--draft",
                        str(draft), "--prompts", str(prompts), "--engine", engine, "-k", str(K), "--max-tokens",
                        str(max_tokens), "--batch-sizes", "1", "--timing-prompts", "1", "--report-to", "none",
                        "--out", str(out), "--baseline-dir", str(out.parent / f"baselines-{engine}"), *extra],
                       capture_output=True, text=True, timeout=800)
    assert p.returncode == 0, p.stderr[-3000:]
    rep = json.loads((out / "report.json").read_text())
    assert rep["engine"] == engine and rep["turns"] == len(PROMPTS), rep
    return rep


def check_exact(rep, max_tokens=16):
    # every round accepts all K drafts and adds the target's own token: 1 + 4 rounds x 4 tokens = 17 >= 16
    assert rep["mean_acceptance_length"] == pytest.approx(K + 1), rep["card"]
    assert rep["acceptance_per_position"] == pytest.approx([1.0] * K), rep["acceptance_per_position"]
    assert rep["accepted_tokens"] == K * rep["drafts"] > 0
    assert "warnings" not in rep


def check_never(rep):
    assert rep["mean_acceptance_length"] == 1.0 and rep["accepted_tokens"] == 0, rep["card"]
    assert rep["acceptance_per_position"] == [0.0] * K
    # one round per token after the first: the count of drafts is what makes 1.00 a measurement, not a default
    assert rep["drafts"] >= len(PROMPTS) * 10, rep["drafts"]
    assert "none of the" in rep["headline"] and rep["warnings"], rep["headline"]


@pytest.fixture(scope="module")
def hf_reports(pair, tmp_path_factory):
    target, exact, ahead, prompts, deep = pair
    out = tmp_path_factory.mktemp("hf")
    return tuple(evaluate(target, draft, prompts, out / draft.name, "hf") for draft in (exact, ahead, deep))


def test_the_transformers_evaluator_counts_a_draft_of_the_targets_own_tokens_as_k_plus_1(hf_reports):
    exact = hf_reports[0]
    check_exact(exact)
    assert exact["drafts"] == 4 * len(PROMPTS)    # 16 tokens: the prefill's token, then 4 rounds of 4
    assert exact["identical_completions"] == 1.0


def test_the_transformers_evaluator_counts_a_draft_the_target_never_follows_as_1(hf_reports):
    ahead = hf_reports[1]
    check_never(ahead)
    assert ahead["drafts"] == 15 * len(PROMPTS)   # one round per token after the prefill's
    assert ahead["identical_completions"] == 1.0  # the draft changes the speed, never the text


def test_the_transformers_evaluator_runs_every_layer_of_a_two_layer_draft(hf_reports):
    deep = hf_reports[2]
    check_exact(deep)
    assert deep["drafts"] == 4 * len(PROMPTS)


def test_the_two_layer_draft_needs_both_layers(pair):
    """The construction, checked apart from eval: the deep draft's first layer alone turns the point 0.3 of a step
    (its proposal is then the token the target just gave, never accepted); both layers give the exact draft's."""
    import torch
    import torch.nn.functional as F

    from kimi_eagle_host.evaluation.spec_hf import load_draft

    target, exact, _, _, deep = pair
    assert LAYER_SHARES[2] == (0.3, 0.7)
    one, aux, to_target, embed = load_draft(str(exact), None, "cpu")
    two = load_draft(str(deep), None, "cpu")[0]
    assert len(two.layers) == 2 and len(one.layers) == 1
    H = embed.shape[1]
    feats = torch.zeros(1, 1, len(aux) * H)
    proposals = {}
    with torch.no_grad():
        for m in range(8):                                 # every point of the cycle as the first aux layer
            angle = 2 * torch.pi * torch.tensor(m / 8)
            feats[0, 0, :3] = torch.stack([angle.cos(), angle.sin(), torch.tensor(1.0)])
            ids = torch.zeros(1, 1, dtype=torch.long)
            pos = torch.ones(1, 1, dtype=torch.long)

            def propose(draft, layers):
                h = draft.fc(feats)
                for layer in layers:
                    h = layer.incremental(F.embedding(ids, embed), h, pos, None, [])
                return int(to_target[draft.lm_head(draft.norm(h)).argmax(-1)])

            proposals[m] = (propose(one, one.layers), propose(two, two.layers), propose(two, two.layers[:1]))
    assert all(a == b for a, b, _ in proposals.values()), proposals
    assert all(a != c for a, _, c in proposals.values()), proposals


def test_the_pair_is_what_the_module_says_on_the_target_itself(pair):
    """The construction, checked apart from eval: the target's greedy answer walks the cycle from the prompt's
    last token, so the two drafts' acceptance above is the evaluator's doing, not an accident of the prompts."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from drafts import CYCLE

    target = pair[0]
    tok = AutoTokenizer.from_pretrained(str(target))
    model = AutoModelForCausalLM.from_pretrained(str(target)).eval()
    ids = tok.apply_chat_template(PROMPTS[0]["messages"], add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)[0, ids.shape[1]:].tolist()
    start = CYCLE.index(out[0])
    assert out == [CYCLE[(start + i) % len(CYCLE)] for i in range(10)], out


@pytest.mark.vllm
@pytest.mark.timeout(1500)
def test_vllm_serving_the_same_drafts_counts_the_same(pair, hf_reports, tmp_path):
    """vLLM 0.32 (CPU, bf16) serves the drafts next to the target: its counters give exactly 1.00 for the draft the
    target never follows and k + 1 for the ones that propose its own tokens (one layer and two), as the transformers
    evaluator does."""
    from vllm_envs import SUITE_VLLM, env_python

    py = env_python(SUITE_VLLM)
    target, exact, ahead, prompts, deep = pair
    served_exact = evaluate(target, exact, prompts, tmp_path / "exact", "vllm", python=py)
    served_ahead = evaluate(target, ahead, prompts, tmp_path / "ahead", "vllm", python=py)
    served_deep = evaluate(target, deep, prompts, tmp_path / "deep", "vllm", python=py)
    assert served_ahead["baseline"]["reused"]     # the target alone answered once, for both drafts
    assert f"vLLM {SUITE_VLLM}" in served_exact["card"]
    check_never(served_ahead)
    for served in (served_exact, served_deep):      # the two-layer draft: vLLM runs its second layer as ours does
        assert served["accepted_tokens"] > 0 and served["drafts"] >= len(PROMPTS) * 3
        assert served["mean_acceptance_length"] >= K + 1 - 0.05, served["card"]
        assert min(served["acceptance_per_position"]) >= 0.98, served["acceptance_per_position"]
    for served, ours in zip((served_exact, served_ahead, served_deep), hf_reports):
        assert abs(served["mean_acceptance_length"] - ours["mean_acceptance_length"]) <= 0.05, (served["card"],
                                                                                              ours["card"])
