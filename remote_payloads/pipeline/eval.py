#!/usr/bin/env python3
"""Pipeline step `eval`: how much an EAGLE-3 draft speeds up its target, measured on held-out prompts.

Engines:
  vllm  the host's vLLM serves target + draft (speculative_config method eagle3, k draft tokens, greedy);
        acceptance comes from vLLM's own counters (llm.get_metrics()), and the same prompts are decoded once
        without the draft for tokens/s and the identical-output check.
  hf    transformers: the draft proposes k tokens, the target verifies them in one forward pass, greedy
        (pipeline/spec_hf.py) - the same definition, for hosts without a vLLM that serves the target's EAGLE-3.
  auto  vllm when it can serve EAGLE-3 for this target, else hf (saying why).

Reported (out/eval/report.json, report.txt and, with matplotlib, report.png; atomically):
  mean acceptance length = 1 + accepted / drafts, acceptance rate per draft position, output tokens/s
  with and without the draft, and the fraction of prompts whose greedy completion is identical with and
  without the draft (reported, not asserted: batch shapes change bf16 numerics).
The draft's config is checked against the target before any model is loaded (hidden size, vocab size,
aux layer ids); a mismatch is bad input (exit 2) naming the field.
"""
import os
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the payload root: step_runtime

import argparse  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from step_runtime import BadInput, atomic_write, atomic_write_json, job_headline, log, run_step, stdout_for_result_only  # noqa: E402
from tracker import open_tracker, tracking_dir, wanted  # noqa: E402

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
    tc = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else cfg
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
    return dc, tc


# ----------------------------------------------------------------------------------------------------
# engine choice

def vllm_support(target_cfg):
    """(True, version) when the host's vLLM can serve EAGLE-3 for this target, else (False, why)."""
    stdout_for_result_only()  # importing vLLM already logs (to stdout)
    try:
        import vllm
    except Exception as e:  # noqa: BLE001 - any import failure means: not usable here
        return False, f"vLLM is not importable on this host ({type(e).__name__}: {e})"
    version = getattr(vllm, "__version__", "0")
    try:
        from vllm.model_executor.models import ModelRegistry
        from vllm.model_executor.models.interfaces import supports_eagle3
    except Exception as e:  # noqa: BLE001
        return False, f"vLLM {version} has no EAGLE-3 interface ({type(e).__name__}: {e})"
    archs = target_cfg.get("architectures") or []
    for arch in archs:
        try:
            cls, _ = ModelRegistry.resolve_model_cls([arch], model_config=None)
        except Exception:  # noqa: BLE001 - signature differs across versions: fall back to the plain lookup
            try:
                cls = ModelRegistry._try_load_model_cls(arch)
            except Exception:  # noqa: BLE001
                cls = None
        if cls is not None and supports_eagle3(cls):
            return True, version
    return False, f"vLLM {version} cannot serve EAGLE-3 drafts for {archs or 'this target'}"


# ----------------------------------------------------------------------------------------------------
# engines

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


def run_hf(args, prompts, k):
    import torch

    from spec_hf import HFEngine

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
    eos = eos_ids_of(args.model, tok)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype if args.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    if args.threads:
        torch.set_num_threads(args.threads)
    eng = HFEngine(args.model, args.draft, device, dtype)
    ids = [chat_prompt_ids(tok, m) for _, m in prompts]
    runs = {}
    for name, kk in (("baseline", 0), ("speculative", k)):
        t0 = time.perf_counter()
        outs, tot = [], {"drafts": 0, "accepted": 0, "per_pos": [0] * k}
        for i, p in enumerate(ids):
            o, st = eng.generate(p, args.max_tokens, eos, kk)
            outs.append(o)
            for key in ("drafts", "accepted"):
                tot[key] += st[key]
            tot["per_pos"] = [a + b for a, b in zip(tot["per_pos"], st["per_pos"] or [0] * k)]
            if (i + 1) % 10 == 0:
                log(f"eval[hf] {name}: {i + 1}/{len(ids)} prompts")
        dt = time.perf_counter() - t0
        runs[name] = {"outputs": outs, "seconds": dt, "counters": tot}
    return runs, {"engine": "hf", "device": device, "dtype": dtype}


def vllm_counters(llm):
    """Spec-decode counters from llm.get_metrics() (vLLM V1)."""
    got = {"drafts": 0, "draft_tokens": 0, "accepted": 0, "per_pos": []}
    names = {"vllm:spec_decode_num_drafts": "drafts", "vllm:spec_decode_num_draft_tokens": "draft_tokens",
             "vllm:spec_decode_num_accepted_tokens": "accepted"}
    for m in llm.get_metrics():
        if m.name in names:
            got[names[m.name]] += int(m.value)
        elif m.name == "vllm:spec_decode_num_accepted_tokens_per_pos":
            vals = [int(v) for v in m.values]
            got["per_pos"] = [a + b for a, b in zip(got["per_pos"] + [0] * len(vals), vals)] \
                if got["per_pos"] else vals
    return got


def run_vllm(args, prompts, k):
    stdout_for_result_only()  # vLLM logs to stdout, also from its workers
    import gc

    from vllm_compat import engine_env_defaults, text_only_engine_kwargs

    engine_env = engine_env_defaults()  # before the engine starts: vLLM 0.25 dies at start-up without flashinfer
    from vllm import LLM, EngineArgs, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    messages = [m for _, m in prompts]
    common = dict(model=args.model, dtype=args.vllm_dtype, max_model_len=args.max_model_len, seed=0,
                  enforce_eager=args.enforce_eager, disable_log_stats=False, trust_remote_code=True,
                  tensor_parallel_size=args.tp_size, **text_only_engine_kwargs(args.model, EngineArgs))
    runs = {}
    for name, spec in (("baseline", None), ("speculative", {"method": "eagle3", "model": os.path.abspath(args.draft),
                                                            "num_speculative_tokens": k})):
        llm = LLM(speculative_config=spec, **common) if spec else LLM(**common)
        llm.chat(messages[:1], sp, use_tqdm=False)  # warm-up: the first batch pays one-time costs
        before = vllm_counters(llm)
        t0 = time.perf_counter()
        res = llm.chat(messages, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        after = vllm_counters(llm)
        cnt = {key: after[key] - before[key] for key in ("drafts", "accepted")}
        cnt["per_pos"] = [a - b for a, b in zip(after["per_pos"], before["per_pos"] + [0] * len(after["per_pos"]))]
        cnt["per_pos"] = (cnt["per_pos"] + [0] * k)[:k] if spec else [0] * k
        runs[name] = {"outputs": [list(r.outputs[0].token_ids) for r in res], "seconds": dt, "counters": cnt}
        del llm
        gc.collect()
    import vllm

    return runs, {"engine": "vllm", "vllm_version": vllm.__version__, "dtype": args.vllm_dtype, "engine_env": engine_env}


# ----------------------------------------------------------------------------------------------------

def summarize(runs, k, prompts, meta):
    base, spec = runs["baseline"], runs["speculative"]
    c = spec["counters"]
    drafts = max(c["drafts"], 1)
    toks = {n: sum(len(o) for o in r["outputs"]) for n, r in runs.items()}
    tps = {n: toks[n] / max(r["seconds"], 1e-9) for n, r in runs.items()}
    same = sum(a == b for a, b in zip(base["outputs"], spec["outputs"]))
    rep = {
        "ok": True, "step": "eval", **meta, "num_speculative_tokens": k, "prompts": len(prompts),
        "mean_acceptance_length": round(1 + c["accepted"] / drafts, 4),
        "acceptance_per_position": [round(a / drafts, 4) for a in c["per_pos"]],
        "drafts": c["drafts"], "accepted_tokens": c["accepted"],
        "output_tokens": toks, "seconds": {n: round(r["seconds"], 3) for n, r in runs.items()},
        "tokens_per_s": {"without_draft": round(tps["baseline"], 2), "with_draft": round(tps["speculative"], 2)},
        "speedup": round(tps["speculative"] / max(tps["baseline"], 1e-9), 3),
        "identical_completions": round(same / max(len(prompts), 1), 4),
    }
    rep["headline"] = (f"acceptance length {rep['mean_acceptance_length']:.2f} at k={k} "
                       f"(per position {', '.join(f'{a:.0%}' for a in rep['acceptance_per_position'])}); "
                       f"{rep['tokens_per_s']['with_draft']:.1f} tok/s with draft vs "
                       f"{rep['tokens_per_s']['without_draft']:.1f} without ({rep['speedup']:.2f}x); "
                       f"identical completions {rep['identical_completions']:.0%} [{meta['engine']}, "
                       f"{len(prompts)} prompts]")
    return rep


def run(args):
    from prompts import read_prompts

    if args.num_speculative_tokens < 1:
        raise BadInput("--num-speculative-tokens: must be >= 1")
    out_dir = os.path.abspath(args.out or os.path.join(args.output_dir, "eval"))
    args.draft = os.path.abspath(args.draft or os.path.join(args.output_dir, "draft", "export"))
    dc, tc = check_draft(args.draft, args.model)
    wanted(args.report_to)  # a tracker asked for by name and missing: said before any model load
    prompts = read_prompts(args.prompts, args.num_prompts)
    k = args.num_speculative_tokens
    engine, why = args.engine, None
    if engine in ("auto", "vllm"):
        ok, info = vllm_support(target_text_config(args.model)[0])
        if ok:
            engine = "vllm"
        else:
            why = info
            log(f"eval: {info}; using the transformers evaluator instead")
            engine = "hf"
    log(f"eval: {len(prompts)} prompts, k={k}, max {args.max_tokens} tokens, engine {engine}")
    runs, meta = (run_vllm if engine == "vllm" else run_hf)(args, prompts, k)
    if why:
        meta["fallback_reason"] = why
    meta.update({"model": os.path.abspath(args.model), "draft": args.draft, "prompts_file": args.prompts,
                 "max_tokens": args.max_tokens})
    rep = summarize(runs, k, prompts, meta)
    os.makedirs(out_dir, exist_ok=True)
    atomic_write_json(os.path.join(out_dir, "report.json"), rep)
    from report_plot import render_report

    files = render_report(rep)
    for name, data in files.items():
        atomic_write(os.path.join(out_dir, name), data)
    if "report.png" not in files and os.path.exists(os.path.join(out_dir, "report.png")):
        os.unlink(os.path.join(out_dir, "report.png"))  # an older run's chart would not match this report
        log("eval: no matplotlib on this host (pip install matplotlib): report.txt instead of report.png")
    rep["report"] = os.path.join(out_dir, "report.json")
    with open_tracker(args.report_to, tracking_dir(args.output_dir, args.tracking_dir), config=vars(args)) as tracker:
        tracker.log(k, {"eval/mean_acceptance_length": rep["mean_acceptance_length"], "eval/speedup": rep["speedup"],
                        "eval/tokens_per_s_with_draft": rep["tokens_per_s"]["with_draft"],
                        "eval/tokens_per_s_without_draft": rep["tokens_per_s"]["without_draft"],
                        **{f"eval/acceptance_pos_{i}": a for i, a in enumerate(rep["acceptance_per_position"])}})
    log(HEADLINE_PREFIX + rep["headline"])
    job_headline(HEADLINE_PREFIX + rep["headline"])
    return rep


def build_parser():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target model folder")
    ap.add_argument("--output-dir", default=".", help="pipeline root: reads draft/export, writes eval/")
    ap.add_argument("--draft", default=None, help="draft export folder (default <output-dir>/draft/export)")
    ap.add_argument("--out", default=None, help="write here instead of <output-dir>/eval")
    ap.add_argument("--prompts", required=True, help="held-out prompts, chat JSONL")
    ap.add_argument("--num-prompts", type=int, default=0, help="use the first N prompts (0 = all)")
    ap.add_argument("--max-tokens", type=int, default=128, help="new tokens per prompt (default 128)")
    ap.add_argument("--num-speculative-tokens", "-k", type=int, default=3, help="draft tokens per step (default 3)")
    ap.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="hf engine")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                    help="hf engine (auto: bf16 on CUDA, fp32 on CPU)")
    ap.add_argument("--threads", type=int, default=0, help="hf engine: torch threads (0 = torch's default)")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vllm engine dtype (default bfloat16)")
    ap.add_argument("--max-model-len", type=int, default=2048, help="vllm engine")
    ap.add_argument("--tp-size", type=int, default=1, help="vllm engine: tensor parallel size")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True,
                    help="vllm engine: skip graph capture (default on: faster start for short evals)")
    ap.add_argument("--report-to", default="auto", help="figures to tensorboard, wandb, trackio, mlflow (comma list), "
                    "none, or auto: tensorboard when installed (default)")
    ap.add_argument("--tracking-dir", default=None, help="tensorboard's folder (default <output-dir>/tracking)")
    return ap


def main(argv=None):
    return run_step("eval", run, build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
