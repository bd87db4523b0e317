#!/usr/bin/env python3
"""Kimi-K2.5-shaped targets with random weights, laid out like the Hub checkpoint (moonshotai/Kimi-K2.5).

What vLLM (0.18 and later, read at 0.25.1 and 0.32) and transformers load for `KimiK25ForConditionalGeneration`:

  config.json     model_type kimi_k25, architectures [KimiK25ForConditionalGeneration], `text_config` (a DeepSeek-V3
                  config: MLA attention, first_k_dense_replace dense layers then MoE with sigmoid scoring and noaux_tc
                  routing; vLLM falls back to softmax routing when scoring_func is absent, transformers never does),
                  `vision_config` (MoonViT + projector), media_placeholder_token_id, auto_map to the remote code.
  weights         language_model.model.layers.*, language_model.model.embed_tokens, language_model.lm_head,
                  vision_tower.{patch_embed,encoder}.*, mm_projector.{pre_norm,proj.0,proj.2}.* (the Hub names; vLLM
                  maps proj.0/proj.2 to its linear_1/linear_2 and refuses a checkpoint that leaves a weight out).
  preprocessor_config.json   media_proc_cfg, which vLLM's own Kimi image processor reads (it builds the multimodal
                  processor even for text-only prompts).
  remote code     configuration_kimi_tiny.py / modeling_kimi_tiny.py: transformers loads the model only with
                  trust_remote_code=True, as it does the real checkpoint. The vision tower here carries the Hub's
                  parameter names and shapes but never runs (text-only).

`shape()` gives the text config for a preset: "tiny" (CPU tests, the default demo) or "k2.5" (Kimi-K2.5's real widths:
hidden 7168, vocab 163,840, its MLA dimensions, 64 heads, dense layer 0 then MoE, with only a few layers and routed
experts so it fits one GPU in bf16). `real_config()` is the real model's config (61 layers, 384 experts, INT4 experts)
for checks that read a config without weights (preflight). Weights are drawn tensor by tensor from one seeded generator
on --device (minutes on CPU for billions of parameters, seconds on a GPU) and written in safetensors shards.
"""
import json
import os

# Kimi-K2.5's text model (config.json `text_config` of moonshotai/Kimi-K2.5, without the quantization block).
KIMI_K25_TEXT = dict(
    model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
    vocab_size=163840, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
    num_hidden_layers=61, num_attention_heads=64, num_key_value_heads=64,
    q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
    n_routed_experts=384, n_shared_experts=1, num_experts_per_tok=8, first_k_dense_replace=1, moe_layer_freq=1,
    n_group=1, topk_group=1, topk_method="noaux_tc", scoring_func="sigmoid", norm_topk_prob=True,
    routed_scaling_factor=2.827, hidden_act="silu", rms_norm_eps=1e-5, attention_bias=False,
    max_position_embeddings=262144, num_nextn_predict_layers=0, tie_word_embeddings=False,
    rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 64.0,
                     "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
                     "mscale": 1.0, "mscale_all_dim": 1.0},
    bos_token_id=163584, eos_token_id=163585, pad_token_id=163839,
)
# The real checkpoint's routed experts are INT4 (compressed-tensors, groups of 32); everything else is bf16.
KIMI_K25_QUANTIZATION = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "output_activations": None,
                                  "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group",
                                              "group_size": 32, "dynamic": False}}},
    "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:vision_tower.*", "re:mm_projector.*"],
}
KIMI_K25_VISION = dict(patch_size=14, init_pos_emb_height=64, init_pos_emb_width=64, init_pos_emb_time=4,
                       pos_emb_type="divided_fixed", num_attention_heads=16, num_hidden_layers=27, hidden_size=1152,
                       intermediate_size=4304, merge_kernel_size=[2, 2], video_attn_type="spatial_temporal",
                       merge_type="sd2_tpool", mm_projector_type="patchmerger", projector_hidden_act="gelu",
                       projector_ln_eps=1e-5)
# A MoonViT small enough to cost nothing; vLLM builds it unless told the run is text-only.
TINY_VISION = dict(KIMI_K25_VISION, num_attention_heads=2, num_hidden_layers=1, hidden_size=32, intermediate_size=64,
                   init_pos_emb_height=8, init_pos_emb_width=8)
MEDIA_PROC_CFG = {"patch_size": 14, "merge_kernel_size": 2, "in_patch_limit": 16384, "patch_limit_on_one_side": 512,
                  "in_patch_limit_each_frame": 4096, "in_patch_limit_video": None, "fixed_output_tokens": None,
                  "temporal_merge_kernel_size": 4, "sample_fps": 2.0, "max_num_frames_each_video": None,
                  "timestamp_mode": "hh:mm:ss.fff", "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5],
                  "config_type": "media_proc"}

# Presets: the text model's widths. k2.5 keeps every width of the real model (so the draft, the hidden-state files
# and the vocabulary mapping have their real sizes) and shrinks only depth and expert count.
# `mla` is a small model with Kimi's MLA latent widths: vLLM's MLA kernels (CPU and GPU) take only a 576-wide
# latent cache (kv_lora_rank 512 + qk_rope_head_dim 64), so this is the smallest Kimi-shaped target vLLM can run.
PRESETS = {
    "tiny": None,  # derived from --hidden/--layers/--vocab (see shape())
    "mla": dict(num_attention_heads=2, num_key_value_heads=2, hidden_size=256, q_lora_rank=128,
                intermediate_size=512, moe_intermediate_size=128, n_routed_experts=4, num_experts_per_tok=2),
    "k2.5": dict(n_routed_experts=8, num_experts_per_tok=2),
}

CONFIGURATION_CODE = '''\
"""Stand-in for Kimi-K2.5's configuration (remote code, loaded with trust_remote_code=True)."""
from transformers import DeepseekV3Config, PretrainedConfig


class KimiK25VisionConfig(PretrainedConfig):
    model_type = "kimi_k25_vision"

    def __init__(self, patch_size=14, init_pos_emb_height=64, init_pos_emb_width=64, init_pos_emb_time=4,
                 num_attention_heads=16, num_hidden_layers=27, hidden_size=1152, intermediate_size=4304,
                 merge_kernel_size=(2, 2), mm_hidden_size=None, **kwargs):
        self.patch_size = patch_size
        self.init_pos_emb_height = init_pos_emb_height
        self.init_pos_emb_width = init_pos_emb_width
        self.init_pos_emb_time = init_pos_emb_time
        self.num_attention_heads = num_attention_heads
        self.num_hidden_layers = num_hidden_layers
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.merge_kernel_size = list(merge_kernel_size)
        self.mm_hidden_size = mm_hidden_size or hidden_size
        super().__init__(**kwargs)


class KimiK25Config(PretrainedConfig):
    model_type = "kimi_k25"
    sub_configs = {"text_config": DeepseekV3Config, "vision_config": KimiK25VisionConfig}

    def __init__(self, text_config=None, vision_config=None, media_placeholder_token_id=None, **kwargs):
        if isinstance(text_config, dict):
            text_config = DeepseekV3Config(**text_config)
        self.text_config = text_config if text_config is not None else DeepseekV3Config()
        if isinstance(vision_config, dict):
            vision_config = KimiK25VisionConfig(**vision_config)
        self.vision_config = vision_config if vision_config is not None else KimiK25VisionConfig()
        self.media_placeholder_token_id = media_placeholder_token_id
        super().__init__(**kwargs)
'''

MODELING_CODE = '''\
"""Stand-in for Kimi-K2.5's multimodal wrapper (remote code).

Like the real model, the language model is a DeepseekV3ForCausalLM stored at `.language_model`, so its decoder layers
are `language_model.model.layers`; there is no `model.model`. The vision tower and projector carry the Hub
checkpoint's parameter names and shapes (vision_tower.patch_embed / encoder.blocks.N / mm_projector.proj.0,2) so one
folder loads in transformers and in vLLM; they never run here: text-only inputs never reach them.
"""
import torch
from torch import nn
from transformers import DeepseekV3ForCausalLM, GenerationMixin, PreTrainedModel

try:
    from .configuration_kimi_tiny import KimiK25Config
except ImportError:  # imported as a plain module (the builder makes the weights this way)
    from configuration_kimi_tiny import KimiK25Config


class _PosEmb(nn.Module):
    def __init__(self, h, w, dim):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(h, w, dim))


class _PatchEmbed(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.proj = nn.Conv2d(3, v.hidden_size, kernel_size=v.patch_size, stride=v.patch_size)
        self.pos_emb = _PosEmb(v.init_pos_emb_height, v.init_pos_emb_width, v.hidden_size)


class _Mlp(nn.Module):
    def __init__(self, dim, inner):
        super().__init__()
        self.fc0, self.fc1 = nn.Linear(dim, inner), nn.Linear(inner, dim)


class _Block(nn.Module):
    def __init__(self, v):
        super().__init__()
        d = v.hidden_size
        self.norm0, self.norm1 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.mlp = _Mlp(d, v.intermediate_size)
        self.wqkv, self.wo = nn.Linear(d, 3 * d), nn.Linear(d, d)


class _Encoder(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.blocks = nn.ModuleList(_Block(v) for _ in range(v.num_hidden_layers))
        self.final_layernorm = nn.LayerNorm(v.hidden_size)


class MoonViTStandIn(nn.Module):
    def __init__(self, v):
        super().__init__()
        self.patch_embed, self.encoder = _PatchEmbed(v), _Encoder(v)


class _Projector(nn.Module):
    def __init__(self, v, text_hidden):
        super().__init__()
        merged = v.hidden_size * v.merge_kernel_size[0] * v.merge_kernel_size[1]
        self.pre_norm = nn.LayerNorm(v.hidden_size)
        self.proj = nn.Sequential(nn.Linear(merged, merged), nn.GELU(), nn.Linear(merged, text_hidden))


class KimiK25PreTrainedModel(PreTrainedModel):
    config_class = KimiK25Config
    base_model_prefix = ""
    supports_gradient_checkpointing = True
    _no_split_modules = ["DeepseekV3DecoderLayer"]
    _supports_sdpa = True


class KimiK25ForConditionalGeneration(KimiK25PreTrainedModel, GenerationMixin):
    def __init__(self, config):
        super().__init__(config)
        self.vision_tower = MoonViTStandIn(config.vision_config)
        self.mm_projector = _Projector(config.vision_config, config.text_config.hidden_size)
        self.language_model = DeepseekV3ForCausalLM(config.text_config)
        self.post_init()

    def get_input_embeddings(self):
        return self.language_model.get_input_embeddings()

    def set_input_embeddings(self, value):
        self.language_model.set_input_embeddings(value)

    def get_output_embeddings(self):
        return self.language_model.get_output_embeddings()

    def forward(self, input_ids=None, attention_mask=None, pixel_values=None, **kwargs):
        if pixel_values is not None:
            raise NotImplementedError("the Kimi stand-in is text-only")
        return self.language_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
'''
CODE_FILES = {"configuration_kimi_tiny.py": CONFIGURATION_CODE, "modeling_kimi_tiny.py": MODELING_CODE}
AUTO_MAP = {"AutoConfig": "configuration_kimi_tiny.KimiK25Config",
            "AutoModel": "modeling_kimi_tiny.KimiK25ForConditionalGeneration",
            "AutoModelForCausalLM": "modeling_kimi_tiny.KimiK25ForConditionalGeneration"}


def shape(preset, hidden=64, layers=8, vocab=512, heads=None, intermediate=None):
    """The text config (a dict) of a preset. `tiny` shrinks every width with --hidden (MLA ranks and head dims
    follow it); `mla` is small but keeps Kimi's MLA dims; `k2.5` is Kimi-K2.5's widths with `layers` decoder layers
    (first dense, the rest MoE)."""
    if preset == "k2.5":
        return dict(KIMI_K25_TEXT, **PRESETS["k2.5"], num_hidden_layers=layers)
    if preset == "mla":
        return dict(KIMI_K25_TEXT, **PRESETS["mla"], num_hidden_layers=layers, vocab_size=vocab,
                    max_position_embeddings=4096)
    if preset != "tiny":
        raise ValueError(f"unknown Kimi preset {preset!r} (expected tiny or k2.5)")
    heads = heads or (hidden // 64 if hidden >= 256 else 4)
    head_dim = max(8, hidden // heads)
    return dict(
        KIMI_K25_TEXT, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
        num_key_value_heads=heads, intermediate_size=intermediate or (hidden * 8 // 3 + 63) // 64 * 64,
        moe_intermediate_size=max(16, hidden // 2), n_routed_experts=4, num_experts_per_tok=2,
        routed_scaling_factor=2.5, max_position_embeddings=4096, rms_norm_eps=1e-6,
        q_lora_rank=max(16, hidden // 2), kv_lora_rank=max(16, hidden // 4), qk_rope_head_dim=head_dim // 2,
        qk_nope_head_dim=head_dim // 2, v_head_dim=head_dim,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )


def wrapper_config(text, vision, media_token_id, bos, eos, pad):
    """config.json of the multimodal wrapper around `text` (a dict)."""
    return {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "auto_map": dict(AUTO_MAP),
        "text_config": dict(text, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad),
        "vision_config": dict(vision, mm_hidden_size=text["hidden_size"]),
        "media_placeholder_token_id": media_token_id, "bos_token_id": bos, "eos_token_id": eos, "pad_token_id": pad,
        "ignore_index": -100, "use_unified_vision_chunk": True, "tie_word_embeddings": False,
        "video_placeholder": "<|kimi_k25_video_placeholder|>", "dtype": "bfloat16",
    }


def real_config():
    """Kimi-K2.5's own config.json (61 layers, 384 experts, INT4 routed experts): sizes without weights."""
    text = dict(KIMI_K25_TEXT, quantization_config=KIMI_K25_QUANTIZATION)
    cfg = wrapper_config(text, KIMI_K25_VISION, 163605, 163584, 163585, 163839)
    cfg["quantization_config"] = KIMI_K25_QUANTIZATION
    return cfg


def write_code(out_dir):
    for name, code in CODE_FILES.items():
        with open(os.path.join(out_dir, name), "w") as f:
            f.write(code)


def _import_model_class(out_dir):
    """The remote-code model class, imported from out_dir as plain modules (no trust_remote_code cache)."""
    import importlib.util
    import sys

    mods = {}
    for name in ("configuration_kimi_tiny", "modeling_kimi_tiny"):
        spec = importlib.util.spec_from_file_location(name, os.path.join(out_dir, name + ".py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        mods[name] = mod
    return mods["configuration_kimi_tiny"].KimiK25Config, mods["modeling_kimi_tiny"].KimiK25ForConditionalGeneration


def _init_tensor(name, shape, generator, device, dtype):
    """The init the other tiny models get: 0.02-normal matrices, norms near (not at) 1 so a test can tell normed from
    un-normed states, zero router bias (transformers' own init changes between versions)."""
    import torch

    if name.endswith("e_score_correction_bias"):
        return torch.zeros(shape, dtype=dtype, device=device)
    x = torch.randn(shape, generator=generator, device=device, dtype=torch.float32)
    if len(shape) >= 2:
        x = x * 0.02
    elif "norm" in name:
        x = 1.0 + 0.1 * x
    else:
        x = x * 0.01
    return x.to(dtype)


SHARD_BYTES = 4 << 30


def hub_names(shapes):
    """Checkpoint names for a state dict's shapes. transformers 5 keeps a MoE layer's routed experts fused
    (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) and converts when it loads or saves; the Hub
    checkpoint, and vLLM's loader, name each expert: experts.{e}.{gate,up,down}_proj.weight."""
    out = {}
    for name, shape in shapes.items():
        if name.endswith(".experts.gate_up_proj"):
            stem, (n_exp, two_i, hidden) = name[:-len("gate_up_proj")], shape
            for e in range(n_exp):
                out[f"{stem}{e}.gate_proj.weight"] = (two_i // 2, hidden)
                out[f"{stem}{e}.up_proj.weight"] = (two_i // 2, hidden)
        elif name.endswith(".experts.down_proj"):
            stem, (n_exp, hidden, inter) = name[:-len("down_proj")], shape
            for e in range(n_exp):
                out[f"{stem}{e}.down_proj.weight"] = (hidden, inter)
        else:
            out[name] = shape
    return out


def write_weights(out_dir, cfg_json, dtype, seed, device="cpu"):
    """Draw every tensor of the model (names and shapes from a meta-device instance) and save safetensors shards
    with an index; returns the number of parameters."""
    import torch
    from safetensors.torch import save_file

    config_cls, model_cls = _import_model_class(out_dir)
    cfg = config_cls(**{k: v for k, v in cfg_json.items() if k not in ("auto_map", "model_type")})
    with torch.device("meta"):
        shapes = hub_names({k: tuple(v.shape) for k, v in model_cls(cfg).state_dict().items()})
    g = torch.Generator(device=device).manual_seed(seed)
    index, shard, shard_bytes, n_params, shards = {}, {}, 0, 0, []

    def flush():
        nonlocal shard, shard_bytes
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file({k: v.cpu().contiguous() for k, v in shard.items()}, os.path.join(out_dir, name),
                  metadata={"format": "pt"})
        shards.append(name)
        index.update({k: name for k in shard})
        shard, shard_bytes = {}, 0

    for name in sorted(shapes):
        t = _init_tensor(name, shapes[name], g, device, dtype)
        n_params += t.numel()
        shard[name] = t
        shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    total = sum(int(torch.Size(s).numel()) * torch.tensor([], dtype=dtype).element_size() for s in shapes.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, f, indent=1)
    return n_params


def write_processor_config(out_dir):
    """vLLM's Kimi image processor reads media_proc_cfg from here, even for text-only prompts."""
    with open(os.path.join(out_dir, "preprocessor_config.json"), "w") as f:
        json.dump({"media_proc_cfg": MEDIA_PROC_CFG, "processor_class": "KimiK25Processor"}, f, indent=2)


def build(out_dir, tok, text, dtype, seed, device="cpu", vision=None):
    """Write config, remote code, processor config and random weights for `text` (a shape() dict) with tokenizer
    `tok` (already sized to text's vocab); return (parameters, config dict)."""
    media = tok.convert_tokens_to_ids("<image>")
    cfg_json = wrapper_config(text, vision or TINY_VISION, media, tok.bos_token_id, tok.eos_token_id,
                              tok.pad_token_id)
    cfg_json["dtype"] = str(dtype).replace("torch.", "")
    os.makedirs(out_dir, exist_ok=True)
    write_code(out_dir)
    n_params = write_weights(out_dir, cfg_json, dtype, seed, device)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg_json, f, indent=2, sort_keys=True)
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                   "pad_token_id": tok.pad_token_id}, f, indent=2)
    write_processor_config(out_dir)
    tok.save_pretrained(out_dir)
    return n_params, cfg_json


def write_real_config(out_dir):
    """Kimi-K2.5's config.json alone (what a preflight reads before any weights exist)."""
    os.makedirs(out_dir, exist_ok=True)
    write_code(out_dir)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(real_config(), f, indent=2, sort_keys=True)
    return os.path.join(out_dir, "config.json")
