"""What the steps read of the target's config, and the draft layer train writes, without importing transformers where
the files say everything: the same draft as through transformers' AutoConfig and LlamaConfig, on transformers 5 here
and on the transformers 4 that vLLM 0.16 hosts run; the same sizes for extract and vocab."""
from __future__ import annotations

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest

from conftest import STEP_ENV
from kimi_eagle_host.draft import parity
from kimi_eagle_host.draft.draft_model import draft_layer_config, llama_layer_config, load_target_config
from kimi_eagle_host.pipeline.vocab import model_vocab_size
from kimi_eagle_host.step_runtime import BadInput
from kimi_eagle_host.target import kimi_model
from kimi_eagle_host.target.target_config import model_info

DRAFT_ARGS = SimpleNamespace(draft_num_heads=None, draft_num_kv_heads=None, draft_intermediate_size=None, draft_layers=1)


def through_autoconfig(model_dir) -> dict:
    """The text config as train read it before: always through AutoConfig (the class's defaults filled in)."""
    from transformers import AutoConfig

    c = AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True)
    return (getattr(c, "text_config", None) or c).to_dict()


def what_train_uses(text: dict) -> tuple:
    """Everything train derives from the target's text config: the draft's layer, the target's sizes, its RoPE, its
    serving context and whether its lm_head is its embedding."""
    return (draft_layer_config(text, DRAFT_ARGS), text["num_hidden_layers"], text["vocab_size"],
            parity.rope_of(text)["rope_theta"], parity.serving_context(text), text.get("tie_word_embeddings", False))


def llama_target(folder):
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 500000.0}, architectures=["LlamaForCausalLM"]
                ).save_pretrained(folder)
    return folder


def kimi_k25_target(folder):
    kimi_model.write_real_config(str(folder))     # Kimi-K2.5's own config.json and its remote code, no weights
    return folder


@pytest.mark.parametrize("make", [llama_target, kimi_k25_target], ids=["llama", "kimi-k2.5"])
def test_a_config_that_states_every_field_gives_the_draft_autoconfig_gives(tmp_path, make):
    model = make(tmp_path / "target")
    text, archs = load_target_config(str(model))
    assert what_train_uses(text) == what_train_uses(through_autoconfig(model))
    assert archs == json.loads((model / "config.json").read_text())["architectures"]


def test_a_config_that_leaves_fields_out_gets_the_model_classs_defaults(tmp_path):
    """A config.json without max_position_embeddings or rms_norm_eps: the draft takes Llama's own defaults (2048,
    1e-6) through AutoConfig, as before, not the draft code's fallbacks."""
    model = llama_target(tmp_path / "target")
    cfg = json.loads((model / "config.json").read_text())
    for field in ("max_position_embeddings", "rms_norm_eps"):
        del cfg[field]
    (model / "config.json").write_text(json.dumps(cfg))
    text, _ = load_target_config(str(model))
    assert what_train_uses(text) == what_train_uses(through_autoconfig(model))
    assert draft_layer_config(text, DRAFT_ARGS)["max_position_embeddings"] == 2048


def test_reading_a_complete_config_imports_no_transformers(tmp_path):
    """train's, extract's and vocab's readers, in one process that never imports transformers."""
    model = kimi_k25_target(tmp_path / "target")
    code = ("import sys; from kimi_eagle_host.draft.draft_model import load_target_config; "
            "from kimi_eagle_host.target.target_config import model_info; "
            "from kimi_eagle_host.pipeline.vocab import model_vocab_size; "
            "text, _ = load_target_config(sys.argv[1]); info = model_info(sys.argv[1]); "
            "print(text['hidden_size'], info['num_layers'], info['model_class'], model_vocab_size(sys.argv[1]), "
            "'transformers' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code, str(model)], capture_output=True, text=True, env=STEP_ENV,
                       timeout=300)
    assert r.stdout.split() == ["7168", "61", "KimiK25ForConditionalGeneration", "163840", "False"], r.stderr[-2000:]


def test_a_config_in_its_classs_own_names_gives_extract_and_vocab_the_sizes(tmp_path):
    """GPT-2's config.json says n_layer and n_embd; AutoConfig's class maps them onto num_hidden_layers and
    hidden_size, which is what extract and vocab read."""
    from transformers import GPT2Config

    GPT2Config(vocab_size=96, n_embd=64, n_layer=3, n_head=4, architectures=["GPT2LMHeadModel"]
               ).save_pretrained(tmp_path)
    assert "hidden_size" not in json.loads((tmp_path / "config.json").read_text())
    assert model_info(str(tmp_path)) == {"num_layers": 3, "hidden_size": 64, "model_class": "GPT2LMHeadModel"}
    assert model_vocab_size(str(tmp_path)) == 96


@pytest.mark.parametrize("read", [load_target_config, model_info, model_vocab_size],
                         ids=["train", "extract", "vocab"])
def test_a_config_that_is_not_json_is_one_line_naming_the_model(tmp_path, read):
    (tmp_path / "config.json").write_text('{"hidden_size": 64,')
    with pytest.raises(BadInput, match=str(tmp_path)) as e:
        read(str(tmp_path))
    assert "\n" not in str(e.value)


LAYER = {"vocab_size": 96, "hidden_size": 64, "intermediate_size": 192, "num_hidden_layers": 1,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
         "max_position_embeddings": 4096, "rope_theta": 500000.0}

# How the draft's layer was written before: transformers' own LlamaConfig, serialized as speculators does.
THROUGH_LLAMACONFIG = """
import json, sys
from transformers import LlamaConfig
c = json.loads(sys.argv[1])
ours = json.loads(sys.argv[2])
before = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], intermediate_size=c["intermediate_size"],
                     num_hidden_layers=c["num_hidden_layers"], num_attention_heads=c["num_attention_heads"],
                     num_key_value_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                     rms_norm_eps=c["rms_norm_eps"], max_position_embeddings=c["max_position_embeddings"],
                     rope_parameters={"rope_type": "default", "rope_theta": c["rope_theta"]},
                     tie_word_embeddings=False).to_diff_dict()
before["rope_theta"] = c["rope_theta"]
read = lambda d: LlamaConfig(**d).to_dict()
print(json.dumps({"same_read": read(before) == read(ours),
                  "lost": sorted(k for k in before if k != "transformers_version" and before[k] is not None
                                  and ours.get(k) != before[k])}))
"""


def served_reading(python) -> dict:
    ours = llama_layer_config(LAYER)
    r = subprocess.run([str(python), "-c", THROUGH_LLAMACONFIG, json.dumps(LAYER), json.dumps(ours)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.splitlines()[-1])


def test_the_draft_layer_reads_as_transformers_own_llamaconfig_wrote_it():
    assert served_reading(sys.executable) == {"same_read": True, "lost": []}


@pytest.mark.vllm
def test_the_draft_layer_reads_the_same_on_a_transformers_4_host():
    from vllm_envs import env_python

    assert served_reading(env_python("0.16.0")) == {"same_read": True, "lost": []}
