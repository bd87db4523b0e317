#!/usr/bin/env python3
"""Build small (or benchmark-sized) target models with random weights, entirely offline.

Kinds:
  kimi   DeepseekV3 text model (MLA + MoE) inside a Kimi-K2.5 multimodal wrapper laid out like the Hub checkpoint,
         with remote code, so it loads only with trust_remote_code=True, in transformers and in vLLM (kimi_model.py
         says what that takes). Layers live at language_model.model.layers. `--preset k2.5` gives Kimi-K2.5's real
         widths (hidden 7168, vocab 163,840, its MLA dims and 64 heads; dense layer 0, MoE after) with --layers
         layers and 8 routed experts: about 4.4 B parameters at 4 layers; draw those on a GPU (--device cuda).
  llama  plain LlamaForCausalLM (use --hidden/--layers/--vocab/--dtype bf16 for a ~1B benchmark model).
  llava  LlavaForConditionalGeneration (tiny Llama text + tiny CLIP vision tower), used as a text-only
         target. It loads with AutoModelForImageTextToText (transformers has no CausalLM mapping for llava).

The tokenizer is a byte-level BPE trained on the sample chat data (or --corpus), padded with filler tokens
to exactly the model's vocab size, with a Jinja chat template that marks roles and ends every turn with
<|end|> (the eos token). Everything is seeded: the same arguments give byte-identical weights.

Output (stdout): one JSON summary. Progress: stderr. Exit 2 on bad arguments.
"""
import argparse
import json
import os
import sys

from kimi_eagle_host.step_runtime import log, package_dir

from kimi_eagle_host.target import kimi_model  # (no heavy imports at module level)

DEFAULT_CORPUS = os.path.join(package_dir(), "sample_data", "chat.jsonl")

SPECIAL_TOKENS = ["<|pad|>", "<|bos|>", "<|end|>", "<|unk|>", "<|system|>", "<|user|>", "<|assistant|>", "<image>"]

# Roles are marked with tags; every message ends with <|end|>. The assistant body is wrapped in
# {% generation %} so HF's assistant masks also work, but prepare.py does not rely on it.
# The separator newline is emitted *before* a role tag, so rendering messages[:k] + generation prompt is
# an exact prefix of rendering messages[:k+1] (prepare.py uses that to find assistant spans).
CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- for m in messages -%}"
    "{%- if not loop.first -%}{{ '\\n' }}{%- endif -%}"
    "{{- '<|' + m['role'] + '|>\\n' -}}"
    "{%- if m['role'] == 'assistant' -%}"
    "{% generation %}{{- m['content'] + '<|end|>' -}}{% endgeneration %}"
    "{%- else -%}{{- m['content'] + '<|end|>' -}}{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{%- if messages -%}{{ '\\n' }}{%- endif -%}{{- '<|assistant|>\\n' -}}"
    "{%- endif -%}"
)

# ----------------------------------------------------------------------------------------------------
# tokenizer

def _corpus_texts(path):
    """All strings found in a chat JSONL (both ShareGPT and OpenAI shapes); tolerant of junk lines."""
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            for turn in (row.get("conversations") or row.get("messages") or []) if isinstance(row, dict) else []:
                if isinstance(turn, dict):
                    v = turn.get("value", turn.get("content"))
                    if isinstance(v, str):
                        texts.append(v)
    return texts


def build_tokenizer(vocab_size, corpus=DEFAULT_CORPUS):
    """Byte-level BPE (no <unk> ever needed) trained on the corpus, padded to exactly vocab_size ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=max(vocab_size, len(SPECIAL_TOKENS) + 256), special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(corpus), trainer=trainer)
    n = tok.get_vocab_size()
    if n > vocab_size:
        raise ValueError(f"--vocab {vocab_size} is too small: the byte-level tokenizer needs at least {n} ids")
    if n < vocab_size:
        # A tiny corpus cannot produce vocab_size merges; add filler entries to the BPE vocab (never produced
        # by a merge, harmless) so tokenizer ids cover exactly the model's embedding rows.
        spec = json.loads(tok.to_str())
        vocab = spec["model"]["vocab"]
        for i in range(n, vocab_size):
            vocab[f"<|filler_{i}|>"] = i
        tok = Tokenizer.from_str(json.dumps(spec))
    assert tok.get_vocab_size() == vocab_size
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|end|>", pad_token="<|pad|>",
        unk_token="<|unk|>", additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>", "<image>"],
        model_max_length=1 << 20,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


# ----------------------------------------------------------------------------------------------------
# weights

def _seeded_init(model, seed):
    """Deterministic init independent of transformers' own init code (which changes between versions)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
            elif "norm" in name or "layernorm" in name:
                # near 1, but not exactly, so a test can tell normed from un-normed states
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)


def _text_kwargs(hidden, layers, vocab, heads, intermediate, tok):
    if not heads:
        heads = hidden // 64 if hidden >= 256 else 4  # head_dim 64 for real sizes, 4 heads for toys
    return dict(
        vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        intermediate_size=intermediate or (hidden * 8 // 3 + 63) // 64 * 64,
        max_position_embeddings=4096, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id, tie_word_embeddings=False,
    )


def _hub_layout_llava(out_dir):
    """Make the Llava folder look like a real Hub checkpoint, as vLLM loads those: the processor files (vLLM builds
    the multimodal processor even for text-only prompts) and text_config.architectures. The weight names are the
    ones the installed transformers writes: transformers 4 writes the Hub layout (language_model.model.*,
    vision_tower.vision_model.*) that vLLM 0.16 expects. The processor files are written as JSON, the way
    transformers saves a CLIPImageProcessor + LlavaProcessor, so no torchvision/PIL is needed to build them."""
    files = {
        "preprocessor_config.json": {
            "crop_size": {"height": 28, "width": 28}, "do_center_crop": True, "do_convert_rgb": True,
            "do_normalize": True, "do_rescale": True, "do_resize": True,
            "image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711],
            "image_processor_type": "CLIPImageProcessor", "processor_class": "LlavaProcessor", "resample": 3,
            "rescale_factor": 1 / 255, "size": {"shortest_edge": 28}},
        "processor_config.json": {
            "image_token": "<image>", "num_additional_image_tokens": 1, "patch_size": 14,
            "processor_class": "LlavaProcessor", "vision_feature_select_strategy": "default"},
    }
    for name, doc in files.items():
        with open(os.path.join(out_dir, name), "w") as f:
            json.dump(doc, f, indent=2, sort_keys=True)
    cfg_path = os.path.join(out_dir, "config.json")
    with open(cfg_path) as f:
        cfg_json = json.load(f)
    cfg_json["text_config"]["architectures"] = ["LlamaForCausalLM"]
    with open(cfg_path, "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)


def build(out_dir, kind="llama", hidden=64, layers=8, vocab=512, heads=None, intermediate=None,
          dtype="float32", seed=0, corpus=DEFAULT_CORPUS, preset="tiny", device="cpu"):
    """Write a loadable model directory (weights + config + tokenizer [+ remote code]); return a summary."""
    import torch

    torch_dtype = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                   "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
    if kind == "kimi" and preset == "k2.5":
        vocab = kimi_model.shape(preset)["vocab_size"]
    os.makedirs(out_dir, exist_ok=True)
    tok = build_tokenizer(vocab, corpus)
    if kind == "kimi":
        text = kimi_model.shape(preset, hidden, layers, vocab, heads, intermediate)
        n_params, _ = kimi_model.build(out_dir, tok, text, torch_dtype, seed, device)
        log(f"[tiny_model] kimi ({preset}): {n_params:,} parameters, dtype {dtype}, wrote {out_dir}")
        return {"ok": True, "out_dir": os.path.abspath(out_dir), "kind": kind, "preset": preset,
                "model_class": "KimiK25ForConditionalGeneration", "parameters": n_params,
                "vocab_size": text["vocab_size"], "num_layers": text["num_hidden_layers"],
                "hidden_size": text["hidden_size"], "dtype": dtype, "seed": seed, "device": device}
    text_kw = _text_kwargs(hidden, layers, vocab, heads, intermediate, tok)
    torch.manual_seed(seed)

    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(num_key_value_heads=max(1, text_kw["num_attention_heads"] // 2), **text_kw)
        model = LlamaForCausalLM(cfg)
    elif kind == "llava":
        from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration

        text = LlamaConfig(num_key_value_heads=max(1, text_kw["num_attention_heads"] // 2), **text_kw)
        # head_dim 32: vLLM's CPU attention kernels start there
        vision = CLIPVisionConfig(hidden_size=64, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=28, patch_size=14, projection_dim=32)
        cfg = LlavaConfig(text_config=text, vision_config=vision, image_token_index=tok.convert_tokens_to_ids("<image>"),
                          vision_feature_layer=-1, vision_feature_select_strategy="default")
        model = LlavaForConditionalGeneration(cfg)
    else:
        raise ValueError(f"unknown kind {kind!r} (expected kimi, llama or llava)")

    _seeded_init(model, seed)
    model = model.to(torch_dtype).eval()
    n_params = sum(p.numel() for p in model.parameters())
    log(f"[tiny_model] {kind}: {n_params:,} parameters, dtype {dtype}, writing {out_dir}")
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)

    if kind == "llava":
        _hub_layout_llava(out_dir)
    return {"ok": True, "out_dir": os.path.abspath(out_dir), "kind": kind, "model_class": type(model).__name__,
            "parameters": n_params, "vocab_size": vocab, "num_layers": layers, "hidden_size": hidden,
            "dtype": dtype, "seed": seed}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", "--output-dir", dest="out", required=True, help="model directory to write")
    ap.add_argument("--kind", choices=["kimi", "llama", "llava"], default="llama")
    ap.add_argument("--preset", choices=sorted(kimi_model.PRESETS), default="tiny",
                    help="kimi only: k2.5 = Kimi-K2.5's widths (hidden/vocab/MLA/heads), --layers deep")
    ap.add_argument("--device", default="cpu", help="kimi only: where the weights are drawn (cuda: seconds, not minutes)")
    ap.add_argument("--hidden", type=int, default=64, help="hidden size (2048 with --layers 20 --vocab 32000 --dtype bf16 ≈ 1.06B params)")
    ap.add_argument("--layers", type=int, default=8, help="number of decoder layers")
    ap.add_argument("--vocab", type=int, default=512, help="vocab size (tokenizer is padded to match)")
    ap.add_argument("--heads", type=int, default=None, help="attention heads (default: 4, or hidden/64 when hidden>=256)")
    ap.add_argument("--intermediate", type=int, default=None, help="MLP size (default ≈ 8/3·hidden)")
    ap.add_argument("--dtype", default="float32", choices=["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--corpus", default=DEFAULT_CORPUS, help="chat JSONL used to train the tokenizer")
    args = ap.parse_args(argv)
    if args.hidden <= 0 or args.layers <= 0 or args.vocab <= 0:
        print("tiny_model: --hidden, --layers and --vocab must be positive", file=sys.stderr)
        return 2
    if not os.path.isfile(args.corpus):
        print(f"tiny_model: corpus file not found: {args.corpus}", file=sys.stderr)
        return 2
    try:
        summary = build(args.out, args.kind, args.hidden, args.layers, args.vocab, args.heads, args.intermediate,
                        args.dtype, args.seed, args.corpus, args.preset, args.device)
    except ValueError as e:
        print(f"tiny_model: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
