#!/usr/bin/env python3
"""Pipeline step `regenerate`: the target answers the prompts itself (self-distillation data).

EAGLE-3 drafts learn to predict what the target says, so they train best on the target's own answers
(speculators' regenerate-responses, SpecForge's data regeneration). --dataset is a chat JSONL file (the
format `prepare` reads) or a dataset name (`sharegpt`, see data_sources.py). Every user turn of a
conversation is answered by the target in turn, through its chat template, each answer conditioned on the
target's own earlier answers; the file's assistant turns are replaced. A thinking target's answer is written as its
template renders it back (data/reasoning.py): the reasoning in `reasoning_content`, the answer in `content`, where
the template shows that field (Kimi-K2.5, Qwen3); whole in `content` where it does not. Turns are batched across
conversations (round r answers turn r of every conversation that has one). A conversation stops at the turn
whose prompt plus --max-tokens no longer fits --max-model-len (counted in the result); a first turn that
does not fit is bad input for a file (exit 2 naming FILE:LINE, before any model loads) and dropped for a
named dataset (--long-prompts says otherwise).

The prompts are curated first (data/curation.py: --dedupe, --min-prompt-chars, --max-prompt-chars, --scripts;
repeats are removed for a dataset by name unless --dedupe off), then cut to --max-prompts. With --self-prompts N
the target writes prompts itself until the set holds N conversations (data/self_prompts.py: its chat template's
opening of a user turn, sampled; each judged against the set so far), answered like the others.

  <output-dir>/regenerated/chunks/<run key>/c_XXXXXXXX.jsonl   one file per --chunk-size conversations (atomic)
  <output-dir>/regenerated/self_prompts/<key>/b_XXXXXXXX.jsonl the target's written prompts, a batch per file
  <output-dir>/regenerated/chat.jsonl                          every chunk in order, once all exist
  <output-dir>/regenerated/manifest.json                       run key, settings, provenance (dataset, curation,
                                                               self prompts), counts, this run's tokens/s
  <output-dir>/regenerated/chat.jsonl.source.json              the same record without this run's figures, where
                                                               prepare looks for it (the same data, the same record)

Resumable, and only with itself: chunks live under a run key, a hash of what produced them (the dataset's
sha256, the digest of the prompts kept and written, the model, every setting that changes an answer, the engine and this code's version). A re-run with
the same key skips finished chunks; a re-run with another prompts file or other settings starts a new key,
says which settings changed, and never reports the old answers as its own.
Sharded: --rank/--world-size take contiguous ranges of chunks (every rank can run on its own host or GPU);
whichever rank finds every chunk present writes chat.jsonl. The target's prompts are written by one process: a rank
of several (--world-size > 1) reads them and refuses where they are not all written yet.
--engines N: this process's chunks are answered by N processes of this step at once, each with its part of a GPU
(engine/engine_processes.py; a small target's engine is bound by one CPU core, not by its GPU), started one at a time
and each claiming the next chunk nobody holds (a chunk claimed by an engine that dies is taken by another); the
prompts are written first, by this process, and chat.jsonl once all have finished. An engine that fails while the
others answer every chunk is reported, not fatal.
Engines: vllm (when the host's vLLM imports: a conversation's next turn is queued the moment its answer arrives,
data/answering.py's stream; --batching rounds: one LLM.chat call per turn of a chunk) or hf (transformers generate,
batched, left-padded, in rounds). --temperature 0 is greedy; > 0 samples with a seed per chunk and turn, so a resumed run gives
the same answers as an uninterrupted one (per engine).

stdout: one JSON summary. stderr: progress. Exit 0 ok, 1 failure, 2 bad input.
"""
import os
import sys


import hashlib
import itertools
import json
import time

from kimi_eagle_host import compute_dtype, cpu_threads
from kimi_eagle_host.step_runtime import parse_step_args
from kimi_eagle_host.step_runtime import (BadInput, Refused, atomic_write, atomic_write_json, files_digest, log,
                                          model_fingerprint, model_identity, package_dir, progress_line, run_step,
                                          stdout_for_result_only)
from kimi_eagle_host.target.model_layers import text_config
from kimi_eagle_host.target.tokenizer import chat_template_sha256, load_tokenizer
from kimi_eagle_host.vllm_compat import engine_env_defaults, shut_down, size_engine, text_only_engine_kwargs
from kimi_eagle_host.data.reasoning import AnswerText
from kimi_eagle_host.engine import context_length
from kimi_eagle_host.engine.engine_processes import Claims, engine_index, one_of_several, run_engines, start_turn

# Settings that change an answer: part of the run key (rank/world size and batch sizes do not).
KEYED = ("model", "weights", "chat_template", "dataset_sha256", "prompts_sha256", "max_prompts", "max_turns",
         "temperature", "max_tokens", "seed", "chunk_size", "max_model_len", "long_prompts", "engine", "dtype", "code")


def chunk_path(chunks_dir, start):
    return os.path.join(chunks_dir, f"c_{start:08d}.jsonl")


def shard_chunks(n_chunks, rank, world_size):
    """Contiguous range of chunk indices for this rank (like extract's sample ranges)."""
    per, extra = divmod(n_chunks, world_size)
    lo = rank * per + min(rank, extra)
    return range(lo, lo + per + (1 if rank < extra else 0))


def code_version():
    return files_digest(package_dir(), ("pipeline/regenerate.py", "data/prompts.py", "data/data_sources.py",
                                        "data/curation.py", "data/self_prompts.py", "data/answering.py",
                                        "data/reasoning.py", "target/tokenizer.py"))


# ---------------------------------------------------------------------------------------------- engines

# The flags that say how much one vLLM engine of this step holds at once (engine_load; preflight reads them too).
ENGINE_FLAGS = ("max_model_len", "chunk_size")


def engine_load(args):
    """(tokens per sequence, sequences at once) of this step's vLLM engine: a round answers one turn of every
    conversation of a chunk in one call, each within --max-model-len."""
    return int(args.max_model_len or context_length.PREFLIGHT_CONTEXT), int(args.chunk_size)


class VllmGenerator:
    def __init__(self, args, memory, tok):
        """`memory`: vllm_compat.size_engine's answer for this engine (its environment is set already)."""
        from vllm import LLM, EngineArgs

        self.llm = LLM(model=args.model, dtype=args.vllm_dtype, max_model_len=args.max_model_len,
                       tensor_parallel_size=args.tp_size, trust_remote_code=True, seed=args.seed,
                       enforce_eager=args.enforce_eager, **memory["kwargs"],
                       **text_only_engine_kwargs(args.model, EngineArgs))
        self.args, self.tok, self.answer_text = args, tok, AnswerText(tok)

    def __call__(self, convs, seed):
        """[(answer text, answer tokens)] for a batch of chats."""
        from vllm import SamplingParams

        sp = SamplingParams(temperature=self.args.temperature, max_tokens=self.args.max_tokens, seed=seed)
        return [(self.answer_text(r.outputs[0].text, r.outputs[0].token_ids), len(r.outputs[0].token_ids))
                for r in self.llm.chat(convs, sp, use_tqdm=False)]

    def start(self, request_id, chat, seed):
        """Queue one turn on the engine (answering.Stream): continuous batching across conversations and turns.
        The prompt is the chat template's tokens, as LLM.chat renders them."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = self.tok.apply_chat_template(chat, tokenize=True, add_generation_prompt=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        sp = SamplingParams(temperature=self.args.temperature, max_tokens=self.args.max_tokens, seed=seed,
                            output_kind=RequestOutputKind.FINAL_ONLY)
        self.llm.llm_engine.add_request(request_id, {"prompt_token_ids": list(ids)}, sp)

    def finished(self):
        """One engine step: [(request id, answer text, answer tokens)] of the requests it finished. (vLLM versions
        that suffix request ids internally report the caller's id; the split covers those that do not.)"""
        return [(o.request_id.split("-", 1)[0], self.answer_text(o.outputs[0].text, o.outputs[0].token_ids),
                 len(o.outputs[0].token_ids)) for o in self.llm.llm_engine.step() if o.finished]

    def complete(self, prompt_ids, n, seed):
        """n samples continuing the token ids `prompt_ids` (the self-written prompts), each with its own seed."""
        from vllm import SamplingParams

        a = self.args
        sps = [SamplingParams(temperature=a.self_prompt_temperature, max_tokens=a.self_prompt_tokens, seed=seed + i,
                              skip_special_tokens=False) for i in range(n)]
        outs = self.llm.generate([{"prompt_token_ids": list(prompt_ids)}] * n, sps, use_tqdm=False)
        return [(r.outputs[0].text, len(r.outputs[0].token_ids)) for r in outs]

    def close(self):
        """Shut the engine down now: its memory goes to the engines after it, and vLLM logs its shutdown, which must
        come before the step's result."""
        shut_down(self)


class HFGenerator:
    def __init__(self, args, tok):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        dev = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[hf_dtype(args, dev)]
        self.tok, self.answer_text = tok, AnswerText(tok)
        self.tok.padding_side = "left"
        if self.tok.pad_token_id is None:
            self.tok.pad_token = self.tok.eos_token
        self.model = AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype, trust_remote_code=True).to(dev).eval()
        cpu_threads.fit(getattr(text_config(self.model.config), "hidden_size", None), dev, log)
        self.dev, self.args = dev, args

    def __call__(self, convs, seed):
        a = self.args
        texts = [self.tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in convs]
        batches = [self.tok(texts[i:i + a.batch_size], return_tensors="pt", padding=True, add_special_tokens=False)
                   for i in range(0, len(texts), a.batch_size)]
        return self._generate(batches, seed, a.temperature, a.max_tokens, skip_special=True)

    def complete(self, prompt_ids, n, seed):
        """n samples continuing the token ids `prompt_ids` (the self-written prompts)."""
        a, torch = self.args, self.torch
        rows = [list(prompt_ids)] * n
        batches = [{"input_ids": torch.tensor(rows[i:i + a.batch_size]),
                    "attention_mask": torch.ones(len(rows[i:i + a.batch_size]), len(prompt_ids), dtype=torch.long)}
                   for i in range(0, n, a.batch_size)]
        return self._generate(batches, seed, a.self_prompt_temperature, a.self_prompt_tokens, skip_special=False)

    def _generate(self, batches, seed, temperature, max_tokens, skip_special):
        torch, a = self.torch, self.args
        out = []
        for k, enc in enumerate(batches):
            enc = {key: v.to(self.dev) for key, v in enc.items()}
            torch.manual_seed(seed + k * a.batch_size)
            kw = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
            with torch.no_grad():
                gen = self.model.generate(**enc, max_new_tokens=max_tokens, pad_token_id=self.tok.pad_token_id,
                                          top_p=None, top_k=None, **kw)
            new = gen[:, enc["input_ids"].shape[1]:]
            lengths = (new != self.tok.pad_token_id).sum(dim=1).tolist()
            texts = self.tok.batch_decode(new, skip_special_tokens=skip_special)
            if skip_special:   # an answer: its think markers kept (data/reasoning.py)
                texts = [self.answer_text(t, row.tolist()) for t, row in zip(texts, new)]
            out += zip(texts, lengths)
        return out

    def close(self):
        pass


class Counted:
    """A generator that counts the answer tokens it produced and the seconds it took (tokens/s: the progress
    bar's and the result's)."""

    def __init__(self, gen):
        self.gen, self.tokens, self.seconds = gen, 0, 0.0

    def __call__(self, convs, seed):
        t0 = time.time()
        out = self.gen(convs, seed)
        self.seconds += time.time() - t0
        self.tokens += sum(n for _, n in out)
        return out

    def complete(self, prompt_ids, n, seed):
        return self.gen.complete(prompt_ids, n, seed)

    @property
    def streams(self):
        """Whether the engine batches continuously (answering.Stream) rather than in rounds."""
        return hasattr(self.gen, "start")

    def start(self, request_id, chat, seed):
        t0 = time.time()  # rendering and tokenizing the chat: part of a stream's cost, as of LLM.chat's in rounds
        self.gen.start(request_id, chat, seed)
        self.seconds += time.time() - t0

    def finished(self):
        t0 = time.time()
        out = self.gen.finished()
        self.seconds += time.time() - t0
        self.tokens += sum(n for _, _, n in out)
        return out

    def throughput(self):
        return {"answer_tokens_now": self.tokens, "generating_s_now": round(self.seconds, 2),
                "tokens_per_s_now": round(self.tokens / self.seconds, 1) if self.seconds > 0 else None}

    def close(self):
        self.gen.close()


class Engine:
    """The step's one engine, started when first needed (writing prompts, answering) and sized then."""

    def __init__(self, args, name, tok):
        self.args, self.name, self.tok = args, name, tok
        self.gen, self.memory = None, None

    def size(self):
        """Size a vLLM engine before anything is written: one that cannot fit refuses with nothing changed."""
        if self.name == "vllm" and self.memory is None:
            self.memory = size_engine("regenerate", self.args.model, self.args.tp_size, *engine_load(self.args))

    def get(self):
        if self.gen is None:
            if self.name == "vllm":
                self.size()
                self.gen = Counted(VllmGenerator(self.args, self.memory, self.tok))
            else:
                self.gen = Counted(HFGenerator(self.args, self.tok))
        return self.gen

    def close(self):
        if self.gen is not None:
            self.gen.close()
            self.gen = None  # closed once: the prompts' writer closes before several engines answer, then again


def hf_dtype(args, device):
    return compute_dtype.resolve(args.dtype, device)


def pick_engine(name):
    """('vllm' | 'hf', environment set for the vLLM engine)."""
    if name in ("auto", "vllm"):
        env = engine_env_defaults()  # before vLLM is imported: it reads them at import and engine start
        stdout_for_result_only()  # importing vLLM already logs (to stdout)
        try:
            import vllm  # noqa: F401
            return "vllm", env
        except Exception as e:  # noqa: BLE001
            if name == "vllm":
                raise BadInput(f"--engine vllm: vLLM does not import on this host ({type(e).__name__}: {e})")
    return "hf", {}


# ---------------------------------------------------------------------------------------------- answering

def conversation_row(conv, answers):
    """The chat JSONL row of `conv` with the target's answers (assistant messages, TokenBudget.reply)."""
    msgs = list(conv.system)
    for q, a in zip(conv.user_turns, answers):
        msgs += [{"role": "user", "content": q}, a]
    row = {"id": conv.id, "messages": msgs}
    if conv.category:
        row["category"] = conv.category
    return row


# ---------------------------------------------------------------------------------------------- run key

def engine_dtype(args, engine):
    return args.vllm_dtype if engine == "vllm" else hf_dtype(args, args.device if args.device != "auto" else
                                                             ("cuda" if _cuda() else "cpu"))


def prompts_digest(convs):
    """The conversations to answer, as a digest: what curation kept and the target wrote, in order."""
    h = hashlib.sha256()
    for c in convs:
        h.update(json.dumps([c.id, c.system, c.user_turns], ensure_ascii=False).encode("utf-8") + b"\n")
    return h.hexdigest()


def settings_of(args, prov, engine, convs, tok):
    return {"model": model_identity(args.model), "weights": model_fingerprint(args.model),
            "chat_template": chat_template_sha256(tok), "dataset": args.dataset,
            "dataset_sha256": prov["sha256"], "prompts_sha256": prompts_digest(convs),
            "dedupe": args.dedupe, "min_prompt_chars": args.min_prompt_chars,
            "max_prompt_chars": args.max_prompt_chars, "scripts": args.scripts, "self_prompts": args.self_prompts,
            "max_prompts": args.max_prompts, "max_turns": args.max_turns, "temperature": args.temperature,
            "max_tokens": args.max_tokens, "seed": args.seed, "chunk_size": args.chunk_size,
            "max_model_len": args.max_model_len, "long_prompts": args.long_prompts, "engine": engine,
            "dtype": engine_dtype(args, engine), "code": code_version()}


def _cuda():
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_key(settings):
    return hashlib.sha256(json.dumps({k: settings[k] for k in KEYED}, sort_keys=True).encode()).hexdigest()[:16]


def earlier_runs(chunks_root, key):
    """The settings of the most recent other run under this folder (to say what changed), or None."""
    others = []
    for name in os.listdir(chunks_root):
        path = os.path.join(chunks_root, name, "settings.json")
        if name != key and os.path.isfile(path):
            others.append((os.path.getmtime(path), path))
    if not others:
        return None
    with open(max(others)[1]) as f:
        return json.load(f)


def forget_merged_output(out_dir, key):
    """chat.jsonl of another run key must not stand next to this run's chunks (prepare would read it)."""
    man = os.path.join(out_dir, "manifest.json")
    try:
        with open(man) as f:
            old_key = json.load(f).get("run_key")
    except (OSError, ValueError):
        old_key = None
    if old_key != key:
        for name in ("chat.jsonl", "manifest.json", "chat.jsonl.source.json"):
            if os.path.exists(os.path.join(out_dir, name)):
                os.unlink(os.path.join(out_dir, name))


def merge(out_dir, chunks_dir, n_chunks, chunk_size, manifest):
    """Write chat.jsonl (and its manifest) from all chunks when every one exists; returns its path or None."""
    paths = [chunk_path(chunks_dir, c * chunk_size) for c in range(n_chunks)]
    if not all(os.path.isfile(p) for p in paths):
        return None
    data = b"".join(open(p, "rb").read() for p in paths)
    final = os.path.join(out_dir, "chat.jsonl")
    atomic_write(final, data)
    manifest["sha256"] = hashlib.sha256(data).hexdigest()
    atomic_write_json(os.path.join(out_dir, "manifest.json"), manifest)
    # beside the data, under the name data_sources.resolve looks for: prepare records where its input came from
    atomic_write_json(final + ".source.json", source_record(manifest))
    return final


def source_record(manifest):
    """The run's manifest as the data's provenance, without this run's own figures (tokens/s, what it sampled now):
    prepare copies the record into its manifest, whose sha256 is the prepared data's identity, so a re-run that writes
    the same data (a resume with nothing left to do) must write the same record, or extract starts clean."""
    record = {k: v for k, v in manifest.items() if k != "throughput"}
    if record.get("self_prompts"):
        record["self_prompts"] = {k: v for k, v in record["self_prompts"].items() if not k.endswith("_now")}
    return record


# ---------------------------------------------------------------------------------------------- step

def load_prompts(args):
    """The dataset's conversations, curated (data/curation.py) and cut to --max-prompts: (conversations, source
    provenance, the curator, which later judges the target's own prompts against them)."""
    from kimi_eagle_host.data.curation import Curator, curate_conversations, policy_from_args
    from kimi_eagle_host.data.data_sources import is_source_name, resolve
    from kimi_eagle_host.data.prompts import read_conversations

    named = is_source_name(args.dataset)
    if args.long_prompts == "auto":
        args.long_prompts = "skip" if named else "fail"
    # the target's own prompts repeat themselves: with them, `dedupe: auto` removes repeats from a file's set too
    curator = Curator(policy_from_args(args, named or args.self_prompts > 0))
    path, prov = resolve(args.dataset)
    active = curator.policy.active()
    convs = read_conversations(path, 0 if active else args.max_prompts, label=args.dataset)
    if active:
        convs = curate_conversations(convs, curator)
        r = curator.report()
        log(f"regenerate: curation kept {r['out']} of {r['in']} conversations"
            + "".join(f", {n} {why.replace('_', ' ')}" for why, n in sorted(r["dropped"].items())))
        if not convs:
            raise BadInput(f"{args.dataset}: no conversation is left after curation ({r['dropped']})")
    return convs[:args.max_prompts] if args.max_prompts else convs, prov, curator


def self_prompt_key(args, engine, opening):
    """What the target's written prompts depend on: a resume under another key starts new batches."""
    keyed = {"model": model_identity(args.model), "weights": model_fingerprint(args.model), "opening": opening,
             "temperature": args.self_prompt_temperature, "tokens": args.self_prompt_tokens, "seed": args.seed,
             "batch": args.chunk_size, "engine": engine, "dtype": engine_dtype(args, engine), "code": code_version()}
    return hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:16], keyed


def add_self_prompts(args, convs, tok, budget, curator, engine, out_dir):
    """The target's own prompts (data/self_prompts.py) after `convs` until the set holds --self-prompts
    conversations: (the conversations added, their record)."""
    from kimi_eagle_host.data.prompts import Conversation
    from kimi_eagle_host.data.self_prompts import Writer, template_opening

    needed = args.self_prompts - len(convs)
    opening, stops = template_opening(tok, args.model)
    key, keyed = self_prompt_key(args, engine.name, opening)
    folder = os.path.join(out_dir, "self_prompts", key)
    os.makedirs(folder, exist_ok=True)
    atomic_write_json(os.path.join(folder, "settings.json"), keyed)
    lengths = {}

    def accept(cid, text):
        n = budget.base + budget.count([text])[0]
        if not budget.fits(n):
            return "does_not_fit_context"
        lengths[cid] = n
        return curator.judge(cid, [text])

    def complete(ids, n, seed):
        if args.world_size > 1:  # ranks would each write other prompts: only one process writes them
            raise BadInput(f"--self-prompts {args.self_prompts} with --world-size {args.world_size}: the target "
                           "writes its prompts in one process; run regenerate with --world-size 1 first")
        return engine.get().complete(ids, n, seed)

    writer = Writer(folder, complete,
                    tok(opening, add_special_tokens=False)["input_ids"], stops, args.chunk_size, args.seed)
    kept = writer.fill(needed, accept)
    added = [Conversation(id=cid, line=0, user_turns=[text], first_tokens=lengths[cid]) for cid, text in kept]
    st = writer.stats
    record = {"requested_conversations": args.self_prompts, "public_conversations": len(convs),
              "needed": needed, "written": len(added), "key": key, "folder": folder, "opening": opening,
              "stops": stops, **st, "tokens_per_s_now": round(st["tokens_now"] / st["seconds_now"], 1)
              if st["seconds_now"] > 0 else None}
    log(f"regenerate: {len(added)} prompts written by the target (opening {opening!r}; {st['batches']} batches, "
        f"{st['batches_written_now']} sampled now)")
    return added, record


def chunk_seed(args, c):
    """Chunk c's sampling seed; turn r of its conversations samples with this + r (rounds and stream alike)."""
    return args.seed * 1_000_003 + c * 1009


def answer_chunks(args, engine, convs, budget, chunks_dir, todo, total=None, written=None):
    """Answer every chunk `todo` yields and write each (atomically) as it completes: (turns answered, turns cut for
    the context, how the engine was kept busy, chunks written). `total`: the chunks left to the step (its progress
    bar, when `todo` is shared with other engines); `written(c)` is told of each chunk written."""
    from kimi_eagle_host.data.answering import Stream, answer_in_rounds

    gen = engine.get()
    t0 = time.time()
    totals = {"answered": 0, "cut": 0, "chunks": 0, "convs": 0}
    total = len(todo) if total is None else total
    progress_line("regenerate", 0, total)

    def write(c, answers, cut):
        rows = convs[c * args.chunk_size:(c + 1) * args.chunk_size]
        lines = [json.dumps(conversation_row(conv, a), ensure_ascii=False) for conv, a in zip(rows, answers)]
        atomic_write(chunk_path(chunks_dir, c * args.chunk_size), ("\n".join(lines) + "\n").encode("utf-8"))
        if written:
            written(c)
        totals["answered"] += sum(len(a) for a in answers)
        totals["cut"] += cut
        totals["chunks"] += 1
        totals["convs"] += len(rows)
        log(f"regenerate: chunk {c + 1} of {chunk_count(convs, args)} ({len(rows)} conversations; {totals['chunks']} "
            f"written here) {time.time() - t0:.0f}s")
        # The bar of `kimi-eagle logs`: chunks done of all, ETA, the answers' tokens/s and conversations/s.
        dt = max(time.time() - t0, 1e-9)
        progress_line("regenerate", totals["chunks"], total, every_s=0, tok_s=gen.tokens / dt,
                      prompts_s=totals["convs"] / dt)

    batching = "stream" if gen.streams and args.batching in ("auto", "stream") else "rounds"
    if batching == "stream":
        # A generator, not a list: `todo` claims a chunk each time it is drawn (engines sharing the chunks), and the
        # stream draws the next only when the engine has room. A list claimed every free chunk at the first engine's
        # start: on the H200 it answered 95 of 98 chunks while three others ended after their first.
        chunks = ((c, convs[c * args.chunk_size:(c + 1) * args.chunk_size], chunk_seed(args, c)) for c in todo)
        Stream(gen, budget, args.max_turns, window=2 * args.chunk_size).run(chunks, write)
    else:
        for c in todo:
            rows = convs[c * args.chunk_size:(c + 1) * args.chunk_size]
            write(c, *answer_in_rounds(gen, rows, budget, chunk_seed(args, c), args.max_turns))
    return totals["answered"], totals["cut"], batching, totals["chunks"]


def chunk_count(convs, args) -> int:
    return (len(convs) + args.chunk_size - 1) // args.chunk_size


def chunk_written(chunks_dir, c, args) -> bool:
    return os.path.isfile(chunk_path(chunks_dir, c * args.chunk_size))


def written_turns(chunks_dir, c, args, convs) -> tuple[int, int]:
    """(turns answered, conversations cut for the context) of chunk c, as its file holds them: a row's assistant
    messages are its answered turns (conversation_row), and a conversation answered short of its turns (and of
    --max-turns) was cut. Read from the file, so a chunk counts whichever process wrote it."""
    rows = convs[c * args.chunk_size:(c + 1) * args.chunk_size]
    with open(chunk_path(chunks_dir, c * args.chunk_size), encoding="utf-8") as f:
        answered = [sum(m["role"] == "assistant" for m in json.loads(line)["messages"]) for line in f if line.strip()]
    cut = sum(n < min(len(conv.user_turns), args.max_turns or len(conv.user_turns))
              for conv, n in zip(rows, answered))
    return sum(answered), cut


def engine_of() -> str | None:
    """"i/N" (from 1) of one of several engines, as its result and the parent's `each` name it."""
    i, n = engine_index()
    return f"{i + 1}/{n}" if one_of_several() else None


def answer_as_one_of_several(args, engine, convs, budget, chunks_dir, todo):
    """One of --engines processes: start this engine when the one before is up (start_turn), then answer the chunks
    of `todo` nobody else holds, one claim at a time (Claims): (answered, cut, batching, chunks written)."""
    i, n = engine_index()
    claims = Claims(os.path.join(chunks_dir, ".claims"))
    finished = lambda c: chunk_written(chunks_dir, c, args)  # noqa: E731
    mine = claims.next_free(todo, finished, first=i * len(todo) // max(n, 1))
    first = next(mine, None)   # claimed before the engine starts: none left, no engine started for nothing
    if first is None:
        log(f"regenerate: engine {i + 1} of {n}: the others hold or wrote every chunk; not started")
        return 0, 0, None, 0
    with start_turn(os.path.join(chunks_dir, ".engine_start.lock")) as waited:
        engine.size()
        engine.get()
    log(f"regenerate: engine {i + 1} of {n} started ({waited:.0f} s waiting for the engines before it to start)")
    answered, cut, batching, chunks = answer_chunks(args, engine, convs, budget, chunks_dir,
                                                    itertools.chain([first], mine), total=len(todo),
                                                    written=claims.done)
    # The chunks another engine held as this one passed them: each is waited for and answered here where that
    # engine died without writing it (one at a time, so that this engine waits holding none).
    for c in claims.take_over(todo, finished):
        log(f"regenerate: engine {i + 1} of {n}: chunk {c + 1} was left by an engine that ended; answering it")
        more = answer_chunks(args, engine, convs, budget, chunks_dir, [c], total=len(todo), written=claims.done)
        answered, cut, chunks = answered + more[0], cut + more[1], chunks + more[3]
    return answered, cut, batching, chunks


def answer_with_engines(args, chunks_dir, todo, convs):
    """This process's chunks answered by --engines processes of this step at once (engine/engine_processes.py):
    what they answered together, counted from the chunks written (a dead engine's count died with it). An engine
    that failed is reported when the others answered every chunk; refused (exit 1) when chunks are left, after the
    others finished what they could."""
    results = run_engines(__spec__.name if __spec__ else "kimi_eagle_host.pipeline.regenerate", args.step_argv,
                          args.engines)
    failed = [f"engine {i + 1}: {r.get('error')}" for i, r in enumerate(results) if not r.get("ok")]
    left = [c for c in todo if not chunk_written(chunks_dir, c, args)]
    if failed and left:
        raise Refused(f"{len(failed)} of {args.engines} engines failed ({'; '.join(failed)}); {len(left)} chunks "
                      "left: the chunks answered are kept, a re-run answers the rest")
    if failed:
        log(f"regenerate: {len(failed)} of {args.engines} engines failed, the others answered every chunk: "
            + "; ".join(failed))
    results = [r for r in results if r.get("ok")]
    tokens = sum((r.get("throughput") or {}).get("answer_tokens_now") or 0 for r in results)
    seconds = max((r.get("throughput") or {}).get("generating_s_now") or 0 for r in results)
    # written now by any engine, a dead one's too (its own count died with it)
    unwritten = set(left)
    turns = [written_turns(chunks_dir, c, args, convs) for c in todo if c not in unwritten]
    return {"engines": args.engines, "failed": failed, "chunks_done_now": len(todo) - len(left),
            "turns_answered": sum(a for a, _ in turns), "turns_cut": sum(cut for _, cut in turns),
            "batching": next((r["batching"] for r in results if r.get("batching")), None),
            "throughput": {"answer_tokens_now": tokens, "generating_s_now": round(seconds, 2),
                           "tokens_per_s_now": round(tokens / seconds, 1) if seconds > 0 else None},
            "each": [{k: r.get(k) for k in ("engine_of", "chunks_done_now", "turns_answered_now",
                                             "throughput", "engine_memory")} for r in results]}


def check_args(args):
    if not 0 <= args.rank < args.world_size:
        raise BadInput(f"--rank {args.rank}: must be in 0..{args.world_size - 1} (--world-size {args.world_size})")
    if args.temperature < 0 or args.max_tokens < 1 or args.chunk_size < 1 or args.max_turns < 0:
        raise BadInput("--temperature and --max-turns must be >= 0, --max-tokens and --chunk-size >= 1")
    if args.self_prompts < 0 or args.self_prompt_tokens < 1 or args.self_prompt_temperature <= 0:
        raise BadInput("--self-prompts must be >= 0, --self-prompt-tokens >= 1, --self-prompt-temperature > 0")
    if args.engines > 1 and args.tp_size > 1:
        raise BadInput(f"--engines {args.engines} with --tp-size {args.tp_size}: several engines on a host are for a "
                       "target one GPU holds; run one engine over the GPUs (--engines 1)")
    if not os.path.isfile(os.path.join(args.model, "config.json")):
        raise BadInput(f"{args.model}/config.json: missing (--model must be a local model folder)")


def run(args):
    from kimi_eagle_host.data.prompts import TokenBudget, check_lengths

    check_args(args)
    out_dir = os.path.abspath(args.out or os.path.join(args.output_dir, "regenerated"))
    convs, prov, curator = load_prompts(args)
    tok = load_tokenizer(args.model)
    budget = TokenBudget(tok, None, args.max_tokens)
    # the context the engine is asked for: given (and within the model's positions) or derived from the prompts
    # (and from a prompt the target may still write: its opening and --self-prompt-tokens)
    least = budget.base + args.self_prompt_tokens + args.max_tokens if args.self_prompts else 0
    args.max_model_len = budget.limit = context_length.resolve(args.max_model_len, args.model, convs, budget,
                                                               args.max_turns, least=least)
    convs, dropped_long = check_lengths(convs, budget, args.dataset, args.long_prompts)
    engine_name, engine_env = pick_engine(args.engine)
    if engine_name == "vllm":
        args.vllm_dtype = compute_dtype.for_vllm(args.vllm_dtype, log)
    if args.batching == "stream" and engine_name != "vllm":
        raise BadInput(f"--batching stream: needs the vllm engine (continuous batching); this run's is {engine_name}")
    engine = Engine(args, engine_name, tok)
    self_record = None
    if args.self_prompts > len(convs):
        engine.size()
        added, self_record = add_self_prompts(args, convs, tok, budget, curator, engine, out_dir)
        convs = convs + added
    settings = settings_of(args, prov, engine_name, convs, tok)
    key = run_key(settings)
    chunks_root = os.path.join(out_dir, "chunks")
    chunks_dir = os.path.join(chunks_root, key)
    n_chunks = chunk_count(convs, args)
    mine = shard_chunks(n_chunks, args.rank, args.world_size)
    todo = [c for c in mine if not chunk_written(chunks_dir, c, args)]
    if todo and args.engines == 1 and not one_of_several():  # several engines size themselves, in turn
        engine.size()
    fresh = not os.path.isdir(chunks_dir)
    os.makedirs(chunks_dir, exist_ok=True)
    before = earlier_runs(chunks_root, key) if fresh else None  # a resume of this key reuses its own chunks
    changed = sorted(k for k in KEYED if before and before.get(k) != settings[k])
    if before:
        log(f"regenerate: answers of an earlier run are not reused: {', '.join(changed) or 'settings'} changed "
            f"(this run's key {key})")
    atomic_write_json(os.path.join(chunks_dir, "settings.json"), settings)
    forget_merged_output(out_dir, key)
    log(f"regenerate: {len(convs)} conversations ({sum(len(c.user_turns) for c in convs)} user turns) in {n_chunks} "
        f"chunks; rank {args.rank}/{args.world_size} owns {len(mine)}, {len(mine) - len(todo)} already done")
    t0 = time.time()
    engines = None
    if todo and args.engines > 1:
        engine.close()  # the prompts' writer gives its memory to the engines that answer
        engines = answer_with_engines(args, chunks_dir, todo, convs)
        answered, cut, batching, throughput = (engines["turns_answered"], engines["turns_cut"], engines["batching"],
                                               engines["throughput"])
        done_now = engines["chunks_done_now"]
    else:
        answer = answer_as_one_of_several if one_of_several() else answer_chunks
        answered, cut, batching, done_now = (answer(args, engine, convs, budget, chunks_dir, todo) if todo
                                             else (0, 0, None, 0))
        throughput = engine.gen.throughput() if engine.gen else None
    engine.close()
    manifest = {"run_key": key, "settings": settings, "source": prov, "conversations": len(convs),
                "dropped_long_prompts": dropped_long, "curation": curator.report() if curator.policy.active()
                else None, "self_prompts": self_record, "throughput": throughput}
    # one of several engines leaves chat.jsonl to the process that started them all
    final = None if one_of_several() else merge(out_dir, chunks_dir, n_chunks, args.chunk_size, manifest)
    if final:
        log(f"regenerate: wrote {final}")
    return {"ok": True, "step": "regenerate", "engine": engine_name, "engine_env": engine_env,
            "engine_memory": engine.memory and engine.memory["says"], "run_key": key,
            "not_reused_because": changed if before else None, "conversations": len(convs),
            "prompts": len(convs), "dropped_long_prompts": dropped_long, "chunks": n_chunks,
            "chunks_done_now": done_now, "batching": batching, "turns_answered_now": answered,
            "engine_of": engine_of(),
            "turns_cut_for_context_now": cut,
            "rank": args.rank, "world_size": args.world_size, "dataset": final, "out_dir": out_dir,
            "source": prov, "curation": manifest["curation"] and {k: manifest["curation"][k] for k in
                                                                   ("in", "out", "dropped")},
            "self_prompts": self_record and {k: self_record[k] for k in (
                "written", "needed", "batches", "batches_written_now", "tokens_per_s_now", "stalled")},
            "throughput": throughput, "engines": engines, "elapsed_s": round(time.time() - t0, 2)}


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_step_args("regenerate", argv, __doc__)
    args.step_argv = [*argv, "--engines", "1"]  # what each of several engines runs (engine_processes.run_engines)
    return run_step("regenerate", run, args)


if __name__ == "__main__":
    sys.exit(main())
