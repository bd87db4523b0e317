#!/usr/bin/env python3
"""Pipeline step `eval`: how much an EAGLE-3 draft speeds up its target, measured the way the field reports it.

--prompts is a chat JSONL file or a benchmark name: `mt-bench` (MT-Bench's 80 questions, two turns each,
eight categories; see data_sources.py). Every user turn is answered in turn, the second conditioned on the
target's own first answer (the answers of the run without the draft are the context for later turns, so
both runs see identical prompts). --num-prompts N takes N questions round-robin over the categories.

Engines:
  vllm  the host's vLLM serves target + draft (speculative_config method eagle3, k draft tokens, greedy);
        acceptance comes from vLLM's own counters (llm.get_metrics()), read around each category's batch.
  hf    transformers: the draft proposes k tokens, the target verifies them in one forward pass, greedy
        (pipeline/spec_hf.py) - the same definition, for hosts without a vLLM that serves the target's EAGLE-3.
        Batch 1 only: larger --batch-sizes are reported as not measured.
  auto  vllm when it can serve EAGLE-3 for this target, else hf (saying why).

Reported (out/eval/report.json, report.txt and, with matplotlib, report.png; atomically), as a model card reads: the benchmark, k, the
engine and its version; mean acceptance length = 1 + accepted / drafts, overall, per turn and per category;
acceptance per draft position as vLLM counts it (position i only when every earlier one was accepted);
output tokens/s with and without the draft at each --batch-sizes entry (default 1 and 16); and the fraction
of turns whose greedy completion is identical with and without the draft (reported, not asserted: batch
shapes change bf16 numerics).
The target's answers and tokens/s without the draft are recorded under --baseline-dir (default
<output-dir>/eval/baselines), keyed by everything that changes them; the next eval of another draft with the same
target, prompts and settings takes them from there and starts only the engine with the draft (--no-reuse-baseline:
run the target again).
The draft's config is checked against the target before any model is loaded (hidden size, vocab size,
aux layer ids), and so are the prompts (UTF-8, no lone surrogates, a first turn that fits the context);
a mismatch is bad input (exit 2) naming the file and field.
"""
import os
import sys


import hashlib
import json
import time

from kimi_eagle_host import compute_dtype, cpu_threads
from kimi_eagle_host.draft import parity
from kimi_eagle_host.target.tokenizer import chat_template_sha256, load_tokenizer
from kimi_eagle_host.step_runtime import parse_step_args
from kimi_eagle_host.step_runtime import (BadInput, Refused, atomic_write, atomic_write_json, files_digest,
                                          job_headline, package_dir, log, model_fingerprint, model_identity, run_step,
                                          stdout_for_result_only)
from kimi_eagle_host.training.tracker import open_tracker, tracking_dir, wanted
from kimi_eagle_host.model_size import text_config_of
from kimi_eagle_host.vllm_compat import engine_env_defaults, size_engine
from kimi_eagle_host.engine import context_length
# what choose serves with too: whether vLLM can serve EAGLE-3 here (bench/gpu/kimi_stage.py asks it here), and
# vLLM's spec-decode counters
from kimi_eagle_host.evaluation.served import ServedEngine, vllm_support

HEADLINE_PREFIX = "eval: "


# ----------------------------------------------------------------------------------------------------
# checks before any model load

def read_json(path, what):
    if not os.path.isfile(path):
        raise BadInput(f"{path}: missing ({what})")
    try:
        with open(path) as f:
            return json.load(f)
    except ValueError as e:
        raise BadInput(f"{path}: not valid JSON ({e})") from None


def target_text_config(model_dir):
    cfg = read_json(os.path.join(model_dir, "config.json"), "--model must be a local model folder")
    tc = text_config_of(cfg)
    for field in ("hidden_size", "vocab_size", "num_hidden_layers"):
        if not isinstance(tc.get(field), int):
            raise BadInput(f"{model_dir}/config.json: no integer '{field}'")
    return cfg, tc


def check_draft(draft_dir, model_dir):
    """Refuse a draft that cannot belong to this target; returns (draft config, target text config)."""
    path = os.path.join(draft_dir, "config.json")
    dc = read_json(path, "--draft must be a speculators Eagle3 export, e.g. out/draft/export")
    _, tc = target_text_config(model_dir)
    tl = dc.get("transformer_layer_config")
    if dc.get("speculators_model_type") != "eagle3" or not isinstance(tl, dict):
        raise BadInput(f"{path}: not a speculators Eagle3 config (speculators_model_type "
                       f"{dc.get('speculators_model_type')!r}, transformer_layer_config missing?)")
    N = tc["num_hidden_layers"]
    if tl.get("hidden_size") != tc["hidden_size"]:
        raise BadInput(f"{path}: transformer_layer_config.hidden_size {tl.get('hidden_size')} != the target's "
                       f"hidden_size {tc['hidden_size']} ({model_dir})")
    if tl.get("vocab_size") != tc["vocab_size"]:
        raise BadInput(f"{path}: transformer_layer_config.vocab_size {tl.get('vocab_size')} != the target's "
                       f"vocab_size {tc['vocab_size']} ({model_dir})")
    aux = dc.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) for i in aux):
        raise BadInput(f"{path}: eagle_aux_hidden_state_layer_ids must be a non-empty list of integers")
    bad = [i for i in aux if not 0 <= i < N]
    if bad:
        raise BadInput(f"{path}: eagle_aux_hidden_state_layer_ids {aux}: {bad} beyond the target's layers "
                       f"(valid 0..{N - 1}: {model_dir} has {N} decoder layers)")
    if not isinstance(dc.get("draft_vocab_size"), int) or not 0 < dc["draft_vocab_size"] <= tc["vocab_size"]:
        raise BadInput(f"{path}: draft_vocab_size {dc.get('draft_vocab_size')!r} must be 1..{tc['vocab_size']}")
    weights = os.path.join(draft_dir, "model.safetensors")
    if not os.path.isfile(weights):
        raise BadInput(f"{weights}: missing (--draft must be a speculators Eagle3 export)")
    from kimi_eagle_host.draft.draft_model import nonfinite_weights   # before the engines' load (for a 1T target, half an hour)

    bad = nonfinite_weights(weights)
    if bad:
        raise BadInput(f"{weights}: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return dc, tc


# ----------------------------------------------------------------------------------------------------
# prompts (the engine choice and vLLM's counters: evaluation/served.py)

def chat_prompt_ids(tok, messages):
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if isinstance(ids, dict) or hasattr(ids, "keys"):
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def eos_ids_of(model_dir, tok):
    ids = set()
    for src in (os.path.join(model_dir, "generation_config.json"), os.path.join(model_dir, "config.json")):
        if os.path.isfile(src):
            with open(src) as f:
                e = json.load(f).get("eos_token_id")
            ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    if tok.eos_token_id is not None:
        ids.add(int(tok.eos_token_id))
    return ids


# ----------------------------------------------------------------------------------------------------
# engines: one interface, run(chats) -> ([(text, token ids)], spec-decode counters of that call)

def zero_counters(k):
    return {"drafts": 0, "accepted": 0, "per_pos": [0] * k}


def add_counters(total, c):
    total["drafts"] += c["drafts"]
    total["accepted"] += c["accepted"]
    total["per_pos"] = [a + b for a, b in zip(total["per_pos"], c["per_pos"])]


class HFRunner:
    """spec_hf.HFEngine one prompt at a time (batch 1); k = 0 decodes without the draft."""

    def __init__(self, engine, tok, eos, k, max_tokens):
        self.eng, self.tok, self.eos, self.k, self.max_tokens = engine, tok, eos, k, max_tokens

    def can_batch(self, batch_size):
        return batch_size == 1

    def __call__(self, chats):
        outs, tot = [], zero_counters(self.k)
        for chat in chats:
            o, st = self.eng.generate(chat_prompt_ids(self.tok, chat), self.max_tokens, self.eos, self.k)
            outs.append((self.tok.decode(o, skip_special_tokens=True), list(o)))
            add_counters(tot, {**st, "per_pos": st["per_pos"] or [0] * self.k})
        return outs, tot

    def close(self):
        pass


# The flags that say how much one vLLM engine of this step holds at once (engine_load; preflight reads them too).
ENGINE_FLAGS = ("max_model_len", "max_batch", "batch_sizes")


def engine_load(args):
    """(tokens per sequence, sequences at once) of this step's vLLM engines: the acceptance pass sends --max-batch
    prompts per call and the timing the largest of --batch-sizes, each within --max-model-len."""
    return (int(args.max_model_len or context_length.PREFLIGHT_CONTEXT),
            max(int(args.max_batch), *parse_batch_sizes(str(args.batch_sizes))))


class VllmRunner(ServedEngine):
    """One vLLM engine: the target alone (k = 0) or the target with the draft (k > 0)."""

    def __init__(self, args, k, memory):
        """`memory`: vllm_compat.size_engine's answer (its environment is set already); both engines take it."""
        super().__init__(args, os.path.abspath(args.draft), k, memory)

    def can_batch(self, batch_size):
        return True

    def __call__(self, chats):
        res, c = self.counted(lambda llm, sp: llm.chat(chats, sp, use_tqdm=False))
        return [(r.outputs[0].text, list(r.outputs[0].token_ids)) for r in res], c


# ----------------------------------------------------------------------------------------------------
# the measurement, the same for both engines

def turn_prompts(convs, budget, base_answers, r):
    """[(conversation index, chat)] for turn r: the target's own earlier answers ([text, token ids] per turn) as
    context, as a client sends them back (a thinking target's reasoning apart: TokenBudget.reply); a turn that no
    longer fits the context ends its conversation there (counted by the caller)."""
    out, cut = [], 0
    for i, c in enumerate(convs):
        if r >= len(c.user_turns) or len(base_answers[i]) < r:
            continue
        if r > 0:
            used = c.first_tokens + sum(len(base_answers[i][j][1]) + budget.per_message for j in range(r))
            used += budget.count([c.user_turns[r]])[0] + budget.per_message
            if not budget.fits(used):
                cut += 1
                continue
        out.append((i, c.messages([budget.reply(t, ids) for t, ids in base_answers[i][:r]])))
    return out, cut


def timed(runner, chats, batch_size):
    """Output tokens per second decoding `chats` in batches of `batch_size` (after the runner's warm-up)."""
    tokens, t0 = 0, time.perf_counter()
    for i in range(0, len(chats), batch_size):
        outs, _ = runner(chats[i:i + batch_size])
        tokens += sum(len(ids) for _, ids in outs)
    return tokens / max(time.perf_counter() - t0, 1e-9), tokens


def baseline_pass(runner, convs, budget, batch_sizes, firsts, max_batch):
    """The target alone: its answer to every turn (the context of the later turns, for both passes) and its
    tokens/s per batch size. JSON-ready, so the next eval of another draft can take it from the file."""
    rounds = max(len(c.user_turns) for c in convs)
    answers, cut = [[] for _ in convs], 0
    runner(firsts[:1])  # warm-up: the first call pays one-time costs
    for r in range(rounds):
        todo, n_cut = turn_prompts(convs, budget, answers, r)
        cut += n_cut
        for lo in range(0, len(todo), max_batch):
            part = todo[lo:lo + max_batch]
            outs, _ = runner([chat for _, chat in part])
            for (i, _), (text, ids) in zip(part, outs):
                answers[i].append([text, list(ids)])
        log(f"eval: without the draft, turn {r + 1}: {len(todo)} prompts")
    speeds = {str(b): list(timed(runner, firsts, b)) for b in batch_sizes if runner.can_batch(b)}
    return {"answers": answers, "speeds": speeds, "cut": cut}


def measure(open_runner, convs, budget, k, batch_sizes, timing_n, max_batch, baseline=None):
    """Baseline (unless `baseline`, an earlier run's, is given) then speculative: per-turn outputs, counters per
    (turn, category), tokens/s per batch size."""
    rounds = max(len(c.user_turns) for c in convs)
    firsts = [c.messages([]) for c in convs][:timing_n]
    if baseline is None:
        runner = open_runner(0)
        baseline = baseline_pass(runner, convs, budget, batch_sizes, firsts, max_batch)
        runner.close()
    answers = baseline["answers"]
    speeds = {b: {} for b in batch_sizes}
    for b, got in baseline["speeds"].items():
        speeds[int(b)]["without_draft"] = tuple(got)

    runner = open_runner(k)
    runner(firsts[:1])
    groups, same, spec_turns, spec_tokens = {}, 0, 0, 0
    for r in range(rounds):
        todo, _ = turn_prompts(convs, budget, answers, r)
        by_cat = {}
        for i, chat in todo:
            by_cat.setdefault(convs[i].category, []).append((i, chat))
        for cat, part in by_cat.items():
            for lo in range(0, len(part), max_batch):
                piece = part[lo:lo + max_batch]
                outs, cnt = runner([chat for _, chat in piece])
                add_counters(groups.setdefault((r, cat), zero_counters(k)), cnt)
                for (i, _), (_, ids) in zip(piece, outs):
                    same += list(ids) == answers[i][r][1]
                    spec_turns += 1
                    spec_tokens += len(ids)
        log(f"eval: with the draft, turn {r + 1}: {len(todo)} prompts")
    for b in batch_sizes:
        if runner.can_batch(b):
            speeds[b]["with_draft"] = timed(runner, firsts, b)
    runner.close()
    return {"groups": groups, "speeds": speeds, "identical": same / max(spec_turns, 1), "turns": spec_turns,
            "output_tokens": spec_tokens, "cut": baseline["cut"], "timing_prompts": len(firsts),
            "baseline": baseline}


# ----------------------------------------------------------------------------------------------------
# the target alone, recorded: the next eval of another draft on the same target, prompts and settings takes its
# answers and tokens/s from the file instead of starting an engine for them (for a 1T target, a half-hour load)

def baseline_settings(args, prov, engine_name, batch_sizes, timing_n, tok) -> dict:
    """Everything that changes the target's answers or its tokens/s without the draft."""
    return {"model": model_identity(args.model), "weights": model_fingerprint(args.model),
            "chat_template": chat_template_sha256(tok),
            "prompts_sha256": prov.get("sha256"), "num_prompts": args.num_prompts, "max_turns": args.max_turns,
            "max_tokens": args.max_tokens, "max_model_len": args.max_model_len, "max_batch": args.max_batch,
            "batch_sizes": batch_sizes, "timing_prompts": timing_n, "engine": engine_name, "tp_size": args.tp_size,
            "enforce_eager": args.enforce_eager,
            # the code that runs the target: its engine (served.py, vllm_compat's sizing and arguments) included
            "code": files_digest(package_dir(), ("pipeline/eval.py", "data/prompts.py", "data/reasoning.py",
                                                 "evaluation/spec_hf.py", "evaluation/served.py", "vllm_compat.py",
                                                 "target/tokenizer.py"))}


def baseline_file(args, settings) -> str:
    key = hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]
    folder = args.baseline_dir or os.path.join(args.output_dir, "eval", "baselines")
    return os.path.abspath(os.path.join(folder, f"{key}.json"))


def recorded_baseline(path, settings, n_convs):
    """The recorded run of the target alone, or None (none yet, unreadable, or not this run's)."""
    try:
        with open(path) as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return None
    if rec.get("settings") != settings or len(rec.get("answers") or ()) != n_convs:
        return None
    return rec


def drafting_problems(m, engine_name) -> list[str]:
    """What makes the acceptance figures mean nothing. Raises Refused when the engine decoded with the draft
    attached but counted no drafts at all: an acceptance length of 1.00 would then be reported for a draft that
    never ran (a vLLM whose spec-decode counters are named otherwise, a speculative config it ignored). Returns
    warnings for what was measured but is worth a look: drafts made and none accepted."""
    drafts, accepted = total_counters(m)["drafts"], total_counters(m)["accepted"]
    # Each turn's first token comes from the prefill, with nothing to verify; every later step drafts.
    if drafts == 0 and m["output_tokens"] > m["turns"]:
        raise Refused(f"{engine_name} decoded {m['output_tokens']} tokens in {m['turns']} turns with the draft "
                      f"attached but counted no drafts: speculative decoding did not run, so there is no acceptance "
                      f"to report")
    if drafts and not accepted:
        return [f"none of the {drafts} drafts had a token accepted: the draft predicts nothing of this target "
                f"(a target with random weights, too few training steps, or features from other layers)"]
    return []


# ----------------------------------------------------------------------------------------------------
# the report

def total_counters(m) -> dict:
    return {key: sum(c[key] for c in m["groups"].values()) for key in ("drafts", "accepted")}


def acceptance(c):
    drafts = max(c["drafts"], 1)
    return {"mean_acceptance_length": round(1 + c["accepted"] / drafts, 4),
            "acceptance_per_position": [round(a / drafts, 4) for a in c["per_pos"]],
            "drafts": c["drafts"], "accepted_tokens": c["accepted"]}


def summarize(m, k, convs, meta, batch_sizes):
    total, per_turn, per_cat = zero_counters(k), {}, {}
    for (r, cat), c in sorted(m["groups"].items(), key=lambda kv: (kv[0][0], str(kv[0][1]))):
        add_counters(total, c)
        add_counters(per_turn.setdefault(str(r + 1), zero_counters(k)), c)
        if cat is not None:
            add_counters(per_cat.setdefault(cat, zero_counters(k)), c)
    throughput = []
    for b in batch_sizes:
        s = m["speeds"][b]
        if "with_draft" not in s or "without_draft" not in s:
            throughput.append({"batch_size": b, "measured": False,
                               "why": f"the {meta['engine']} evaluator decodes one sequence at a time"})
            continue
        (w, wt), (wo, wot) = s["with_draft"], s["without_draft"]
        throughput.append({"batch_size": b, "measured": True, "prompts": m["timing_prompts"],
                           "tokens_per_s": {"without_draft": round(wo, 2), "with_draft": round(w, 2)},
                           "output_tokens": {"without_draft": wot, "with_draft": wt},
                           "speedup": round(w / max(wo, 1e-9), 3)})
    first = next((t for t in throughput if t["measured"]), None)
    rep = {"ok": True, "step": "eval", **meta, "num_speculative_tokens": k, "prompts": len(convs),
           "turns": m["turns"], **acceptance(total),
           "per_turn": {t: acceptance(c) for t, c in per_turn.items()},
           "per_category": {cat: acceptance(c) for cat, c in sorted(per_cat.items())},
           "throughput": throughput,
           "tokens_per_s": first["tokens_per_s"] if first else None,
           "speedup": first["speedup"] if first else None,
           "identical_completions": round(m["identical"], 4), "turns_cut_for_context": m["cut"]}
    speed = "; ".join(f"batch {t['batch_size']}: {t['tokens_per_s']['with_draft']:.1f} tok/s with draft vs "
                      f"{t['tokens_per_s']['without_draft']:.1f} without ({t['speedup']:.2f}x)"
                      for t in throughput if t["measured"])
    rep["card"] = (f"{meta['benchmark']} ({len(convs)} prompts, {m['turns']} turns), k={k}, {meta['engine_name']}: "
                   f"acceptance length {rep['mean_acceptance_length']:.2f} (per position "
                   f"{', '.join(f'{a:.0%}' for a in rep['acceptance_per_position'])}); {speed}")
    trained = meta.get("draft_training") or {}
    if trained.get("conversations") is not None:
        rep["card"] += (f"; the draft: {trained['conversations']} training conversations, "
                        + (f"checkpoint of step {trained['chosen_step']} chosen by serving"
                           if trained.get("chosen_step") is not None else f"the last of {trained['steps']} steps"))
    rep["headline"] = (f"acceptance length {rep['mean_acceptance_length']:.2f} at k={k} on {meta['benchmark']} "
                       f"(per position {', '.join(f'{a:.0%}' for a in rep['acceptance_per_position'])}); {speed}; "
                       f"identical completions {rep['identical_completions']:.0%} [{meta['engine_name']}, "
                       f"{len(convs)} prompts]")
    return rep


# ----------------------------------------------------------------------------------------------------

# ----------------------------------------------------------------------------------------------------
# the served smoke test (--smoke): a run whose export vLLM cannot serve does not end as succeeded

SMOKE_PROMPTS = 4


def smoke_verdict(counters, engine_name) -> dict:
    """The smoke record of a vLLM pass with the draft attached: Refused unless it accepted draft tokens."""
    if not counters["accepted"]:
        raise Refused(f"served smoke test: {engine_name} served the draft but accepted none of its "
                      f"{counters['drafts']} drafted tokens: the export cannot be served (see the parity checks)")
    return {"served_smoke": "passed", "smoke_drafts": counters["drafts"], "smoke_accepted": counters["accepted"]}


def full_eval_smoke(m, meta, why):
    """(--smoke's record, the Refused to raise once the report is written) of a full eval's measurement."""
    if meta["engine"] != "vllm":
        return {"served_smoke": f"skipped ({why or 'the transformers engine was asked for'})"}, None
    try:
        return smoke_verdict(total_counters(m), meta["engine_name"]), None
    except Refused as e:
        return {"served_smoke": f"failed ({e})"}, e


def served_smoke(args, out_dir) -> dict:
    """--smoke without --prompts: vLLM loads target + export and answers a few bundled prompts with the draft;
    skipped (saying why) where the host's vLLM cannot serve EAGLE-3 for this target."""
    from kimi_eagle_host.data.prompts import read_conversations

    engine_env = engine_env_defaults()  # before vLLM is imported
    ok, info = vllm_support(target_text_config(args.model)[0])
    if not ok:
        rec = {"served_smoke": f"skipped ({info})"}
    else:
        stdout_for_result_only()
        path = os.path.join(package_dir(), "sample_data", "prompts_eval.jsonl")
        chats = [c.messages([]) for c in read_conversations(path, 0, label=path)[:SMOKE_PROMPTS]]
        runner = VllmRunner(args, args.num_speculative_tokens,
                            size_engine("eval", args.model, args.tp_size, *engine_load(args)))
        try:
            _, counters = runner(chats)
        finally:
            runner.close()
        rec = {**smoke_verdict(counters, f"vLLM {info}"), "smoke_prompts": len(chats)}
    log(f"eval: served_smoke: {rec['served_smoke']}")
    os.makedirs(out_dir, exist_ok=True)
    # which job wrote it: `pull JOB` takes it for that job (pull's OWN_FILES)
    atomic_write_json(os.path.join(out_dir, "smoke.json"),
                      {**rec, "draft": args.draft, "job_id": os.environ.get("KIMI_EAGLE_JOB_ID")})
    return {"ok": True, "step": "eval", **rec, "draft": args.draft, "engine_env": engine_env}


def parse_batch_sizes(text):
    try:
        sizes = sorted({int(x) for x in text.split(",") if x.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        raise BadInput(f"--batch-sizes {text!r}: expected positive integers separated by commas, e.g. 1,16")
    return sizes


def open_engine(args, engine: str, tok, engine_env: dict):
    """(the report's engine fields, kk -> a runner drafting kk tokens) for the chosen engine (vllm or hf)."""
    if engine == "vllm":
        stdout_for_result_only()  # vLLM logs to stdout, also from its workers
        memory = size_engine("eval", args.model, args.tp_size, *engine_load(args))
        import vllm

        meta = {"engine": "vllm", "vllm_version": vllm.__version__, "dtype": args.vllm_dtype,
                "device": device_name(), "engine_env": engine_env, "engine_memory": memory["says"]}
        meta["engine_name"] = f"vLLM {vllm.__version__} ({args.vllm_dtype}, {meta['device']})"
        open_runner = lambda kk: VllmRunner(args, kk, memory)  # noqa: E731
    else:
        import torch

        from kimi_eagle_host.evaluation.spec_hf import HFEngine

        device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = compute_dtype.resolve(args.dtype, device, log)
        cpu_threads.set_threads(args.threads)
        eng = HFEngine(args.model, args.draft, device, dtype)
        eos = eos_ids_of(args.model, tok)
        meta = {"engine": "hf", "device": device, "dtype": dtype}
        import transformers

        meta["engine_name"] = f"transformers {transformers.__version__} ({dtype}, {device_name() if device == 'cuda' else 'cpu'})"
        open_runner = lambda kk: HFRunner(eng, tok, eos, kk, args.max_tokens)  # noqa: E731
    return meta, open_runner


def write_report(rep: dict, out_dir: str) -> None:
    """report.json, and its chart (report.png, or report.txt on a host without matplotlib)."""
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(os.path.join(out_dir, "report.json"), rep)
    from kimi_eagle_host.evaluation.report_plot import render_report

    files = render_report(rep)
    for name, data in files.items():
        atomic_write(os.path.join(out_dir, name), data)
    if "report.png" not in files and os.path.exists(os.path.join(out_dir, "report.png")):
        os.unlink(os.path.join(out_dir, "report.png"))  # an older run's chart would not match this report
        log("eval: no matplotlib on this host (pip install matplotlib): report.txt instead of report.png")


def check_the_draft(args) -> None:
    """--draft (default: this run's export) made absolute and checked against --model as vLLM will load it."""
    args.draft = os.path.abspath(args.draft or os.path.join(args.output_dir, "draft", "export"))
    _, tc = check_draft(args.draft, args.model)
    own = args.draft == os.path.abspath(os.path.join(args.output_dir, "draft", "export"))   # this run's vocab/ maps
    parity.check_export(args.draft, tc, None, os.path.join(args.output_dir, "vocab") if own else None,
                        min(args.max_model_len or parity.serving_context(tc), parity.serving_context(tc)),
                        exc=BadInput)


def read_prompts(args):
    """(whether --prompts names a dataset, its file, its provenance, the conversations to measure)."""
    from kimi_eagle_host.data.data_sources import is_source_name, resolve
    from kimi_eagle_host.data.prompts import read_conversations, spread_over_categories

    named = is_source_name(args.prompts)
    path, prov = resolve(args.prompts, "--prompts")
    convs = spread_over_categories(read_conversations(path, 0, label=args.prompts), args.num_prompts)
    if args.max_turns:
        for c in convs:
            c.user_turns = c.user_turns[:args.max_turns]
    return named, path, prov, convs


def pick_engine(args):
    """(vllm or hf, why vLLM was not taken or None, the engine environment set before vLLM is imported)."""
    engine, why, engine_env = args.engine, None, {}
    if engine in ("auto", "vllm"):
        engine_env = engine_env_defaults()  # before vLLM is imported: it reads them at import and engine start
        ok, info = vllm_support(target_text_config(args.model)[0])
        if ok:
            engine = "vllm"
        else:
            why, engine, engine_env = info, "hf", {}
            log(f"eval: {info}; using the transformers evaluator instead")
    return engine, why, engine_env


def save_baseline(bfile: str, settings: dict, m: dict) -> None:
    """The target's answers and tokens/s without the draft, for a later --reuse-baseline with the same settings."""
    os.makedirs(os.path.dirname(bfile), exist_ok=True)
    atomic_write(bfile, json.dumps({"settings": settings, "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                    **m["baseline"]}, ensure_ascii=False))


def publish(args, rep: dict, out_dir: str, k: int) -> None:
    """The report written (report.json and its chart), given to the tracker, and its headline said."""
    rep["job_id"] = os.environ.get("KIMI_EAGLE_JOB_ID")  # which job wrote it: `pull JOB` takes it only for that job
    write_report(rep, out_dir)
    rep["report"] = os.path.join(out_dir, "report.json")
    tps = rep["tokens_per_s"] or {}
    with open_tracker(args.report_to, tracking_dir(args.output_dir, args.tracking_dir), config=vars(args)) as tracker:
        tracker.log(k, {"eval/mean_acceptance_length": rep["mean_acceptance_length"],
                        **({"eval/speedup": rep["speedup"]} if rep["speedup"] is not None else {}),
                        **{f"eval/tokens_per_s_{key}": v for key, v in tps.items()},
                        **{f"eval/acceptance_pos_{i}": a for i, a in enumerate(rep["acceptance_per_position"])}})
    log(HEADLINE_PREFIX + rep["headline"])
    job_headline(HEADLINE_PREFIX + rep["headline"])


def run(args):
    from kimi_eagle_host.data.prompts import TokenBudget, check_lengths

    batch_sizes = parse_batch_sizes(args.batch_sizes)
    out_dir = os.path.abspath(args.out or os.path.join(args.output_dir, "eval"))
    check_the_draft(args)
    args.vllm_dtype = compute_dtype.for_vllm(args.vllm_dtype, log)   # what a vLLM engine here will be started with
    if not args.prompts:
        if not args.smoke:
            raise BadInput("--prompts: required (or --smoke alone: the served smoke test on bundled prompts)")
        return served_smoke(args, out_dir)
    wanted(args.report_to)  # a tracker asked for by name and missing: said before any model load
    named, path, prov, convs = read_prompts(args)
    tok = load_tokenizer(args.model)   # the chat template renders every turn: refused in one line without one
    budget = TokenBudget(tok, None, args.max_tokens)
    # the context the engine is asked for: given (and within the model's positions) or derived from the prompts
    args.max_model_len = budget.limit = context_length.resolve(args.max_model_len, args.model, convs, budget,
                                                               args.max_turns)
    convs, dropped = check_lengths(convs, budget, args.prompts, "skip" if named else "fail")
    seen = seen_in_training(args, convs, tok)
    trained_on = seen_warning(seen)
    if trained_on:  # said now, before the engines load, and again beside the figure
        log(f"eval: warning: {trained_on}")
    k = args.num_speculative_tokens
    engine, why, engine_env = pick_engine(args)
    if engine == "hf" and 1 not in batch_sizes:
        batch_sizes = [1, *batch_sizes]  # the one batch size it can time
    timing_n = args.timing_prompts or 2 * max(batch_sizes)
    log(f"eval: {len(convs)} prompts ({sum(len(c.user_turns) for c in convs)} turns) from {args.prompts}, k={k}, "
        f"max {args.max_tokens} tokens, engine {engine}, batch sizes {batch_sizes} on {timing_n} prompts")
    meta, open_runner = open_engine(args, engine, tok, engine_env)
    settings = baseline_settings(args, prov, meta["engine_name"], batch_sizes, timing_n, tok)
    bfile = baseline_file(args, settings)
    recorded = recorded_baseline(bfile, settings, len(convs)) if args.reuse_baseline else None
    if recorded:
        log(f"eval: the target's answers and tokens/s without the draft come from {bfile} (recorded "
            f"{recorded['recorded_at']} with the same target, prompts and settings): no engine started for them")
    m = measure(open_runner, convs, budget, k, batch_sizes, timing_n, args.max_batch, recorded)
    if not recorded:
        save_baseline(bfile, settings, m)
    meta["baseline"] = {"file": bfile, "reused": bool(recorded), "recorded_at": (recorded or {}).get("recorded_at")}
    if why:
        meta["fallback_reason"] = why
    meta.update({"benchmark": benchmark_name(args.prompts, named, prov), "dataset": prov,
                 "model": os.path.abspath(args.model), "draft": args.draft, "draft_training": draft_training(args.draft),
                 "seen_in_training": seen,
                 "prompts_file": path,
                 "max_tokens": args.max_tokens, "dropped_long_prompts": dropped})
    warnings = drafting_problems(m, meta["engine_name"]) + ([trained_on] if trained_on else [])
    rep = summarize(m, k, convs, meta, batch_sizes)
    smoke, smoke_failed = full_eval_smoke(m, meta, why) if args.smoke else ({}, None)
    rep.update(smoke)
    if warnings:
        rep["warnings"] = warnings
        rep["headline"] += "; WARNING: " + "; ".join(warnings)
        for w in warnings:
            log(f"eval: warning: {w}")
    publish(args, rep, out_dir, k)
    if smoke_failed:
        raise smoke_failed
    return rep


def seen_in_training(args, convs, tok) -> dict:
    """How many of the measured conversations open exactly like a document of the prepared data the draft was
    trained on (its first turn, as prepare rendered it: prepared_data.prompt_keys): acceptance on those is no
    held-out figure (a prompts file that is the training dataset, or shares its conversations). Read from the
    prompts train recorded beside the export (exports.record_prompt_keys: a small file), else, for a draft exported
    without them, from this run's prepared data where the draft's training_info.json names it (every document's
    loss mask read); else said as not checked."""
    from kimi_eagle_host.data.prepared_data import manifest_digest, prompt_key, prompt_keys, read_prompt_keys

    prepared = os.path.join(args.output_dir, "prepared")
    try:
        with open(os.path.join(args.draft, "training_info.json")) as f:
            info = json.load(f)
        recorded, trained_on = info.get("prompt_keys"), (info.get("data_config") or {}).get("prepared_sha256")
    except (OSError, ValueError, AttributeError):
        recorded = trained_on = None
    keys = read_prompt_keys(args.draft) if isinstance(recorded, dict) else None
    if keys is not None:
        prepared = recorded.get("prepared") or prepared
    elif not trained_on or manifest_digest(prepared) != trained_on:
        return {"checked": False, "why": "the draft's training data is not this run's prepared data (or unknown)"}
    else:
        keys = set(prompt_keys(prepared))
    seen = sum(prompt_key(chat_prompt_ids(tok, c.messages([]))) in keys for c in convs)
    return {"checked": True, "prepared": prepared, "prompts": len(convs), "seen": seen}


def seen_warning(seen: dict):
    """The warning for prompts the draft's training data holds (seen_in_training), None for none."""
    if not seen.get("seen"):
        return None
    return (f"{seen['seen']} of {seen['prompts']} prompts open like conversations of the draft's training data "
            f"({seen['prepared']}, held-out ones included): acceptance on them is no held-out figure")


def draft_training(draft_dir: str) -> dict:
    """What the measured draft was trained on and which checkpoint it is, for the record: train's
    training_info.json (documents = conversations, held-out ones, steps) and, when the choose step installed it,
    the step it chose and why. Empty fields for a draft made elsewhere (no training_info.json)."""
    def optional(name):
        try:
            with open(os.path.join(draft_dir, name)) as f:
                return json.load(f)
        except (OSError, ValueError):
            return {}

    meta, selection = optional("training_info.json").get("meta") or {}, optional("selection.json")
    samples, held = meta.get("n_samples"), meta.get("holdout")
    return {"conversations": samples - held if samples is not None and held is not None else None,
            "held_out_conversations": held, "steps": meta.get("total_steps"),
            "chosen_step": selection.get("chosen_step"), "chosen_why": selection.get("why"),
            "candidates_served": len(selection.get("checkpoints") or []) or None}


def benchmark_name(value, named, prov):
    """The benchmark's name for the card: a dataset name, also when it was converted elsewhere and uploaded."""
    if named:
        return value
    made = prov.get("converted_from") or {}
    return made.get("source") or f"file {os.path.basename(value)}"


def device_name():
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    except Exception:  # noqa: BLE001
        return "cpu"


def main(argv=None):
    return run_step("eval", run, parse_step_args("eval", argv, __doc__))


if __name__ == "__main__":
    sys.exit(main())
