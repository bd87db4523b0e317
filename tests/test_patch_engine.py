"""kimi_eagle_host/ops/deploy_patch.py (the patch engine) and the speculators patch sets, against the real wheels."""

from __future__ import annotations

import ast
import json
import os
import py_compile
import subprocess
import sys

import pytest
import torch
from torch import nn

from fixtures_speculators import ENGINE, PATCH_DIR, REPO, TARGETS, run_engine, tree_hashes

SETS = {"0.3.0": "speculators-0.3.0-vllm-0.16", "0.4.0": "speculators-0.4.0"}


def _engine_module():
    from kimi_eagle_host.ops import deploy_patch

    return deploy_patch


# ------------------------------------------------------------------ engine lifecycle
@pytest.mark.parametrize("version", ["0.3.0", "0.4.0"])
def test_apply_is_idempotent_and_revert_restores(install, version):
    site = install(version)
    before = tree_hashes(site)

    rc, doc, err = run_engine(site, "--patch-set", "auto")
    assert rc == 0, err
    assert doc["ok"] and doc["version"] == version and doc["patch_set"] == SETS[version]
    assert [f["status"] for f in doc["files"]] == ["changed", "changed"]
    patched = tree_hashes(site)
    for rel in TARGETS:
        py_compile.compile(str(site / rel), cfile=str(site / (rel + ".check.pyc")), doraise=True)
        assert patched[rel] != before[rel]
        pristine = list((site / ".kimi-eagle-pristine" / f"speculators-{version}").rglob("*.pristine"))
        assert any(p.name.startswith(rel.rsplit("/", 1)[1] + "." + before[rel][:12]) for p in pristine)

    rc, doc, err = run_engine(site, "--patch-set", SETS[version])
    assert rc == 0, err
    assert [f["status"] for f in doc["files"]] == ["ok", "ok"]
    again = tree_hashes(site)
    assert {k: again[k] for k in TARGETS} == {k: patched[k] for k in TARGETS}

    rc, doc, err = run_engine(site, "--patch-set", "auto", "--revert")
    assert rc == 0, err
    assert [f["status"] for f in doc["files"]] == ["reverted", "reverted"]
    after = tree_hashes(site)
    for rel in TARGETS:
        assert after[rel] == before[rel]
        assert next(f for f in doc["files"] if f["path"] == rel)["sha256_after"] == before[rel]
    assert not list(site.rglob("*.pristine")), "revert must remove our copies"

    rc, doc, _ = run_engine(site, "--patch-set", "auto", "--revert")
    assert rc == 0 and [f["status"] for f in doc["files"]] == ["ok", "ok"]


def test_check_and_diff_change_nothing(install):
    site = install("0.3.0")
    before = tree_hashes(site)
    rc, doc, _ = run_engine(site, "--patch-set", "auto", "--check")
    assert rc == 0 and [f["status"] for f in doc["files"]] == ["would-change"] * 2
    assert "diff" not in doc["files"][0]
    rc, doc, _ = run_engine(site, "--patch-set", "auto", "--diff")
    assert rc == 0 and [f["status"] for f in doc["files"]] == ["would-change"] * 2
    assert tree_hashes(site) == before
    worker, gen = (f["diff"] for f in doc["files"])
    assert "-    self, input_ids, positions, intermediate_tensors=None, inputs_embeds=None" in worker
    assert "+    **_kwargs," in worker and "+def _kimi_eagle_resolve_base_model(model):" in worker
    assert "-        if not supports_eagle3(model):" in worker
    assert "+            model_path, trust_remote_code=True" in gen
    assert "-            kv_cache_specs=kv_cache_spec," in gen
    assert "+                is_encoder_decoder=False," in gen
    assert "+            block_size=self.vllm_config.cache_config.block_size" in gen
    assert "+                self.executor.sample_tokens(" in gen

    # once patched, --check reports ok
    assert run_engine(site, "--patch-set", "auto")[0] == 0
    patched = tree_hashes(site)
    rc, doc, _ = run_engine(site, "--patch-set", "auto", "--check")
    assert rc == 0 and [f["status"] for f in doc["files"]] == ["ok", "ok"]
    assert tree_hashes(site) == patched


def test_hand_edited_file_fails_untouched(install):
    site = install("0.3.0")
    target = site / TARGETS[0]
    # edited before we ever saw it: RECORD says it is not the shipped file
    target.write_text(target.read_text() + "# local hack\n")
    before = tree_hashes(site)
    rc, doc, _ = run_engine(site, "--patch-set", "auto")
    assert rc == 1 and not doc["ok"]
    assert doc["files"][0]["status"] == "failed" and "RECORD" in doc["files"][0]["reason"]
    assert doc["files"][1]["status"] == "skipped"  # nothing of the set is written
    assert tree_hashes(site) == before

    # edited after patching: neither pristine nor our output
    site = install("0.3.0")
    target = site / TARGETS[1]
    assert run_engine(site, "--patch-set", "auto")[0] == 0
    target.write_text(target.read_text().replace("MAX_NUM_SEQS = 32", "MAX_NUM_SEQS = 64"))
    before = tree_hashes(site)
    for extra in ((), ("--check",), ("--revert",)):
        rc, doc, _ = run_engine(site, "--patch-set", "auto", *extra)
        assert rc == 1, extra
        bad = doc["files"][1]
        assert bad["status"] == "failed" and "edited" in bad["reason"], bad
        assert tree_hashes(site) == before


def test_unsupported_version_is_skipped(install):
    site = install("0.4.0")
    before = tree_hashes(site)
    rc, doc, _ = run_engine(site, "--patch-set", SETS["0.3.0"])
    assert rc == 1 and doc["ok"] is False and doc["version"] == "0.4.0"
    assert [f["status"] for f in doc["files"]] == ["skipped", "skipped"]
    assert "0.4.0" in doc["files"][0]["reason"] and "==0.3.0" in doc["files"][0]["reason"]
    assert tree_hashes(site) == before


def _custom_set(tmp_path, mutate) -> str:
    data = json.loads((PATCH_DIR / f"{SETS['0.3.0']}.json").read_text())
    mutate(data)
    d = tmp_path / "sets"
    d.mkdir(exist_ok=True)
    (d / "custom.json").write_text(json.dumps(data))
    return str(d)


def test_compile_failure_rolls_back(install, tmp_path):
    site = install("0.3.0")
    before = tree_hashes(site)

    def break_second_file(data):
        data["name"] = "broken"
        data["files"][1]["hunks"][-1]["new"] += ["        if (:"]
    pdir = _custom_set(tmp_path, break_second_file)
    rc, doc, _ = run_engine(site, "--patch-set", "broken", "--patch-dir", pdir)
    assert rc == 1 and not doc["ok"]
    assert doc["files"][1]["status"] == "failed" and "compile" in doc["files"][1]["reason"]
    assert doc["files"][0]["status"] == "skipped"
    assert tree_hashes(site) == before  # no file and no pristine copy written

    # a failure in the swap itself, after the first file was replaced, is rolled back too
    rc, doc, _ = run_engine(site, "--patch-set", "auto", env={"KIMI_EAGLE_PATCH_FAULT": "swap"})
    assert rc == 1 and all(f["status"] == "failed" for f in doc["files"])
    assert tree_hashes(site) == before
    rc, doc, _ = run_engine(site, "--patch-set", "auto", env={"KIMI_EAGLE_PATCH_FAULT": "compile"})
    assert rc == 1 and tree_hashes(site) == before


def test_upstream_mismatch_and_bad_sets(install, tmp_path):
    site = install("0.3.0")
    before = tree_hashes(site)

    def wrong_anchor(data):
        data["name"] = "stale"
        data["files"][1]["hunks"][2]["old"] = ["this text is not upstream"]
    rc, doc, _ = run_engine(site, "--patch-set", "stale", "--patch-dir", _custom_set(tmp_path, wrong_anchor))
    assert rc == 1
    assert doc["files"][1]["status"] == "failed"
    assert doc["files"][1]["reason"].startswith("upstream text does not match hunk 3")
    assert tree_hashes(site) == before

    def no_versions(data):
        del data["versions"]
    rc, doc, err = run_engine(site, "--patch-set", "auto", "--patch-dir", _custom_set(tmp_path, no_versions))
    assert rc == 2 and doc is None and "custom.json" in err and "'versions'" in err
    rc, doc, err = run_engine(site, "--patch-set", "no-such-set")
    assert rc == 2 and "no-such-set" in err
    rc, doc, err = run_engine(site, "--list")
    assert rc == 0 and {s["name"] for s in doc["patch_sets"]} == set(SETS.values())
    assert tree_hashes(site) == before


def test_version_comparer():
    pe = _engine_module()
    assert pe.version_matches("0.3.0", "==0.3.0") and pe.version_matches("0.3", "==0.3.0")
    assert pe.version_matches("0.3.5", ">=0.3.0,<0.4.0")
    assert not pe.version_matches("0.4.0", ">=0.3.0,<0.4.0")
    # PEP 440: a pre-release is neither >= its release nor taken by `<` its release (as packaging answers).
    assert not pe.version_matches("0.4.0rc1", ">=0.4.0") and not pe.version_matches("0.4.0rc1", "<0.4.0")
    assert not pe.version_matches("0.4.0.post1", ">0.4.0") and pe.version_matches("0.4.0.post1", ">=0.4.0")
    assert pe.version_matches("0.4.0.dev3", "<0.4.0rc1")
    assert pe.version_matches("0.10.0", ">0.9.9")


# ------------------------------------------------------------------ the patched resolver
def _load_resolver(install, version):
    """Patch a fresh install and exec the resolver function out of the PATCHED file."""
    site = install(version)
    assert run_engine(site, "--patch-set", "auto")[0] == 0
    source = (site / TARGETS[0]).read_text()
    fn = next(n for n in ast.parse(source).body
              if isinstance(n, ast.FunctionDef) and n.name == "_kimi_eagle_resolve_base_model")
    # vLLM's supports_eagle3 is an isinstance check on a runtime Protocol whose flag is the
    # `supports_eagle3` class attribute (plus two methods); the flag is what matters here.
    ns = {"supports_eagle3": lambda m: getattr(type(m), "supports_eagle3", False) is True}
    exec(compile(ast.Module([fn], []), "patched", "exec"), ns)
    return ns["_kimi_eagle_resolve_base_model"]


class Inner(nn.Module):  # DeepseekV2Model: owns embed_tokens, layers, norm
    def __init__(self):
        super().__init__()
        self.embed_tokens = nn.Embedding(8, 4)
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
        self.norm = nn.LayerNorm(4)


class DeepseekV3ForCausalLM(nn.Module):  # SupportsEagle only in vLLM 0.16
    supports_eagle = True

    def __init__(self):
        super().__init__()
        self.model = Inner()
        self.lm_head = nn.Linear(4, 8)

    def embed_input_ids(self, ids):
        return self.model.embed_tokens(ids)


class KimiK25ForConditionalGeneration(nn.Module):  # vLLM 0.16: language_model = *ForCausalLM
    supports_multimodal = True

    def __init__(self):
        super().__init__()
        self.vision_tower = nn.Module()
        self.vision_tower.layers = nn.ModuleList([nn.Linear(4, 4)])  # must not be picked
        self.language_model = DeepseekV3ForCausalLM()


class KimiVL015(nn.Module):  # vLLM 0.12-0.15: own get_language_model() -> inner model
    def __init__(self):
        super().__init__()
        self.language_model = Inner()

    def get_language_model(self):
        return self.language_model


class LlamaForCausalLM(DeepseekV3ForCausalLM):
    supports_eagle3 = True  # SupportsEagle3 flag: standard path


class NoLayers(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Linear(2, 2)


@pytest.mark.parametrize("version", ["0.3.0", "0.4.0"])
def test_patched_resolver_on_vllm_layouts(install, version):
    resolve = _load_resolver(install, version)
    kimi = KimiK25ForConditionalGeneration()
    assert resolve(kimi) is kimi.language_model.model                      # (a)
    ds = DeepseekV3ForCausalLM()
    assert resolve(ds) is ds.model                                         # (b)
    llama = LlamaForCausalLM()
    assert resolve(llama) is llama.model                                   # (c)
    vl = KimiVL015()
    assert resolve(vl) is vl.language_model                                # (e) inner model itself

    class WithGetter(KimiK25ForConditionalGeneration):                     # (e) 0.16 default getter
        def get_language_model(self):
            return self.language_model
    wg = WithGetter()
    assert resolve(wg) is wg.language_model.model

    with pytest.raises(AttributeError) as exc:                             # (d)
        resolve(NoLayers())
    msg = str(exc.value)
    assert "NoLayers" in msg
    for path in ("SupportsEagle3", "model.get_language_model()", "model.language_model",
                 "model.model.get_language_model()", "model.model.language_model",
                 "model.model.layers"):
        assert path in msg, (path, msg)


def test_patched_resolver_on_transformers_multimodal(install):
    from transformers import (CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration,
                              Qwen2VLConfig, Qwen2VLForConditionalGeneration)
    resolve = _load_resolver(install, "0.3.0")
    torch.manual_seed(0)
    text = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2)
    vision = CLIPVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                              num_attention_heads=2, image_size=8, patch_size=4)
    llava = LlavaForConditionalGeneration(LlavaConfig(text_config=text, vision_config=vision,
                                                      image_token_index=1))
    qwen = Qwen2VLForConditionalGeneration(Qwen2VLConfig(
        text_config=dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2,
                         rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=16, num_heads=2, mlp_ratio=2,
                           patch_size=2, spatial_merge_size=1, temporal_patch_size=1),
        bos_token_id=0, eos_token_id=1))
    for model, n_layers in ((llava, 2), (qwen, 2)):
        base = resolve(model)
        # the module that owns the *decoder* layers (not the vision encoder's)
        assert base is model.get_decoder(), type(model).__name__
        assert isinstance(base.layers, nn.ModuleList) and len(base.layers) == n_layers


# The ops modules, and the ops packages by their entry point (ops/preflight/__main__.py) and their libraries.
OPS = REPO / "kimi_eagle_host" / "ops"


@pytest.mark.parametrize("module", sorted(str(p.relative_to(OPS).with_suffix("")).replace("/", ".").removesuffix(".__main__")
                                           for p in OPS.rglob("*.py") if p.stem != "__init__"))
def test_ops_scripts_run_with_only_the_stdlib(module):
    """Ops payloads (and the step runtime they import) must run on a host without torch or numpy:
    `-S` hides every site-packages folder, and the environment names only this checkout (no user site, no other
    PYTHONPATH), so only the stdlib and the host package are importable."""
    env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": str(REPO), "PYTHONNOUSERSITE": "1"}
    name = f"kimi_eagle_host.ops.{module}"
    path = OPS / f"{module.replace('.', '/')}.py"
    runnable = not path.exists() or '__name__ == "__main__"' in path.read_text()  # no such file: a package's __main__
    # a script answers --help; a library the ops import (machine_claims) is imported
    cmd = ["-m", name, "--help"] if runnable else ["-c", f"import {name}; print('usage: importable')"]
    r = subprocess.run([sys.executable, "-S", *cmd], capture_output=True, text=True, timeout=60, env=env, cwd="/")
    assert r.returncode == 0, r.stderr
    assert "usage" in r.stdout.lower()


# ------------------------------------------------------------------ no set matches the installed version
def _only_set(tmp_path, version: str) -> str:
    d = tmp_path / "one-set"
    d.mkdir(exist_ok=True)
    (d / f"{SETS[version]}.json").write_text((PATCH_DIR / f"{SETS[version]}.json").read_text())
    return str(d)


def test_no_matching_set_without_native_vllm_is_a_refusal_naming_the_ranges(install, tmp_path):
    """speculators 0.4.0 installed, only the 0.3.0 set known, no vLLM: the generator would need a patch nobody
    has: exit 1, the reason names what the sets cover, nothing written."""
    site = install("0.4.0")
    before = tree_hashes(site)
    rc, doc, _ = run_engine(site, "--patch-set", "auto", "--patch-dir", _only_set(tmp_path, "0.3.0"))
    assert rc == 1 and doc["ok"] is False and not doc.get("not_needed")
    assert "'speculators': '0.4.0'" in doc["reason"] and "speculators==0.3.0" in doc["reason"]
    assert "no vLLM installed" in doc["reason"]
    assert tree_hashes(site) == before


@pytest.mark.vllm
@pytest.mark.parametrize("mode", [[], ["--check"], ["--revert"]])
def test_no_matching_set_on_native_vllm_is_not_needed(install, tmp_path, mode):
    """The same install next to a real vLLM >= 0.18 (the 0.32 CPU build): extraction is native there, so the
    patch would fix code that never runs: ok, exit 0, saying so; nothing written, in every mode."""
    from vllm_envs import SUITE_VLLM, env_python

    py = env_python(SUITE_VLLM)
    site = install("0.4.0")
    before = tree_hashes(site)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KIMI_EAGLE")}
    p = subprocess.run([str(py), *ENGINE, "--patch-set", "auto", "--patch-dir", _only_set(tmp_path, "0.3.0"),
                        *mode], capture_output=True, text=True, timeout=120, env={**env, "PYTHONPATH": os.pathsep.join([str(site), str(REPO)])})
    doc = json.loads(p.stdout)
    assert p.returncode == 0 and doc["ok"] is True and doc["files"] == [], p.stderr
    assert f"vLLM {SUITE_VLLM}" in doc["not_needed"] and "speculators 0.4.0" in doc["not_needed"]
    assert tree_hashes(site) == before and not (site / ".kimi-eagle-pristine").exists()
