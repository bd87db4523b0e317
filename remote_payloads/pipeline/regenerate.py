#!/usr/bin/env python3
"""Pipeline step `regenerate`: answer prompts with the target itself (self-distillation data).

EAGLE-3 drafts learn to predict what the target says, so they train best on the target's own answers
(speculators' regenerate-responses, SpecForge's data regeneration). This step reads prompts from a chat
JSONL file (the format `prepare` reads; trailing assistant turns are dropped and re-answered), generates
the target's answers and writes the conversations back in the same format:

  <output-dir>/regenerated/chunks/c_XXXXXXXX.jsonl   one file per chunk of --chunk-size prompts (atomic)
  <output-dir>/regenerated/chat.jsonl                all chunks in prompt order, written once all exist

Resumable: finished chunks are skipped. Sharded: --rank/--world-size take contiguous ranges of chunks
(every rank can run on its own host or GPU); whichever rank finds every chunk present writes chat.jsonl.
Engines: vllm (LLM.chat, when the host's vLLM imports) or hf (transformers generate, batched, left-padded).
Sampling: --temperature 0 is greedy (what a greedy eval measures); > 0 samples with a seed per chunk,
so a resumed run gives the same answers as an uninterrupted one (per engine).

stdout: one JSON summary. stderr: progress. Exit 0 ok, 1 failure, 2 bad input.
"""
import os
import sys

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the payload root: step_runtime

import argparse  # noqa: E402
import glob  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402

from step_runtime import BadInput, atomic_write, log, progress_line, run_step, stdout_for_result_only  # noqa: E402


def chunk_path(out_dir, start):
    return os.path.join(out_dir, "chunks", f"c_{start:08d}.jsonl")


def shard_chunks(n_chunks, rank, world_size):
    """Contiguous range of chunk indices for this rank (like extract's sample ranges)."""
    per, extra = divmod(n_chunks, world_size)
    lo = rank * per + min(rank, extra)
    return range(lo, lo + per + (1 if rank < extra else 0))


class VllmGenerator:
    def __init__(self, args):
        stdout_for_result_only()  # vLLM logs to stdout, also from its workers
        from vllm_compat import engine_env_defaults, text_only_engine_kwargs

        engine_env_defaults()  # before the engine starts: vLLM 0.25 dies at start-up without flashinfer otherwise
        from vllm import LLM, EngineArgs

        self.llm = LLM(model=args.model, dtype=args.vllm_dtype, max_model_len=args.max_model_len,
                       tensor_parallel_size=args.tp_size, trust_remote_code=True, seed=args.seed,
                       enforce_eager=args.enforce_eager, **text_only_engine_kwargs(args.model, EngineArgs))
        self.args = args

    def __call__(self, convs, seed):
        from vllm import SamplingParams

        sp = SamplingParams(temperature=self.args.temperature, max_tokens=self.args.max_tokens, seed=seed)
        return [r.outputs[0].text for r in self.llm.chat(convs, sp, use_tqdm=False)]


class HFGenerator:
    def __init__(self, args):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = {"auto": torch.bfloat16 if dev == "cuda" else torch.float32, "float32": torch.float32,
                 "bfloat16": torch.bfloat16}[args.dtype]
        self.tok = AutoTokenizer.from_pretrained(args.model, trust_remote_code=True)
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, trust_remote_code=True).to(dev).eval()
        self.dev, self.args = dev, args

    def __call__(self, convs, seed):
        torch, a = self.torch, self.args
        texts = [self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
        out = []
        for i in range(0, len(texts), a.batch_size):
            enc = self.tok(texts[i:i + a.batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
            enc = {k: v.to(self.dev) for k, v in enc.items()}
            torch.manual_seed(seed + i)
            kw = {"do_sample": True, "temperature": a.temperature} if a.temperature > 0 else {"do_sample": False}
            with torch.no_grad():
                gen = self.model.generate(**enc, max_new_tokens=a.max_tokens, pad_token_id=self.tok.pad_token_id,
                                          top_p=None, top_k=None, **kw)
            new = gen[:, enc["input_ids"].shape[1]:]
            out += self.tok.batch_decode(new, skip_special_tokens=True)
        return out


def pick_engine(name):
    if name in ("auto", "vllm"):
        stdout_for_result_only()  # importing vLLM already logs (to stdout)
        try:
            import vllm  # noqa: F401
            return "vllm"
        except Exception as e:  # noqa: BLE001
            if name == "vllm":
                raise BadInput(f"--engine vllm: vLLM does not import on this host ({type(e).__name__}: {e})")
    return "hf"


def merge(out_dir, n_chunks, chunk_size):
    """Write chat.jsonl from all chunks when every one exists; returns its path or None."""
    paths = [chunk_path(out_dir, c * chunk_size) for c in range(n_chunks)]
    if not all(os.path.isfile(p) for p in paths):
        return None
    data = b"".join(open(p, "rb").read() for p in paths)
    final = os.path.join(out_dir, "chat.jsonl")
    atomic_write(final, data)
    return final


def run(args):
    from prompts import read_prompts

    if not 0 <= args.rank < args.world_size:
        raise BadInput(f"--rank {args.rank}: must be in 0..{args.world_size - 1} (--world-size {args.world_size})")
    if args.temperature < 0 or args.max_tokens < 1 or args.chunk_size < 1:
        raise BadInput("--temperature must be >= 0, --max-tokens and --chunk-size >= 1")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise BadInput(f"{args.model}/config.json: missing (--model must be a local model folder)")
    out_dir = os.path.abspath(args.out or os.path.join(args.output_dir, "regenerated"))
    prompts = read_prompts(args.dataset, args.max_prompts)
    n_chunks = (len(prompts) + args.chunk_size - 1) // args.chunk_size
    mine = shard_chunks(n_chunks, args.rank, args.world_size)
    os.makedirs(os.path.join(out_dir, "chunks"), exist_ok=True)
    todo = [c for c in mine if not os.path.isfile(chunk_path(out_dir, c * args.chunk_size))]
    log(f"regenerate: {len(prompts)} prompts in {n_chunks} chunks; rank {args.rank}/{args.world_size} owns "
        f"{len(mine)}, {len(mine) - len(todo)} already done")
    engine, gen_tokens, t0 = None, 0, time.time()
    if todo:
        engine = pick_engine(args.engine)
        gen = VllmGenerator(args) if engine == "vllm" else HFGenerator(args)
        t0 = time.time()
        progress_line("regenerate", 0, len(todo))
        answered = 0
        for n, c in enumerate(todo, 1):
            rows = prompts[c * args.chunk_size:(c + 1) * args.chunk_size]
            answers = gen([m for _, m in rows], args.seed * 1_000_003 + c)
            lines = []
            for (rid, msgs), ans in zip(rows, answers):
                lines.append(json.dumps({"id": rid, "messages": msgs + [{"role": "assistant", "content": ans}]},
                                        ensure_ascii=False))
                gen_tokens += len(ans.split())
            atomic_write(chunk_path(out_dir, c * args.chunk_size), ("\n".join(lines) + "\n").encode("utf-8"))
            log(f"regenerate: chunk {n}/{len(todo)} ({len(rows)} prompts) {time.time() - t0:.0f}s")
            answered += len(rows)
            progress_line("regenerate", n, len(todo), every_s=0, prompts_s=answered / max(time.time() - t0, 1e-9))
    final = merge(out_dir, n_chunks, args.chunk_size)
    if final:
        log(f"regenerate: wrote {final}")
    return {"ok": True, "step": "regenerate", "engine": engine, "prompts": len(prompts), "chunks": n_chunks,
            "chunks_done_now": len(todo), "rank": args.rank, "world_size": args.world_size,
            "dataset": final, "out_dir": out_dir, "answer_words": gen_tokens,
            "elapsed_s": round(time.time() - t0, 2)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="target model folder")
    ap.add_argument("--dataset", required=True, help="prompts: chat JSONL (assistant turns are re-answered)")
    ap.add_argument("--output-dir", default=".", help="pipeline root: writes <output-dir>/regenerated/")
    ap.add_argument("--out", default=None, help="write here instead of <output-dir>/regenerated")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    ap.add_argument("--max-tokens", type=int, default=256, help="answer length cap in tokens (default 256)")
    ap.add_argument("--max-prompts", type=int, default=0, help="use the first N prompts (0 = all)")
    ap.add_argument("--chunk-size", type=int, default=64, help="prompts per resumable chunk (default 64)")
    ap.add_argument("--rank", type=int, default=0)
    ap.add_argument("--world-size", type=int, default=1)
    ap.add_argument("--engine", choices=["auto", "vllm", "hf"], default="auto")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16, help="hf engine: prompts per generate call")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="hf engine")
    ap.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto", help="hf engine")
    ap.add_argument("--vllm-dtype", default="bfloat16", help="vllm engine dtype")
    ap.add_argument("--max-model-len", type=int, default=2048, help="vllm engine")
    ap.add_argument("--tp-size", type=int, default=1, help="vllm engine: tensor parallel size")
    ap.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=True, help="vllm engine")
    return run_step("regenerate", run, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
