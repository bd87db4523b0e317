#!/usr/bin/env python3
"""Pipeline step `choose`: the best checkpoint, chosen by serving it, becomes the export.

The training loss does not pick the checkpoint: served acceptance can peak after a few epochs and fall (DeepSpec
#84), and good validation numbers have gone with a served acceptance of 1.05 (speculators #613). So each checkpoint
train exported for this (choose_checkpoints = N, draft/candidates.py) is served by vLLM next to the target, greedy,
on a held-out slice of the *training* distribution: the first user turn (the prompt up to the first answer token)
of documents train never trained on, as prepared (never the eval benchmark).

Per checkpoint, served at k = --max-k by one engine: the one started for the first checkpoint, the later ones
swapped into it in place (evaluation/draft_swap.py: for a 1T target, one half-hour load instead of one per
checkpoint; a new engine where the host's vLLM cannot swap):
  acceptance per position (vLLM's counters), hence acceptance length at every k = 1..max-k (served.acceptance_by_k)
  tokens/s at batch 1 and at --batch-size, measured at max-k; at the smaller k modelled from that and the target
  alone (served.tokens_per_s_by_k: a step's time linear in k, through both measurements)
The target alone is served once, for its tokens/s. The chosen checkpoint has the highest acceptance length at
max-k (a tie: the later step); draft/export/ is replaced by it (whole, by renames) and the report names, per batch
size, the k with the highest tokens/s.

Outputs: <output-dir>/choose/report.json (every served checkpoint's figures, the choice and why) and the same record
as draft/export/selection.json. A host whose vLLM cannot serve the draft, an engine that fails, drafts never counted
or a best checkpoint that had no token accepted: exit 1 (the run does not end as succeeded), the export untouched.
"""
import json
import os
import shutil
import statistics
import sys
import time

from kimi_eagle_host import compute_dtype
from kimi_eagle_host.data.prepared_data import PROMPT_KEYS_FILE  # (train's record of its prompts, kept)
from kimi_eagle_host.engine import context_length
from kimi_eagle_host.evaluation.served import ServedEngine, acceptance_by_k, tokens_per_s_by_k, vllm_support
from kimi_eagle_host.step_runtime import (BadInput, Refused, atomic_write_json, job_headline, log, parse_step_args,
                                          progress_line, run_step, stdout_for_result_only)

HEADLINE_PREFIX = "choose: "
# The flags that say how much one vLLM engine of this step holds at once (engine_load; preflight reads them too).
ENGINE_FLAGS = ("max_model_len", "batch_size")


def engine_load(args):
    """(tokens per sequence, sequences at once) of this step's engines: --batch-size prompts per call."""
    return int(args.max_model_len or context_length.PREFLIGHT_CONTEXT), int(args.batch_size)


def serving_order(documents: list[int], n: int) -> list[int]:
    """The held-out documents in the order choose serves them: n spread evenly over the list first, then the others
    (a document without a prompt is passed over). The list is sorted by index and a dataset holds its sources in
    blocks: the first 32 of the H200's 1,000 held-out documents were all ShareGPT first turns, none of the 695
    prompts the target wrote itself."""
    picked = sorted({i * len(documents) // n for i in range(min(n, len(documents)))})
    chosen = set(picked)
    return [documents[i] for i in picked] + [d for i, d in enumerate(documents) if i not in chosen]


def heldout_prompts(out: str, record: dict, n: int) -> list[list[int]]:
    """The token ids of up to n held-out documents' prompts (serving_order): each document up to its first answer
    token (loss mask 1), the chat template's opening of the answer included, as the target was asked in training."""
    from kimi_eagle_host.data.prepared_data import PreparedDataset

    prepared = os.path.join(out, "prepared")
    ds = PreparedDataset(prepared)
    if record.get("prepared_sha256") and ds.digest != record["prepared_sha256"]:
        raise BadInput(f"{prepared}/manifest.json: not the prepared data the candidates were trained on (prepare ran "
                       f"again since train): train again")
    prompts = []
    for d in serving_order(record["heldout_documents"], n):
        ids, mask = ds[d]
        first = int(mask.argmax()) if mask.any() else 0
        if first > 0:
            prompts.append([int(t) for t in ids[:first]])
        if len(prompts) == n:
            break
    if not prompts:
        raise BadInput(f"{folder_record(out)}: no held-out documents with a prompt to serve "
                       f"({len(record['heldout_documents'])} held out): set steps.train.holdout_fraction above 0 "
                       f"and train again")
    return prompts


def folder_record(out: str) -> str:
    from kimi_eagle_host.draft import candidates

    return os.path.join(candidates.folder(out), candidates.RECORD)


class Engine(ServedEngine):
    """The target alone (k = 0) or with a candidate at k; called on lists of prompt token ids."""

    def __call__(self, prompts):
        """(output tokens, spec-decode counters of this call)."""
        res, c = self.counted(lambda llm, sp: llm.generate([{"prompt_token_ids": p} for p in prompts], sp,
                                                           use_tqdm=False))
        return sum(len(r.outputs[0].token_ids) for r in res), c

    def timed(self, prompts, batch_size) -> float:
        """Output tokens/s decoding `prompts` in batches of `batch_size`."""
        tokens, t0 = 0, time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            tokens += self(prompts[i:i + batch_size])[0]
        return round(tokens / max(time.perf_counter() - t0, 1e-9), 2)


def timing_prompts(batch_size: int) -> int:
    """Prompts decoded to time a batch size: two batches, and at least 8 (batch 1 decodes them one after the other:
    on an H200 with an eager engine, 32 of them took a minute per checkpoint, the larger part of choose's time)."""
    return max(8, 2 * batch_size)


# Each batch size is timed this many times and the median kept. One timing is a second or two of decoding: on an H200
# (thirtieth session) one pass at batch 16 read 3,622 tokens/s for a checkpoint accepting more than the one before it
# at 5,027, and one checkpoint served by two engines read 4,342 and 3,470; a best k picked from one pass follows that.
TIMING_REPEATS = 3


def serve(eng, k, prompts, timing, batch_sizes) -> dict:
    """An engine's figures: counters over every prompt (in batches of the larger batch size), tokens/s per batch (the
    median of TIMING_REPEATS passes, each pass kept in `timed_runs`)."""
    eng(prompts[:1])   # warm-up: the first call pays one-time costs
    counters, tokens = {"drafts": 0, "accepted": 0, "per_pos": [0] * k}, 0
    for i in range(0, len(prompts), batch_sizes[-1]):
        n, c = eng(prompts[i:i + batch_sizes[-1]])
        tokens += n
        counters = {"drafts": counters["drafts"] + c["drafts"], "accepted": counters["accepted"] + c["accepted"],
                    "per_pos": [a + b for a, b in zip(counters["per_pos"], c["per_pos"])]}
    runs = {b: [eng.timed(timing[:timing_prompts(b)], b) for _ in range(TIMING_REPEATS)] for b in batch_sizes}
    return {**counters, "output_tokens": tokens, "tokens_per_s": {b: statistics.median(r) for b, r in runs.items()},
            "timed_runs": runs}


class CandidateEngines:
    """The engine serving the candidates: the one started for the first, each later checkpoint swapped into it in
    place (draft_swap: one target load for all of them); a new engine where that cannot be done, said in the log,
    or for each with --no-swap-drafts."""

    def __init__(self, args, k, memory):
        self.args, self.k, self.memory, self.eng, self.started = args, k, memory, None, 0

    def serving(self, draft: str, step: int) -> tuple[Engine, str]:
        if self.eng is not None and not self.args.swap_drafts:
            self.close()
        if self.eng is not None:
            try:
                self.eng.swap(draft)
                return self.eng, "swapped into the running engine"
            except Exception as e:  # noqa: BLE001 - any failure: a fresh engine serves it as before
                log(f"choose: step {step}'s draft could not be swapped into the running engine ({e}): a new engine")
            self.close()   # outside the handler: its traceback would keep the half-loaded engine's memory
        self.eng = Engine(self.args, draft, self.k, self.memory, swappable=self.args.swap_drafts)
        self.started += 1
        return self.eng, "a new engine"

    def close(self):
        if self.eng is not None:
            self.eng.close()
            self.eng = None


def figures(step, draft, served, baseline, k, batch_sizes, n_prompts) -> dict:
    """A served checkpoint's record: acceptance by position and by k, tokens/s per batch size (measured at k,
    modelled below it), the k with the highest tokens/s per batch size."""
    if served["drafts"] == 0 and served["output_tokens"] > n_prompts:
        raise Refused(f"checkpoint of step {step}: {served['output_tokens']} tokens decoded with the draft attached but "
                      f"no drafts counted: speculative decoding did not run, so there is no acceptance to compare")
    by_k = acceptance_by_k(served["per_pos"], served["drafts"])
    speed = {}
    for b in batch_sizes:
        modelled = tokens_per_s_by_k(baseline[b], served["tokens_per_s"][b], by_k)
        best = max(range(k), key=lambda i: (modelled[i] or 0, -i))
        speed[str(b)] = {"without_draft": baseline[b], f"with_draft_k{k}": served["tokens_per_s"][b],
                         f"with_draft_k{k}_runs": served["timed_runs"][b],
                         "speedup": round(served["tokens_per_s"][b] / max(baseline[b], 1e-9), 3),
                         "by_k": {str(i + 1): v for i, v in enumerate(modelled)}, "best_k": best + 1,
                         "best_k_beats_the_target": bool(modelled[best] and modelled[best] > baseline[b])}
    drafts = max(served["drafts"], 1)
    return {"step": step, "draft": draft, "output_tokens": served["output_tokens"], "drafts": served["drafts"],
            "accepted_tokens": served["accepted"],
            "accepted_per_position": served["per_pos"],
            "acceptance_per_position": [round(a / drafts, 4) for a in served["per_pos"]],
            "acceptance_length_by_k": {str(i + 1): a for i, a in enumerate(by_k)},
            "acceptance_length": by_k[-1], "tokens_per_s": speed}


def choose(records: list[dict], k: int) -> tuple[dict, str]:
    """(the best record, why): the highest acceptance length at k; a tie goes to the later step."""
    best = max(records, key=lambda r: (r["acceptance_length"], r["step"]))
    if not best["accepted_tokens"]:
        raise Refused(f"none of the {len(records)} served checkpoints had a draft token accepted on the held-out "
                      f"prompts: no export can be chosen (the draft predicts nothing of this target)")
    others = ", ".join(f"step {r['step']}: {r['acceptance_length']:.2f}" for r in records if r is not best)
    why = (f"highest acceptance length at k={k} on the held-out prompts: {best['acceptance_length']:.2f} at step "
           f"{best['step']}" + (f" (others: {others})" if others else " (the only one served)"))
    return best, why


def install(chosen_dir: str, export_dir: str, selection: dict) -> None:
    """draft/export becomes a copy of the chosen candidate, swapped in by renames: a reader sees the old export or
    the new one, never a mix (for a moment, none)."""
    tmp, old = export_dir + ".choose-tmp", export_dir + ".choose-old"
    for d in (tmp, old):
        shutil.rmtree(d, ignore_errors=True)
    shutil.copytree(chosen_dir, tmp)
    info_path = os.path.join(export_dir, "training_info.json")
    info = {}
    if os.path.isfile(info_path):   # train's record of the last step's export: kept, with what replaced it
        with open(info_path) as f:
            info = json.load(f)
    info.update({"chosen_step": selection["chosen_step"],
                 "job_id": os.environ.get("KIMI_EAGLE_JOB_ID") or info.get("job_id")})   # `pull JOB` reads it
    atomic_write_json(os.path.join(tmp, "training_info.json"), info)
    keys = os.path.join(export_dir, PROMPT_KEYS_FILE)   # the run's training prompts, which info names: kept too
    if os.path.isfile(keys):
        shutil.copyfile(keys, os.path.join(tmp, PROMPT_KEYS_FILE))
    atomic_write_json(os.path.join(tmp, "selection.json"), selection)
    if os.path.isdir(export_dir):
        os.rename(export_dir, old)
    os.rename(tmp, export_dir)
    shutil.rmtree(old, ignore_errors=True)


def serve_candidates(args, cands, k, memory, prompts, timing, batch_sizes, baseline) -> tuple[list[dict], int]:
    """Every candidate served (CandidateEngines): their figures, and how many engines they took."""
    records = []
    progress_line("choose", 0, len(cands))   # `kimi-eagle logs` draws its bar from these
    engines = CandidateEngines(args, k, memory)
    try:
        for c in cands:
            eng, served_by = engines.serving(c["dir"], c["step"])
            served = serve(eng, k, prompts, timing, batch_sizes)
            records.append({**figures(c["step"], c["dir"], served, baseline, k, batch_sizes, len(prompts)),
                            "served_by": served_by})
            r = records[-1]
            log(f"choose: step {c['step']} ({served_by}): acceptance length {r['acceptance_length_by_k']} by k, per "
                f"position {r['acceptance_per_position']}, tokens/s {served['tokens_per_s']} by batch size at k={k}")
            progress_line("choose", len(records), len(cands), every_s=0, accept_len=r["acceptance_length"])
    finally:
        engines.close()
    return records, engines.started


def run(args):
    from kimi_eagle_host.draft import candidates, parity

    out = os.path.abspath(args.output_dir)
    record = candidates.read(out)
    args.vllm_dtype = compute_dtype.for_vllm(args.vllm_dtype, log)
    prompts = heldout_prompts(out, record, args.prompts)
    tc = parity.target_text_config(args.model)
    if args.max_model_len is None:   # the longest prompt and its answer (the draft must reach as far), as eval derives it
        args.max_model_len = context_length.derived(max(len(p) for p in prompts) + args.max_tokens, args.model)
    fits = [p for p in prompts if len(p) + args.max_tokens <= args.max_model_len]
    if not fits:
        raise BadInput(f"--max-model-len {args.max_model_len}: none of the {len(prompts)} held-out prompts fits with "
                       f"--max-tokens {args.max_tokens} (the shortest has {min(map(len, prompts))} tokens)")
    if len(fits) < len(prompts):
        log(f"choose: {len(prompts) - len(fits)} held-out prompts longer than --max-model-len {args.max_model_len} "
            f"less --max-tokens {args.max_tokens} left out")
    prompts = fits
    for c in record["candidates"]:   # as vLLM will read them, before any engine starts
        parity.check_export(c["dir"], tc, None, os.path.join(out, "vocab"),
                            parity.serving_context(tc, args.max_model_len), exc=BadInput)
    from kimi_eagle_host.vllm_compat import engine_env_defaults, size_engine

    engine_env = engine_env_defaults()   # before vLLM is imported: it reads them at import and engine start
    with open(os.path.join(args.model, "config.json")) as f:
        ok, info = vllm_support(json.load(f))
    if not ok:
        raise Refused(f"{info}: no checkpoint can be served here, so none can be chosen (choose_checkpoints=0 "
                      f"exports the last checkpoint without serving)")
    stdout_for_result_only()   # vLLM logs to stdout, also from its workers
    k, batch_sizes = args.max_k, sorted({1, args.batch_size})
    timing = prompts[:timing_prompts(batch_sizes[-1])]
    memory = size_engine("choose", args.model, args.tp_size, *engine_load(args))
    log(f"choose: {len(record['candidates'])} checkpoints (steps {[c['step'] for c in record['candidates']]}), "
        f"{len(prompts)} held-out prompts, k={k}, max {args.max_tokens} tokens, tokens/s at batch sizes {batch_sizes} "
        f"on {'/'.join(str(len(timing[:timing_prompts(b)])) for b in batch_sizes)} prompts, vLLM {info}")
    # The target alone serves the same prompts as every candidate before it is timed: the timed prompts are then in
    # vLLM's prefix cache on both sides, and both engines are equally warm (timed after one prompt, the H200's
    # baseline read 325 tokens/s at batch 1 where eval, after a full pass, read 444).
    alone_engine = Engine(args, None, 0, memory)
    try:
        alone = serve(alone_engine, 0, prompts, timing, batch_sizes)
    finally:
        alone_engine.close()
    baseline = alone["tokens_per_s"]
    log(f"choose: the target alone: {alone['output_tokens']} tokens on the {len(prompts)} prompts, {baseline} tokens/s "
        f"by batch size")
    records, candidate_engines = serve_candidates(args, record["candidates"], k, memory, prompts, timing,
                                                  batch_sizes, baseline)
    best, why = choose(records, k)
    chosen_k = {b: best["tokens_per_s"][b]["best_k"] for b in best["tokens_per_s"]}
    export_dir = os.path.join(out, "draft", "export")
    selection = {"ok": True, "step": "choose", "chosen_step": best["step"], "chosen_from": best["draft"],
                 "why": why, "chosen_k": chosen_k, "max_k": k, "prompts": len(prompts),
                 "prompt_source": "held-out documents of the prepared training data (draft/candidates/candidates.json)",
                 "max_tokens": args.max_tokens, "batch_sizes": batch_sizes,
                 "tokens_per_s_by_k": f"measured without the draft and at k={k} (the median of {TIMING_REPEATS} "
                                      f"passes each); at smaller k modelled (a step's time linear in k through both "
                                      f"measurements)",
                 "engine": f"vLLM {info}", "engine_env": engine_env, "export_dir": export_dir,
                 "engines_started": 1 + candidate_engines,   # the target alone's, then the candidates'
                 "last_step": max(r["step"] for r in records),
                 "without_draft": {"output_tokens": alone["output_tokens"], "tokens_per_s": baseline,
                                   "runs": alone["timed_runs"]},
                 "checkpoints": records,
                 "job_id": os.environ.get("KIMI_EAGLE_JOB_ID")}
    install(best["draft"], export_dir, selection)
    report = os.path.join(args.out or os.path.join(out, "choose"), "report.json")
    os.makedirs(os.path.dirname(report), exist_ok=True)
    atomic_write_json(report, selection)
    best_s = best["tokens_per_s"]
    headline = (f"exported the checkpoint of step {best['step']} of {len(records)} served "
                f"({'the last' if best['step'] == selection['last_step'] else 'not the last'}): acceptance length "
                f"{best['acceptance_length']:.2f} at k={k} on {len(prompts)} held-out prompts; best k "
                + ", ".join(f"{chosen_k[b]} at batch {b} ({best_s[b]['by_k'][str(chosen_k[b])]} tok/s vs "
                            f"{best_s[b]['without_draft']} without)" for b in chosen_k))
    log(HEADLINE_PREFIX + headline)
    job_headline(HEADLINE_PREFIX + headline)
    return {**selection, "report": report, "headline": headline}


def main(argv=None):
    return run_step("choose", run, parse_step_args("choose", argv, __doc__))


if __name__ == "__main__":
    sys.exit(main())
