"""CPU tests for the data steps of the pipeline: prepare → extract → vocab, on tiny offline models.

Every payload runs as a subprocess under sys.executable (the "host Python"), the way the controller runs it.
Three targets: a plain Llama, a Kimi-K2.5-style remote-code wrapper around DeepseekV3 (layers at
language_model.model.layers) and a transformers Llava (layers at model.language_model.layers).
"""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SAMPLE = os.path.join(REPO, "kimi_eagle_host", "sample_data", "chat.jsonl")

from conftest import host_cmd, touch_weights
from kimi_eagle_host.data.prepared_data import PreparedDataset
from kimi_eagle_host.engine import extract_vllm
from kimi_eagle_host.engine import extract_hf
from kimi_eagle_host.pipeline import extract, tiny_model, vocab
from kimi_eagle_host.target import hf_target, model_layers

KINDS = ["llama", "kimi", "llava"]
N_LAYERS = 8
SEQ_LEN = 64  # some sample conversations are longer, so truncation is exercised
N_SAMPLES = 32
ENV = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
       "TRANSFORMERS_VERBOSITY": "error"}


def run(name, *args, env=None, timeout=300):
    """Run a payload; return (returncode, parsed stdout JSON or None, stderr)."""
    p = subprocess.run(host_cmd(f"pipeline.{name}", *args), capture_output=True, text=True,
                       env=env or ENV, timeout=timeout)
    try:
        out = json.loads(p.stdout)
    except ValueError:
        out = None
    return p.returncode, out, p.stderr


def popen(name, *args, env=None):
    return subprocess.Popen(host_cmd(f"pipeline.{name}", *args), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env or ENV)


def load_target(path):
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    try:
        m = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)
    except ValueError:
        m = AutoModelForImageTextToText.from_pretrained(path, trust_remote_code=True)
    return m.eval()


def load_hs(path):
    from safetensors.torch import load_file

    return load_file(path)


# ----------------------------------------------------------------------------------------------------
# fixtures: models + one full pipeline run per model (extract split over 2 ranks running concurrently)

@pytest.fixture(scope="session")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    return {k: tiny_model.build(str(root / k), kind=k, layers=N_LAYERS, seed=0)["out_dir"] for k in KINDS}


@pytest.fixture(scope="session")
def pipeline(models, tmp_path_factory):
    roots = {}
    for kind in KINDS:
        root = tmp_path_factory.mktemp("run_" + kind)
        code, out, err = run("prepare", "--model", models[kind], "--dataset", SAMPLE, "--output-dir", root,
                             "--seq-len", SEQ_LEN, "--max-samples", N_SAMPLES)
        assert code == 0, err
        roots[kind] = {"root": str(root), "prepare": out}
    # extract for all models at once; the llama run is split over 2 ranks (sharding), the others use 1
    procs = {}
    for kind in KINDS:
        ranks = 2 if kind == "llama" else 1
        procs[kind] = [popen("extract", "--model", models[kind], "--output-dir", roots[kind]["root"], "--batch-size", 4,
                             "--seq-len", SEQ_LEN, "--rank", r, "--world-size", ranks) for r in range(ranks)]
    for kind in KINDS:
        results = []
        for p in procs[kind]:
            stdout, stderr = p.communicate(timeout=300)
            assert p.returncode == 0, stderr
            results.append(json.loads(stdout))
        roots[kind]["ranks"] = results
    return roots


# ----------------------------------------------------------------------------------------------------
# model_layers

def test_parse_layer_ids():
    assert model_layers.default_layer_ids(61) == [2, 30, 58, 61]
    assert model_layers.parse_layer_ids(None, 8) == [2, 4, 5, 8]
    assert model_layers.parse_layer_ids(" 0, 3 ,8", 8) == [0, 3, 8]
    # vLLM concatenates aux states in layer order: ids given out of order come back sorted, N last
    assert model_layers.parse_layer_ids("8,5,2", 8) == [2, 5, 8]
    with pytest.raises(model_layers.LayerIdError, match=r"layer id 9 is out of range 0\.\.8"):
        model_layers.parse_layer_ids("2,9", 8)
    with pytest.raises(model_layers.LayerIdError, match=r"layer id -1 is out of range"):
        model_layers.parse_layer_ids("-1", 8)
    with pytest.raises(model_layers.LayerIdError, match="given twice"):
        model_layers.parse_layer_ids("2,2", 8)
    with pytest.raises(model_layers.LayerIdError, match="'x' is not an integer"):
        model_layers.parse_layer_ids("2,x", 8)
    with pytest.raises(model_layers.LayerIdError, match="collide"):
        model_layers.default_layer_ids(4)


def test_text_config():
    class Inner:
        vocab_size = 7

    class Wrapped:
        text_config = Inner()

    class Getter:
        def get_text_config(self):
            return Inner

    plain = object()
    assert isinstance(model_layers.text_config(Wrapped()), Inner)
    assert model_layers.text_config(Getter()) is Inner
    assert model_layers.text_config(plain) is plain


def test_resolve_decoder_stack_paths(models):
    expected = {"llama": "model.layers", "kimi": "language_model.model.layers", "llava": "model.language_model.layers"}
    for kind, path in expected.items():
        m = load_target(models[kind])
        owner, layers, got = model_layers.resolve_decoder_stack(m)
        assert got == path and len(layers) == N_LAYERS and owner.layers is layers
        assert m.get_submodule(got) is layers
    # remote code really is remote code (loaded from the model dir, like Kimi-K2.5)
    kimi = load_target(models["kimi"])
    assert type(kimi).__module__.startswith("transformers_modules")
    assert not hasattr(kimi, "model")


def test_resolve_decoder_stack_order_and_error():
    from torch import nn

    class Stack(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([nn.Identity(), nn.Identity()])

    class SupportsEagle3:  # stands in for vLLM's interface marker
        pass

    class Flagged(nn.Module, SupportsEagle3):
        def __init__(self):
            super().__init__()
            self.model = Stack()
            self.language_model = nn.Module()
            self.language_model.model = Stack()

    class ViaGetter(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = nn.Module()
            self.lm.model = Stack()
            self.model = Stack()  # must lose against get_language_model()

        def get_language_model(self):
            return self.lm

    class Nothing(nn.Module):
        pass

    assert model_layers.resolve_decoder_stack(Flagged())[2] == "model.layers"
    assert model_layers.resolve_decoder_stack(ViaGetter())[2] == "lm.model.layers"
    with pytest.raises(model_layers.LayerResolutionError) as e:
        model_layers.resolve_decoder_stack(Nothing())
    msg = str(e.value)
    assert "Nothing" in msg and "model.layers" in msg and "<model itself>.layers" in msg


# ----------------------------------------------------------------------------------------------------
# tiny_model

def test_tiny_model_deterministic_and_tokenizer(models, tmp_path):
    from transformers import AutoTokenizer

    again = tiny_model.build(str(tmp_path / "llama2"), kind="llama", layers=N_LAYERS, seed=0)["out_dir"]
    with open(os.path.join(models["llama"], "model.safetensors"), "rb") as a, \
            open(os.path.join(again, "model.safetensors"), "rb") as b:
        assert a.read() == b.read()
    for kind in KINDS:
        tok = AutoTokenizer.from_pretrained(models[kind], trust_remote_code=True)
        with open(os.path.join(models[kind], "config.json")) as f:
            cfg = json.load(f)
        vocab_size = cfg.get("text_config", cfg)["vocab_size"]
        assert len(tok) == vocab_size == 512
        text = tok.apply_chat_template([{"role": "user", "content": "Grüß dich, 日本"},
                                        {"role": "assistant", "content": "Hallo!"}], tokenize=False)
        assert text == "<|bos|><|user|>\nGrüß dich, 日本<|end|>\n<|assistant|>\nHallo!<|end|>"
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
    with open(os.path.join(models["kimi"], "config.json")) as f:
        cfg = json.load(f)
    assert cfg["auto_map"]["AutoModelForCausalLM"] == "modeling_kimi_tiny.KimiK25ForConditionalGeneration"
    assert cfg["text_config"]["model_type"] == "deepseek_v3" and cfg["text_config"]["n_routed_experts"] == 4


# ----------------------------------------------------------------------------------------------------
# prepare

def _expected_assistant_text(row):
    turns = row.get("messages") or row.get("conversations")
    out = []
    for t in turns:
        if t.get("role", t.get("from")) in ("assistant", "gpt"):
            out.append(t.get("content", t.get("value")) + "<|end|>")
    return "".join(out)


def test_prepare_loss_mask_is_exactly_assistant_tokens(models, pipeline):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(models["kimi"], trust_remote_code=True)
    root = pipeline["kimi"]["root"]
    ds = PreparedDataset(os.path.join(root, "prepared"))
    with open(SAMPLE, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    assert len(ds) == N_SAMPLES
    freq = np.zeros(512, dtype=np.int64)
    truncated = 0
    for i in range(len(ds)):
        ids, mask = ds[i]
        row = rows[ds.lines[i] - 1]
        msgs = row.get("messages") or [{"role": {"human": "user", "gpt": "assistant"}.get(t["from"], t["from"]),
                                        "content": t["value"]} for t in row["conversations"]]
        full = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        # independent oracle: the template's {% generation %} markers
        assert list(ids) == full["input_ids"][:SEQ_LEN]
        assert list(mask) == full["assistant_masks"][:SEQ_LEN]
        if len(full["input_ids"]) > SEQ_LEN:
            truncated += 1
        else:
            assert tok.decode(ids[mask.astype(bool)]) == _expected_assistant_text(row)
        np.add.at(freq, ids[mask.astype(bool)], 1)
    assert truncated > 0  # the test data exercises truncation
    assert np.array_equal(np.load(os.path.join(root, "prepared", "token_freq.npy")), freq)
    with open(os.path.join(root, "prepared", "manifest.json")) as f:
        man = json.load(f)
    assert man["count"] == N_SAMPLES and man["seq_len"] == SEQ_LEN and man["model"] == models["kimi"]
    assert len(man["source_sha256"]) == 64 and man["loss_tokens"] == int(freq.sum())


# A Qwen3-style template (the shape of Qwen3's own, without tools): an assistant turn after the last user message
# shows its reasoning in a <think> block (an empty one when it has none); earlier turns show only the text after their
# </think>. Rendering the conversation turn by turn is then not a prefix of rendering it whole.
QWEN3_STYLE = (
    "{%- set ns = namespace(last_query=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_query = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] != 'assistant' -%}{{- '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' -}}"
    "{%- else -%}"
    "{%- set content = m['content'] -%}{%- set reasoning = '' -%}"
    "{%- if '</think>' in content -%}"
    "{%- set reasoning = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}"
    "{%- endif -%}"
    "{%- if loop.index0 > ns.last_query and (loop.last or reasoning) -%}"
    "{{- '<|im_start|>assistant\n<think>\n' + reasoning.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') -}}"
    "{%- else -%}{{- '<|im_start|>assistant\n' + content -}}{%- endif -%}"
    "{{- '<|im_end|>\n' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)


def qwen3_style_tokenizer(out, template=QWEN3_STYLE):
    """The tiny tokenizer with Qwen3's turn markers as special tokens, <|im_end|> its eos, and a Qwen3-style template."""
    tok = tiny_model.build_tokenizer(512)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = template
    tok.save_pretrained(out)
    return tok


def masked_runs(tok, ids, mask):
    """The text of each run of consecutive trained tokens."""
    runs, run_ids = [], []
    for t, m in zip([*ids, 0], [*mask, 0]):
        if m:
            run_ids.append(int(t))
        elif run_ids:
            runs.append(tok.decode(run_ids))
            run_ids = []
    return runs


def prepared_runs(tmp_path, template, rows):
    """prepare (the step, as a host runs it) over `rows` with a Qwen3-style tokenizer: each row's trained text runs."""
    tok = qwen3_style_tokenizer(tmp_path / "tok", template)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows), encoding="utf-8")
    code, out, err = run("prepare", "--model", tmp_path / "tok", "--dataset", data, "--output-dir", tmp_path / "o")
    assert code == 0 and out["count"] == len(rows), err
    ds = PreparedDataset(str(tmp_path / "o" / "prepared"))
    got = []
    for i, row in enumerate(rows):
        ids, mask = ds[i]
        assert tok.decode(ids) == tok.apply_chat_template(row, tokenize=False)  # the whole conversation, once
        got.append(masked_runs(tok, ids, mask))
    return got


def user(text):
    return {"role": "user", "content": text}


def bot(text):
    return {"role": "assistant", "content": text}


END = "<|im_end|>\n"


def test_prepare_masks_the_answers_of_a_template_that_renders_earlier_turns_otherwise(tmp_path):
    """A Qwen3-style template drops the reasoning of earlier answers (what regenerate writes for a thinking target
    holds <think>...</think>): each earlier turn trains on the text the template keeps and its end of turn, the last
    on all it renders, as when it is the only one; never on a user's words that repeat the answer ("Yes")."""
    rows = [
        [user("Reply with Yes or No: is water wet?"), bot("Yes"), user("Are you sure?"), bot("Yes, quite.")],
        [{"role": "system", "content": "Greet back."}, user("Hi"), bot("<think>\nuser greets\n</think>\n\nHello!"),
         user("Bye"), bot("<think>\nok\n</think>\n\nBye!")],
        [user("Say Yes."), bot("Yes"), user("Again: Yes?"), bot("<think>\nsure\n</think>\n\nYes"), user("Once more."),
         bot("<think>\nsame\n</think>\n\nYes")],
    ]
    assert prepared_runs(tmp_path, QWEN3_STYLE, rows) == [
        ["Yes" + END, "<think>\n\n</think>\n\nYes, quite." + END],
        ["Hello!" + END, "<think>\nok\n</think>\n\nBye!" + END],
        ["Yes" + END, "Yes" + END, "<think>\nsame\n</think>\n\nYes" + END],
    ]


def test_prepare_masks_an_earlier_answer_that_begins_as_the_generation_prompt_goes_on(tmp_path):
    """A generation prompt that opens the reasoning (QwQ: "<|im_start|>assistant\n<think>\n") and an earlier answer
    that begins with "<" too: the answer is found where its turn parts from that prompt, not one character in."""
    qwq_style = QWEN3_STYLE.replace("{{- '<|im_start|>assistant\n' -}}{%- endif -%}",
                                    "{{- '<|im_start|>assistant\n<think>\n' -}}{%- endif -%}")
    assert qwq_style != QWEN3_STYLE
    rows = [[user("Some HTML?"), bot("<think>\nbold\n</think>\n\n<b>hi</b>"), user("More, <b>hi</b>?"),
             bot("<think>\nitalic\n</think>\n\n<i>ok</i>")]]
    # the last turn as the incremental path sees it: after the prompt's "<think>\n"
    assert prepared_runs(tmp_path, qwq_style, rows) == [["<b>hi</b>" + END, "italic\n</think>\n\n<i>ok</i>" + END]]


# A Kimi-K2.5-style template (its shape, written here): the generation prompt opens the reasoning ("<think>"), an
# assistant turn after the last user message shows its `reasoning_content` in the think block, an earlier one an empty
# block before its answer; the template never looks for </think> in `content`.
KIMI_STYLE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'assistant' -%}{{- '<|im_assistant|>assistant<|im_middle|>' -}}"
    "{%- if loop.index0 > ns.last_user -%}{{- '<think>' + (m.get('reasoning_content') or '') + '</think>' -}}"
    "{%- else -%}{{- '<think></think>' -}}{%- endif -%}"
    "{{- m['content'] + '<|im_end|>' -}}"
    "{%- else -%}{{- '<|im_' + m['role'] + '|>' + m['role'] + '<|im_middle|>' + m['content'] + '<|im_end|>' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_assistant|>assistant<|im_middle|><think>' -}}{%- endif -%}"
)


def kimi_style_tokenizer(out):
    tok = tiny_model.build_tokenizer(512)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_user|>", "<|im_assistant|>", "<|im_system|>",
                                                         "<|im_middle|>", "<|im_end|>"]})
    tok.eos_token = "<|im_end|>"
    tok.chat_template = KIMI_STYLE
    tok.save_pretrained(out)
    return tok


def regenerated_rows(tok, turns, generated):
    """regenerate's answering of one conversation of user `turns` (data/answering.py, the step's own code) with a
    stand-in engine that generates `generated` in turn: (the rows it writes, the chats it sent)."""
    from kimi_eagle_host.data.answering import answer_in_rounds
    from kimi_eagle_host.data.prompts import Conversation, TokenBudget
    from kimi_eagle_host.pipeline.regenerate import conversation_row

    sent = []

    def engine(chats, seed):
        sent.extend(chats)
        return [(generated[len(sent) - 1], 8) for _ in chats]

    conv = Conversation(id="c0", line=1, user_turns=turns, first_tokens=8)
    answers, _ = answer_in_rounds(engine, [conv], TokenBudget(tok, 4096, 64), 0, 0)
    return [conversation_row(conv, answers[0])], sent


def test_a_thinking_targets_regenerated_answers_train_on_what_it_generates_when_served(tmp_path):
    """Kimi-K2.5's template opens the reasoning in its generation prompt, so the target generates
    `reasoning</think>answer`; kept whole as `content`, its template rendered the last turn as
    `<think></think>reasoning</think>answer` (hidden states extracted on a text the target never sees: nothing fails,
    acceptance drops) and an earlier turn as history no client sends. regenerate keeps the reasoning apart
    (reasoning_content), so the prepared sample is, token for token, the prompt of the last turn as served followed by
    what the target generated; the earlier turn is sent back, and trained on, as its answer alone. An answer cut inside
    its reasoning is history without an answer, and prepare still takes the row."""
    tok = kimi_style_tokenizer(tmp_path / "tok")
    rows, sent = regenerated_rows(tok, ["First?", "Second?"], [" plan one</think>Answer one.",
                                                               " plan two</think>Answer two."])
    assert sent[1][1] == {"role": "assistant", "content": "Answer one.", "reasoning_content": " plan one"}
    assert tok.apply_chat_template(sent[1], tokenize=False).endswith(
        "<|im_assistant|>assistant<|im_middle|><think></think>Answer one.<|im_end|><|im_user|>user<|im_middle|>Second?"
        "<|im_end|>")   # the history a client sends back
    served = tok.apply_chat_template(sent[1], tokenize=False, add_generation_prompt=True) + \
        " plan two</think>Answer two." + "<|im_end|>"
    cut, _ = regenerated_rows(tok, ["First?", "Second?"], [" a plan cut short", " plan two</think>Answer two."])
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows + cut), encoding="utf-8")
    code, out, err = run("prepare", "--model", tmp_path / "tok", "--dataset", data, "--output-dir", tmp_path / "o")
    assert code == 0 and out["count"] == 2, err
    ds = PreparedDataset(str(tmp_path / "o" / "prepared"))
    ids, mask = ds[0]
    assert tok.decode(ids) == served
    assert masked_runs(tok, ids, mask) == ["Answer one.<|im_end|>", " plan two</think>Answer two.<|im_end|>"]
    ids, mask = ds[1]
    assert "<|im_middle|><think></think><|im_end|>" in tok.decode(ids)
    assert masked_runs(tok, ids, mask) == [" plan two</think>Answer two.<|im_end|>"]


def test_think_markers_a_tokenizer_marks_special_are_kept_in_the_answer(tmp_path):
    """Engines decode an answer as served clients read it, special tokens skipped: a tokenizer that marks `<think>`
    and `</think>` special lost them, and `reasoning</think>answer` came back as `reasoninganswer`: stored as all
    reasoning with an empty answer (nothing failed). The answer's tokens give its markers back: eval sends the
    target's earlier answer back split, as regenerate stores it."""
    from kimi_eagle_host.data.prompts import Conversation, TokenBudget
    from kimi_eagle_host.data.reasoning import AnswerText
    from kimi_eagle_host.pipeline.eval import turn_prompts

    tok = kimi_style_tokenizer(tmp_path / "tok")
    as_text = tok.encode(" plan</think>Answer.", add_special_tokens=False)
    assert AnswerText(tok)("engine text", as_text) == "engine text"   # markers kept as text: the engine's own
    tok.add_tokens(["<think>", "</think>"], special_tokens=True)
    ids = tok.encode(" plan</think>Answer.<|im_end|>", add_special_tokens=False)
    served = tok.decode(ids, skip_special_tokens=True)
    assert "</think>" not in served   # what an engine's text says
    conv = Conversation(id="c0", line=1, user_turns=["First?", "Second?"], first_tokens=8)
    chats, _ = turn_prompts([conv], TokenBudget(tok, 4096, 64), [[[served, ids]]], 1)
    assert chats[0][1][1] == {"role": "assistant", "content": "Answer.", "reasoning_content": " plan"}


def test_a_template_that_does_not_render_reasoning_keeps_the_answer_whole(tmp_path):
    """A template that never shows `reasoning_content` (this Qwen3-style one reads the reasoning from `content`, as
    DeepSeek-R1's does) gets the generated text whole, as before; so does a target that does not think."""
    from kimi_eagle_host.data.prompts import TokenBudget

    qwen = qwen3_style_tokenizer(tmp_path / "qwen")
    rows, _ = regenerated_rows(qwen, ["Hi?"], ["<think>\nhm\n</think>\n\nHello."])
    assert rows[0]["messages"][-1] == {"role": "assistant", "content": "<think>\nhm\n</think>\n\nHello."}
    kimi = kimi_style_tokenizer(tmp_path / "kimi")
    budget = TokenBudget(kimi, 4096, 64)
    assert budget.opens_reasoning and budget.splits_reasoning
    assert budget.reply("No reasoning here.") == {"role": "assistant", "content": "", "reasoning_content":
                                                  "No reasoning here."}   # the prompt opened it: all reasoning
    assert not TokenBudget(qwen, 4096, 64).splits_reasoning


BAD_ROWS = [
    ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt"}]}', "conversations[1]: missing field 'value'"),
    ('{"messages": [{"role": "user", "content": "hi"}', "invalid JSON"),
    ('{"messages": [{"role": "robot", "content": "hi"}]}', "messages[0].role: 'robot' is not supported"),
    ('{"messages": [{"role": "user", "content": "only a question"}]}', "no assistant turn"),
    ('{"messages": [{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]}',
     "messages[0].content: expected a string, got int"),
    ('["not", "an", "object"]', "expected an object"),
    ('{"text": "plain"}', "neither 'conversations'"),
]


def test_prepare_loads_the_tokenizer_autotokenizer_builds_without_importing_torch(models, tmp_path):
    """prepare needs a tokenizer and nothing of torch, yet importing AutoTokenizer imports torch (~6 of a small
    prepare's ~8 CPU-seconds). Where the tokenizer's config names transformers' generic tokenizer.json backend (as
    these models' and SmolLM2's do) prepare loads that class itself: the same tokenizer AutoTokenizer builds, the
    same text and ids. Remote code (Kimi-K2.5's tiktoken tokenizer) still goes through AutoTokenizer."""
    from transformers import AutoTokenizer

    from kimi_eagle_host.target.tokenizer import generic_tokenizer_class, load_tokenizer

    v4_name = tmp_path / "v4-name"   # the same files, the class under its transformers 4 name
    remote = tmp_path / "remote"
    for folder, change in ((v4_name, {"tokenizer_class": "PreTrainedTokenizerFast"}),
                           (remote, {"auto_map": {"AutoTokenizer": ["tokenization_x.XTokenizer", None]}})):
        shutil.copytree(models["llama"], folder)
        config = folder / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), **change}))
    assert generic_tokenizer_class(str(remote)) is None and generic_tokenizer_class("org/hub-name") is None
    conversation = [{"role": "user", "content": "Grüß dich, 日本"}, {"role": "assistant", "content": "Hallo!"}]
    for folder in (models["llama"], models["kimi"], str(v4_name)):
        ours, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
        assert type(ours) is type(auto) and len(ours) == len(auto) and ours.eos_token == auto.eos_token
        text = ours.apply_chat_template(conversation, tokenize=False)
        assert text == auto.apply_chat_template(conversation, tokenize=False)
        assert dict(ours(text, add_special_tokens=False, return_offsets_mapping=True)) == \
            dict(auto(text, add_special_tokens=False, return_offsets_mapping=True))
    # the step itself, as a host runs it: torch is never imported
    step = subprocess.run([sys.executable, "-X", "importtime", *host_cmd("pipeline.prepare")[1:], "--model",
                           models["llama"], "--dataset", SAMPLE, "--output-dir", tmp_path / "out", "--seq-len", "64",
                           "--max-samples", "4"], capture_output=True, text=True, env=ENV, timeout=300)
    assert step.returncode == 0, step.stderr[-2000:]
    assert json.loads(step.stdout)["count"] == 4
    imported = {line.rsplit("|", 1)[-1].strip() for line in step.stderr.splitlines() if line.startswith("import time:")}
    assert "transformers" in imported and "torch" not in imported


@pytest.mark.parametrize("bad,why", BAD_ROWS[:1])
def test_prepare_bad_row_fails_with_file_and_line(models, tmp_path, bad, why):
    good = open(SAMPLE, encoding="utf-8").read().splitlines()[:4]
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(good[:2] + [bad] + good[2:]) + "\n", encoding="utf-8")
    code, out, err = run("prepare", "--model", models["llama"], "--dataset", data, "--output-dir", tmp_path / "o")
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert f"{data}:3: " in line and why in line
    assert not (tmp_path / "o").exists()  # nothing changed


def test_prepare_bad_rows_messages_and_skip(models, tmp_path):
    from kimi_eagle_host.pipeline import prepare

    for bad, why in BAD_ROWS:  # every kind of malformed row, checked in-process (fast)
        with pytest.raises(prepare.BadRow, match=None) as e:
            try:
                row = json.loads(bad)
            except ValueError as ex:
                raise prepare.BadRow(f"invalid JSON ({ex})")
            prepare.normalize_row(row)
        assert why in str(e.value), (bad, str(e.value))
    good = open(SAMPLE, encoding="utf-8").read().splitlines()[:5]
    data = tmp_path / "mixed.jsonl"
    data.write_text("\n".join([good[0], BAD_ROWS[0][0], "", good[1], BAD_ROWS[2][0]] + good[2:]) + "\n",
                    encoding="utf-8")
    code, out, err = run("prepare", "--model", models["llama"], "--dataset", data, "--output-dir", tmp_path / "o",
                         "--on-bad-row", "skip")
    assert code == 0, err
    assert out["count"] == 5 and out["skipped_bad_rows"] == 2
    man = json.load(open(tmp_path / "o" / "prepared" / "manifest.json"))
    assert [b["line"] for b in man["bad_rows"]] == [2, 5]
    assert PreparedDataset(str(tmp_path / "o" / "prepared")).lines == [1, 4, 6, 7, 8]


def test_a_prepare_that_fails_after_rewriting_the_shards_leaves_no_manifest(models, tmp_path):
    """The manifest is the prepared data's identity: a prepare that stops between the new shards and the new
    manifest (here token_freq.npy cannot be written) must not leave the old one describing the new shards, or
    extract would continue, and vocab would count, the old data as if it were the new."""
    lines = open(SAMPLE, encoding="utf-8").read().splitlines()
    first, second = tmp_path / "first.jsonl", tmp_path / "second.jsonl"
    first.write_text("\n".join(lines[:12]) + "\n", encoding="utf-8")
    second.write_text("\n".join(lines[12:24]) + "\n", encoding="utf-8")
    common = ("--model", models["llama"], "--output-dir", tmp_path / "o", "--seq-len", str(SEQ_LEN))
    code, _, err = run("prepare", "--dataset", first, *common)
    assert code == 0, err
    prepared = tmp_path / "o" / "prepared"
    (prepared / "token_freq.npy").unlink()
    (prepared / "token_freq.npy").mkdir()   # what is written after the shards now fails
    code, _, err = run("prepare", "--dataset", second, *common)
    assert code != 0
    assert not (prepared / "manifest.json").exists()
    code, _, err = run("vocab", "--model", models["llama"], "--output-dir", tmp_path / "o", "--draft-vocab-size", "64")
    assert code == 2 and "prepare" in err.splitlines()[-1], err


def test_prepare_in_several_processes_writes_what_one_writes(models, tmp_path):
    """--workers N tokenizes in N processes: the same shards, byte for byte, as one process, --max-samples too."""
    lines = open(SAMPLE, encoding="utf-8").read().splitlines()
    data = tmp_path / "many.jsonl"   # more rows than one worker's block (256), so several workers get some
    data.write_text("\n".join(lines * (600 // len(lines) + 1)) + "\n", encoding="utf-8")
    digests = {}
    for workers, limit in (("1", "0"), ("3", "0"), ("1", "400"), ("3", "400")):
        out = tmp_path / f"w{workers}_{limit}"
        code, res, err = run("prepare", "--model", models["llama"], "--dataset", data, "--output-dir", out,
                             "--seq-len", str(SEQ_LEN), "--workers", workers, "--max-samples", limit)
        assert code == 0, err
        assert ("tokenizing in 3 processes" in err) == (workers == "3")
        man = json.load(open(out / "prepared" / "manifest.json"))
        digests[workers, limit] = ([s["sha256"] for s in man["shards"]], man["token_freq_sha256"], res["count"])
    assert digests["1", "0"] == digests["3", "0"] and digests["1", "0"][2] >= 600
    assert digests["1", "400"] == digests["3", "400"] and digests["1", "400"][2] == 400


def test_a_row_the_template_refuses_in_a_worker_is_reported_as_in_one_process(models, tmp_path):
    """A template that raises on some rows (here: those saying REFUSE-ME): with skip, several processes record the
    same rows as one; with fail, the same first FILE:LINE, and nothing written."""
    model = tmp_path / "model"
    shutil.copytree(models["llama"], model)
    jinja = model / "chat_template.jinja"
    jinja.write_text("{%- for m in messages -%}{%- if 'REFUSE-ME' in m['content'] -%}{{ raise_exception('refused') }}"
                     "{%- endif -%}{%- endfor -%}" + jinja.read_text())
    lines = open(SAMPLE, encoding="utf-8").read().splitlines()
    refused = json.dumps({"messages": [{"role": "user", "content": "REFUSE-ME"}, {"role": "assistant", "content": "no"}]})
    rows = [refused if i in (300, 500) else lines[i % len(lines)] for i in range(600)]
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(rows) + "\n", encoding="utf-8")
    for mode in ("skip", "fail"):
        seen = {}
        for workers in ("1", "3"):
            out = tmp_path / f"{mode}{workers}"
            code, res, err = run("prepare", "--model", model, "--dataset", data, "--output-dir", out,
                                 "--seq-len", str(SEQ_LEN), "--workers", workers, "--on-bad-row", mode)
            if mode == "skip":
                assert code == 0, err
                seen[workers] = json.load(open(out / "prepared" / "manifest.json"))["bad_rows"]
            else:
                assert code == 2 and f"{data}:301: chat template failed" in err.strip().splitlines()[-1], err
                assert not out.exists()
        if mode == "skip":
            assert seen["1"] == seen["3"] and [b["line"] for b in seen["1"]] == [301, 501]


# ----------------------------------------------------------------------------------------------------
# extract

@pytest.mark.parametrize("kind", KINDS)
def test_extract_matches_reference_forward(models, pipeline, kind):
    root = pipeline[kind]["root"]
    hs_dir = os.path.join(root, "hidden_states")
    ds = PreparedDataset(os.path.join(root, "prepared"))
    ids_expected = [2, N_LAYERS // 2, N_LAYERS - 3, N_LAYERS]
    dc = json.load(open(os.path.join(hs_dir, "data_config.json")))
    assert dc["layer_ids"] == ids_expected and dc["num_layers"] == N_LAYERS and dc["hidden_size"] == 64
    assert dc["dtype"] == "float32" and dc["engine"] == "hf" and "input of decoder layer i" in dc["layer_convention"]
    assert dc["versions"]["transformers"] and dc["decoder_path"].endswith("layers")
    # sharding (llama runs as 2 ranks): the ranks together wrote every sample exactly once, nothing else
    ranks = pipeline[kind]["ranks"]
    assert [r["range"] for r in ranks] == [[N_SAMPLES * k // len(ranks), N_SAMPLES * (k + 1) // len(ranks)]
                                           for k in range(len(ranks))]
    assert sum(r["written"] for r in ranks) == N_SAMPLES
    samples = [f"hs_{i}.safetensors" for i in range(N_SAMPLES)]
    shards = [f"manifest.shard-{lo}-{hi}.json" for lo, hi in (r["range"] for r in ranks)]
    assert sorted(n for n in os.listdir(hs_dir) if not n.startswith(".")) == sorted(
        ["data_config.json", "manifest.json"] + shards + samples)
    manifest = json.load(open(os.path.join(hs_dir, "manifest.json")))
    assert manifest["samples"] == samples and manifest["shards"] == sorted(shards)

    model = load_target(models[kind])
    owner, layers, _ = model_layers.resolve_decoder_stack(model)
    # every sample is checked against an unbatched, hook-free reference forward
    for i in range(N_SAMPLES):
        t = load_hs(os.path.join(hs_dir, f"hs_{i}.safetensors"))
        ids, mask = ds[i]
        assert t["token_ids"].dtype == torch.int64 and t["token_ids"].tolist() == ids.tolist()
        assert t["loss_mask"].tolist() == mask.tolist()
        hs = t["hidden_states"]
        assert hs.shape == (len(ids), 4, 64) and hs.dtype == torch.float32
        with torch.no_grad():
            ref = model(input_ids=torch.from_numpy(ids)[None], output_hidden_states=True).hidden_states
        assert len(ref) == N_LAYERS + 1
        for k, lid in enumerate(ids_expected[:-1]):  # id i < N ↔ hidden_states[i] = input of layer i
            torch.testing.assert_close(hs[:, k], ref[lid][0], rtol=1e-4, atol=1e-5)
        # id N = last layer output BEFORE the final norm: transformers' last entry is post-norm
        last = hs[:, -1]
        with torch.no_grad():
            torch.testing.assert_close(owner.norm(last), ref[N_LAYERS][0], rtol=1e-4, atol=1e-5)
        assert not torch.allclose(last, ref[N_LAYERS][0], atol=1e-3)

    code, out, err = run("extract", "--validate", "--output-dir", root)
    assert code == 0 and out["ok"] and out["checked"] == N_SAMPLES and out["bad_count"] == 0, err


@pytest.mark.parametrize("kind", ["llama", "kimi"])
def test_capture_early_stop_equals_full_forward(models, kind):
    """Stopping the forward right after the last needed layer changes nothing (ids without N, with id 0)."""
    model = load_target(models[kind])
    _, layers, _ = model_layers.resolve_decoder_stack(model)
    ids = torch.tensor([[1, 5, 40, 41, 42, 2, 6, 50, 51]])
    attn = torch.ones_like(ids)
    with torch.no_grad():
        ref = model(input_ids=ids, output_hidden_states=True).hidden_states
    hooks_before = [len(layer._forward_pre_hooks) + len(layer._forward_hooks) for layer in layers]
    for layer_ids in ([0, 3, 5], [1, 7, 8]):
        outs = []
        for early in (True, False):
            cap = hf_target.HiddenStateCapture(layers, layer_ids, early_stop=early)
            with torch.inference_mode():
                outs.append(cap.run(model, input_ids=ids, attention_mask=attn, use_cache=False))
            cap.remove()
        assert torch.equal(outs[0], outs[1])
        for k, lid in enumerate(layer_ids):
            if lid < N_LAYERS:
                torch.testing.assert_close(outs[0][0, :, k], ref[lid][0])
    assert [len(layer._forward_pre_hooks) + len(layer._forward_hooks) for layer in layers] == hooks_before


def test_shard_ranges_cover_every_index_once():
    for n in range(0, 40):
        for ws in range(1, 9):
            seen = []
            for r in range(ws):
                lo, hi = extract.shard_range(n, r, ws)
                assert lo <= hi
                seen += range(lo, hi)
            assert seen == list(range(n))


def test_extract_resume_after_kill_matches_uninterrupted_run(models, pipeline, tmp_path):
    """kill -9 mid-extract, corrupt one finished file, rerun: identical files to an uninterrupted run."""
    prepared = os.path.join(pipeline["llama"]["root"], "prepared")
    common = ["--model", models["llama"], "--prepared-dir", prepared, "--batch-size", 1, "--seq-len", SEQ_LEN]
    ref_dir, dut_dir = tmp_path / "ref", tmp_path / "dut"
    ref = popen("extract", *common, "--out", ref_dir)  # runs concurrently with the killed one
    slow = popen("extract", *common, "--out", dut_dir, env={**ENV, extract_hf.SLOW_ENV: "0.4"})
    deadline = time.time() + 120
    while time.time() < deadline:
        done = [n for n in os.listdir(dut_dir) if n.startswith("hs_")] if dut_dir.exists() else []
        if len(done) >= 4:
            break
        assert slow.poll() is None, slow.communicate()[1]
        time.sleep(0.05)
    os.kill(slow.pid, signal.SIGKILL)
    slow.communicate()
    done = sorted(n for n in os.listdir(dut_dir) if n.startswith("hs_"))
    assert 4 <= len(done) < N_SAMPLES
    # a torn file (e.g. from a copy) must be detected and redone, a stale temp file removed
    victim = dut_dir / done[0]
    victim.write_bytes(victim.read_bytes()[:100])
    (dut_dir / ".hs_9999.safetensors.tmp-1").write_bytes(b"junk")  # outside any range: left alone
    (dut_dir / f".hs_{N_SAMPLES - 1}.safetensors.tmp-1").write_bytes(b"junk")

    code, out, err = run("extract", *common, "--out", dut_dir)
    assert code == 0, err
    assert out["skipped_existing"] == len(done) - 1 and out["written"] == N_SAMPLES - len(done) + 1
    stdout, stderr = ref.communicate(timeout=300)
    assert ref.returncode == 0, stderr
    (dut_dir / ".hs_9999.safetensors.tmp-1").unlink()
    names = sorted(os.listdir(ref_dir))
    assert names == sorted(os.listdir(dut_dir))
    for name in names:
        if name.startswith("hs_"):
            assert (ref_dir / name).read_bytes() == (dut_dir / name).read_bytes(), name
    assert json.load(open(ref_dir / "data_config.json")) == json.load(open(dut_dir / "data_config.json"))


def test_extract_rejects_bad_layer_ids(models, pipeline, tmp_path):
    root = pipeline["llama"]["root"]
    code, out, err = run("extract", "--model", models["llama"], "--output-dir", root, "--layer-ids", "2,4,99")
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert "layer id 99 is out of range 0..8" in line and not out["ok"]
    # (other layer ids than the folder's start it clean: tests/test_data_manifest.py)


def test_resume_knows_the_same_model_by_any_path_and_upgrades_older_records(models, pipeline, tmp_path):
    """The demo's second run (and any resume after an upgrade) must not be refused: a model recorded as a
    path relative to the job's folder is the same folder given absolutely, and a record written before the
    model was recorded says nothing about it. A different folder starts clean, and says so."""
    root = tmp_path / "run"
    shutil.copytree(pipeline["llama"]["root"], root)
    cfg_path = root / "hidden_states" / "data_config.json"
    cfg = json.loads(cfg_path.read_text())
    args = ("--model", models["llama"], "--output-dir", root, "--seq-len", SEQ_LEN)
    for recorded in (os.path.relpath(models["llama"]), None):
        cfg_path.write_text(json.dumps({k: v for k, v in {**cfg, "model": recorded}.items() if v is not None}))
        code, out, err = run("extract", *args)
        assert code == 0 and out["ok"] and out["written"] == 0 and "continuing the extraction" in err, err
    cfg_path.write_text(json.dumps({**cfg, "model": str(tmp_path)}))
    code, out, err = run("extract", *args)
    assert code == 0 and out["written"] == N_SAMPLES and f"starting clean in {root / 'hidden_states'}" in err
    assert f"removed {N_SAMPLES} samples" in err and f"model {str(tmp_path)!r} ->" in err


def test_resume_refuses_the_features_of_a_target_rebuilt_in_place(models, pipeline, tmp_path):
    """Samples of the old weights must not be counted as done for other weights in the same folder (a model
    rebuilt or trained in place): the folder starts clean, and says why. The same weights with a new mtime (a
    download again, a copy without -p) are the same target and resume."""
    model = tmp_path / "target"
    shutil.copytree(models["llama"], model)
    out_dir = tmp_path / "hs"
    args = ("--model", model, "--prepared-dir", os.path.join(pipeline["llama"]["root"], "prepared"),
            "--out", out_dir, "--seq-len", SEQ_LEN)
    code, out, err = run("extract", *args)
    assert code == 0 and out["written"] == N_SAMPLES, err
    touch_weights(model)
    code, out, err = run("extract", *args)
    assert code == 0 and out["skipped_existing"] == N_SAMPLES and out["written"] == 0, err

    tiny_model.build(str(model), kind="llama", layers=N_LAYERS, seed=1)
    code, out, err = run("extract", *args)
    assert code == 0 and out["written"] == N_SAMPLES and out["skipped_existing"] == 0, err
    assert re.search(rf"starting clean in .*: removed {N_SAMPLES} samples .*weights_fingerprint", err), err


def test_validate_reports_bad_samples(pipeline, tmp_path):
    from safetensors.torch import save_file

    root = pipeline["llama"]["root"]
    out_dir = tmp_path / "hs"
    shutil.copytree(os.path.join(root, "hidden_states"), out_dir)
    t = load_hs(str(out_dir / "hs_3.safetensors"))
    t["hidden_states"][0, 0, 0] = float("nan")
    save_file(t, str(out_dir / "hs_3.safetensors"))
    t = load_hs(str(out_dir / "hs_5.safetensors"))
    t["token_ids"][0] += 1
    save_file(t, str(out_dir / "hs_5.safetensors"))
    os.unlink(out_dir / "hs_7.safetensors")
    t = load_hs(str(out_dir / "hs_4.safetensors"))   # two positions of one layer never captured
    t["hidden_states"][1:3, 2] = 0
    save_file(t, str(out_dir / "hs_4.safetensors"))
    code, out, err = run("extract", "--validate", "--prepared-dir", os.path.join(root, "prepared"), "--out", out_dir)
    assert code == 1 and not out["ok"]
    n = t["hidden_states"].shape[0]
    assert {b["index"]: b["error"] for b in out["bad"]} == {
        3: "hidden_states contain NaN/Inf", 5: "token_ids do not match the prepared sample", 7: "missing",
        4: f"hidden_states: 2 of {n} positions are all zeros at layer slot(s) [2] (never captured)"}


# ----------------------------------------------------------------------------------------------------
# vllm backend: layer-id translation and refusal

def test_speculators_layer_id_translation():
    t = extract_vllm.to_speculators_layer_ids
    assert t([2, 30, 58, 61], 61, "0.3.0") == [1, 29, 57, 60]
    assert t([2, 4, 5, 8], 8, "0.4.0") == [1, 3, 4, 7]
    assert t([0, 2, 8], 8, "0.5.0") == [0, 2, 8]  # >= 0.5 uses vLLM's convention = ours
    with pytest.raises(model_layers.LayerIdError, match="layer id 0"):
        t([0, 4], 8, "0.3.0")
    with pytest.raises(model_layers.LayerIdError, match="out of range 0..8"):
        t([9], 8, "0.4.0")


@pytest.fixture(scope="module")
def spec_site(tmp_path_factory):
    """A throwaway site dir where the real speculators 0.3.0 wheel is installed, unpatched."""
    from fixtures_speculators import _wheel

    site = tmp_path_factory.mktemp("site")
    wheel = _wheel("0.3.0", tmp_path_factory.mktemp("wheels"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)],
                   check=True, capture_output=True)
    return site


def test_vllm_backend_refuses_unpatched_and_missing(models, pipeline, spec_site, monkeypatch):
    root = pipeline["llama"]["root"]
    args = ["--model", models["llama"], "--output-dir", root, "--backend", "vllm"]
    code, out, err = run("extract", *args, env={**ENV, "PYTHONPATH": str(spec_site)})
    assert code == 1 and "speculators 0.3.0" in err and "is not patched" in err and extract_vllm.KIMI_EAGLE_PATCH_MARKER in err
    from importlib import metadata

    try:
        metadata.distribution("speculators")
        installed_here = True
    except metadata.PackageNotFoundError:
        installed_here = False
    if not installed_here:
        code, out, err = run("extract", *args)
        assert code == 1 and "speculators is not installed" in err

    # the marker anywhere in speculators' files counts as patched (checked in-process via importlib.metadata)
    monkeypatch.syspath_prepend(str(spec_site))
    with pytest.raises(extract_vllm.Refused, match="not patched"):
        extract_vllm.check_speculators_patch()
    target = spec_site / "speculators" / "data_generation" / "vllm_hidden_states_generator.py"
    original = target.read_text()
    try:
        target.write_text(original + f"\n# {extract_vllm.KIMI_EAGLE_PATCH_MARKER}: test\n")
        version, location = extract_vllm.check_speculators_patch()
        assert version == "0.3.0" and os.path.samefile(location, spec_site)
    finally:
        target.write_text(original)


# ----------------------------------------------------------------------------------------------------
# vocab

def test_vocab_selection_round_trip_and_ties():
    freq = np.array([5, 0, 9, 5, 5, 1, 9, 0], dtype=np.int64)
    d2t, t2d = vocab.select_draft_vocab(freq, 4)
    # top-4: ids 2 and 6 (9), then the 5s with the smallest ids: 0 and 3
    assert d2t.dtype == np.int64 and t2d.dtype == np.bool_
    assert vocab.draft_to_target(d2t).tolist() == [0, 2, 3, 6]
    assert d2t.tolist() == [0, 1, 1, 3]
    assert t2d.tolist() == [True, False, True, True, False, False, True, False]
    rng = np.random.default_rng(0)
    for _ in range(20):
        f = rng.integers(0, 4, size=50)
        k = int(rng.integers(1, 51))
        d2t, t2d = vocab.select_draft_vocab(f, k)
        tgt = vocab.draft_to_target(d2t)
        assert len(d2t) == k and t2d.sum() == k and t2d[tgt].all()
        assert (np.diff(tgt) > 0).all()  # draft ids ordered by target id
        assert np.flatnonzero(t2d).tolist() == tgt.tolist()
        assert f[t2d].min() >= f[~t2d].max(initial=0)  # nothing left out is more frequent
    with pytest.raises(vocab.BadInput, match="must be in 1..8"):
        vocab.select_draft_vocab(freq, 9)


def test_vocab_step(models, pipeline, tmp_path):
    root = pipeline["kimi"]["root"]
    code, out, err = run("vocab", "--model", models["kimi"], "--output-dir", root, "--draft-vocab-size", 100)
    assert code == 0, err
    d2t = np.load(os.path.join(root, "vocab", "d2t.npy"))
    t2d = np.load(os.path.join(root, "vocab", "t2d.npy"))
    freq = np.load(os.path.join(root, "prepared", "token_freq.npy"))
    assert d2t.shape == (100,) and d2t.dtype == np.int64 and t2d.shape == (512,) and t2d.dtype == np.bool_
    tgt = np.arange(100) + d2t
    assert t2d[tgt].all() and t2d.sum() == 100
    assert freq[t2d].min() >= freq[~t2d].max()
    assert out["target_vocab_size"] == 512 and 0 < out["coverage"] <= 1

    code, out, err = run("vocab", "--model", models["kimi"], "--output-dir", root, "--draft-vocab-size", 513)
    assert code == 2 and "--draft-vocab-size 513 must be in 1..512" in err
    code, out, err = run("vocab", "--output-dir", tmp_path, "--draft-vocab-size", 10)
    assert code == 2 and os.path.join(str(tmp_path), "prepared", "token_freq.npy") in err and "not found" in err
