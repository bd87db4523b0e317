"""Every setting of the pipeline, declared once: name, type, default, range or choices, one-line doc, and which
steps read it (under which flag).

Everything else is derived from this table: the inventory's `pipeline:` section and recipes (kimi_eagle/config/inventory.py,
recipe.py), `KEY=VALUE` and `steps.<step>.KEY=VALUE` overrides, the flags a person types after `--`, each job's
`settings.json` (one section per step), the steps' argparse (`build_parser`) and the settings table of
docs/CONTRACTS.md (`markdown_table`). A value is checked by one function, `check`, so it is refused with the same
words wherever it was set.

Two kinds of entries: a *pipeline* setting is a top-level key (`epochs: 2` in the inventory or a recipe) that one
or more steps read; a *step* setting (`pipeline=False`) is read by one step only and is set under
`steps: {STEP: {KEY: VALUE}}`. Either may be set per step (`steps.train.epochs=2`): the step's value wins for that step.

Stdlib only: this module runs on the hosts too.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any

STEPS = ("regenerate", "prepare", "extract", "vocab", "train", "choose", "eval")
# Readers that are not steps: preflight checks a job's settings on the host before it starts (ops/preflight.py).
READERS = (*STEPS, "preflight")
TRACKERS = ("tensorboard", "wandb", "trackio", "mlflow", "none", "auto")
# Highest training-time-test depth train.py supports: EAGLE-3's (pipeline/train.py refuses more).
MAX_TTT_STEPS = 7
# Settings renamed since an earlier release: old key -> new key. The old key is still read, with one line saying so.
RENAMED = {"backend": "engine"}
# Scripts the `scripts` filter knows (data/curation.py tells a letter's script by its Unicode name).
SCRIPTS = ("latin", "cyrillic", "greek", "arabic", "hebrew", "han", "kana", "hangul", "devanagari", "thai", "other")


class SettingError(ValueError):
    """A value a setting does not accept: `key` is where it sits (`epochs`, `steps.train.epochs`)."""

    def __init__(self, key: str, message: str, path: tuple = ()):
        super().__init__(f"{key}: {message}")
        self.key, self.message = key, message
        self.path = path or tuple(key.split("."))  # where it sits in the section, for a file's line number


@dataclass(frozen=True)
class Setting:
    name: str
    kind: str  # text | int | float | bool | ints | choice | names | switch | toggle | trackers | count_or_auto
    default: Any
    doc: str
    reads: dict[str, str] = field(default_factory=dict)  # step -> its flag name (underscores), when it differs
    choices: tuple = ()
    minimum: float | None = None  # lowest accepted value (inclusive)
    positive: bool = False  # > 0
    maximum: float | None = None
    pipeline: bool = True  # a top-level key; False: set under steps.<step>.
    required: bool = False  # `run` needs it set (not empty)
    nonempty: bool = False  # text that, when given, must not be empty
    needed_by: tuple = ()  # steps that refuse to start without it (a flag or their settings.json section gives it)
    # step -> the default that step takes when the pipeline leaves the setting unset (a step run by hand, or an
    # unset pipeline value such as batch_size), where it differs from `default`
    step_defaults: dict = field(default_factory=dict)
    internal: bool = False  # set by kimi-eagle itself (a shard's --rank): a flag of the step, never a setting
    # For its step run alone: why `run all` refuses it set (the later steps would read another run's outputs);
    # {step} and {value} are filled in (config/step_plan.refuse_broken_links).
    alone: str = ""

    def default_for(self, step: str):
        return self.step_defaults.get(step, self.default)

    def flag(self, step: str) -> str:
        """The step's command-line flag: --name-with-dashes."""
        return "--" + self.reads[step].replace("_", "-")

    @property
    def takes_value(self) -> bool:
        return self.kind not in ("switch", "toggle")


def _s(name, kind, default, doc, steps=(), **kw) -> Setting:
    """A setting read by `steps` (a step name, or (step, flag) where the step's flag differs from the name)."""
    reads = {}
    for s in (steps,) if isinstance(steps, str) else steps:
        step, flag = s if isinstance(s, tuple) else (s, name)
        reads[step] = flag
    return Setting(name, kind, default, doc, reads, **kw)


def _step(step, name, kind, default, doc, **kw) -> Setting:
    return _s(name, kind, default, doc, (step,), pipeline=False, **kw)


_TORCH = ("extract", "train")
_PF = "preflight"
_ENGINE_STEPS = ("regenerate", "eval")
_DATA_STEPS = ("regenerate", "prepare")  # the steps that read `dataset` and curate it (data/curation.py)
PIPELINE_SETTINGS = [
    _s("model", "text", None, "target model folder (may use {workdir})", (*STEPS, _PF), required=True, nonempty=True,
       needed_by=("regenerate", "prepare", "train", "choose", "eval")),
    _s("dataset", "text", None, "training conversations (chat JSONL or a dataset name); with regenerate, the prompts",
       ("regenerate", "prepare", _PF), required=True, nonempty=True, needed_by=("regenerate", "prepare")),
    _s("output_dir", "text", "{workdir}/out", "pipeline root: every step reads and writes under it (a step run by hand: "
       "the current folder)", (*STEPS, _PF), nonempty=True, needed_by=("train",),
       step_defaults={s: "." for s in STEPS if s != "train"}),
    _s("layer_ids", "ints", None, "target layers whose hidden states train the draft (vLLM convention; "
       "default 2,N//2,N-3,N)", ("extract", "train", _PF)),
    _s("engine", "choice", "hf", "extraction engine: hf (transformers, any host) or vllm (where installed)",
       ("extract", "train", _PF), choices=("hf", "vllm")),
    _s("seq_len", "int", 2048, "tokens per sample (longer ones are cut)", ("prepare", "extract", "train", _PF),
       positive=True),
    _s("batch_size", "int", None, "extract's samples per forward and train's rows per step (unset: each step's own)",
       _TORCH, positive=True, step_defaults={"extract": 8}),
    _s("tp_size", "int", 1, "tensor-parallel size of vLLM engines", ("regenerate", "extract", "train", "choose", "eval", _PF),
       positive=True),
    _s("hidden_states", "choice", "offline", "offline: extract writes them as files, train reads them; online: "
       "train runs the engine and its hidden states reach it through a bounded buffer in memory, never as files",
       ("train", _PF), choices=("offline", "online")),
    _s("online_buffer_gb", "float", 2.0, "online: the engine waits while this many GB of hidden states wait for "
       "the trainer (a host's: shared among its engines)", ("train",), positive=True),
    _s("online_cache_gb", "float", 0.0, "online: keep the first documents that fit in this many GB for later "
       "epochs, in the trainer's memory (several trainer processes an engine: in the spool; a host's: shared among "
       "its engines) (0: every epoch runs the engine again)", ("train",), minimum=0),
    _s("online_spool_dir", "text", "/dev/shm", "online: where the buffer lives (a memory file system; a folder "
       "unique to the job is made in it and removed at the end)", ("train",), nonempty=True),
    _s("engine_gpus", "ints", None, "online: the GPUs (of those visible) the engine uses (unset: the trainer's)",
       ("train", _PF)),
    _s("train_gpus", "ints", None, "online: the GPUs (of those visible) the trainer uses (unset: all)", ("train",)),
    _s("online_engines", "int", None, "online: engines on each host, each extracting for an equal share of the "
       "host's trainer ranks beside their GPUs (unset: one per tp_size GPUs on CUDA; one per host on a CPU or with "
       "engine_gpus)", ("train",), positive=True),
    _s("draft_vocab_size", "int", 32000, "draft vocabulary (most frequent target tokens)", ("vocab",), positive=True),
    _s("epochs", "float", 1.0, "passes over the samples (0.5 = half of them)", ("train",), positive=True),
    _s("lr", "float", 1e-4, "peak learning rate", ("train",), positive=True),
    _s("ttt_steps", "int", 3, f"training-time-test unroll depth, 1..{MAX_TTT_STEPS}", ("train",), minimum=1,
       maximum=MAX_TTT_STEPS),
    _s("dtype", "choice", "auto", "compute dtype of the torch steps; auto: bf16 on CUDA, fp32 on CPU",
       ("regenerate", "extract", "train", "eval"), choices=("auto", "float32", "bfloat16")),
    _s("tiny_model", "choice", None, "build a tiny random model of this kind at `model` first (the demo)",
       choices=("kimi", "llama", "llava")),
    _s("nproc_per_node", "int", None, "processes per host for extract/train (unset: one per GPU)", positive=True),
    _s("gpus_per_replica", "count_or_auto", "auto",
       "extract (hf): GPUs one model copy spans; auto = fewest that hold it"),
    _s("model_source", "choice", None, "materialise a real small model from an installed package at `model`",
       choices=("smollm2",)),
    _s("regenerate", "bool", False, "answer `dataset`'s prompts with the target first (self-distillation)"),
    _s("temperature", "float", 0.0, "regenerate's sampling temperature (0 = greedy)", ("regenerate",), minimum=0),
    _s("max_tokens", "int", 256, "regenerate's answer length cap per turn", ("regenerate",), positive=True),
    _s("max_prompts", "int", None, "regenerate the first N conversations curation keeps (unset: all)",
       ("regenerate",), minimum=0, step_defaults={"regenerate": 0}),
    _s("self_prompts", "int", 0, "regenerate: fill the prompt set up to N conversations with prompts the target "
       "writes itself (Magpie); 0 = none", ("regenerate",), minimum=0),
    _s("dedupe", "choice", "auto", "drop repeated conversations (by user text): near (MinHash, and exact), exact "
       "(normalised text), off; auto: near for a dataset name or with self_prompts, off for a file", _DATA_STEPS,
       choices=("auto", "near", "exact", "off")),
    _s("min_prompt_chars", "int", 0, "drop conversations whose first user turn has fewer characters",
       _DATA_STEPS, minimum=0),
    _s("max_prompt_chars", "int", None, "drop conversations whose first user turn has more characters (unset: "
       "no limit)", _DATA_STEPS, positive=True),
    _s("scripts", "names", None, "keep conversations whose user text is >= 80 % letters of these scripts "
       "(comma list; unset: any)", _DATA_STEPS, choices=SCRIPTS),
    _s("choose_checkpoints", "int", 0, "export the best of N checkpoints spread evenly over training, chosen by "
       "serving each in vLLM on held-out training prompts (`run all` adds the choose step); 0: export the last",
       ("train",),
       minimum=0, maximum=20),
    _s("eval_prompts", "text", None, "held-out prompts (chat JSONL or mt-bench); set, `run all` ends with eval",
       (("eval", "prompts"),), nonempty=True),
    _s("eval_num_prompts", "int", None, "eval: use N prompts (unset: all)", (("eval", "num_prompts"),), minimum=0,
       step_defaults={"eval": 0}),
    _s("eval_max_tokens", "int", 128, "eval: new tokens per turn", (("eval", "max_tokens"),), positive=True),
    _s("num_speculative_tokens", "int", 3, "eval: draft tokens per step", ("eval",), positive=True),
    _s("report_to", "trackers", "auto", "where train and eval send metrics: " + ", ".join(TRACKERS) + " (comma list)",
       ("train", "eval")),
]


def _per_step(steps, name, kind, default, doc, **kw) -> list[Setting]:
    """The same step setting in several steps: one entry per step, declared here once."""
    return [_step(s, name, kind, default, doc, **kw) for s in steps]


_DEVICE = dict(kind="choice", choices=("auto", "cpu", "cuda"))
_ENGINE = dict(kind="choice", choices=("auto", "vllm", "hf"))
_VLLM_DTYPE_DOC = ("vllm engine dtype; auto: bfloat16, float32 on a CPU without AMX or AVX512-BF16 "
                   "(compute_dtype.for_vllm)")
STEP_SETTINGS = [
    *_per_step(("regenerate", "prepare", "extract", "vocab"), "out", "text", None,
               "write here instead of the step's folder under output_dir", nonempty=True,
               alone="the steps after {step} in `run all` read its output under output_dir, not {value}; set "
                     "output_dir instead, or run {step} alone"),
    *_per_step(("choose", "eval"), "out", "text", None,
               "write here instead of the step's folder under output_dir", nonempty=True),
    *_per_step(("regenerate", "extract"), "rank", "int", 0, "this worker's shard", minimum=0,
               internal=True),
    *_per_step(("regenerate", "extract"), "world_size", "int", 1, "shards in all", positive=True,
               internal=True),
    *_per_step(("regenerate", "extract", "train", "eval"), "device", default="auto", doc="where torch runs", **_DEVICE),
    *_per_step(_ENGINE_STEPS, "engine", default="auto", doc="vllm where the host has it, else transformers", **_ENGINE),
    *_per_step(_ENGINE_STEPS, "vllm_dtype", "text", "auto", _VLLM_DTYPE_DOC, nonempty=True),
    *_per_step(_ENGINE_STEPS, "max_model_len", "int", None,
               "context the turns must fit (both engines); unset: what the prompts need, at least 2048 (one vLLM "
               "compile for a run's engines), within the model's",
               positive=True),
    *_per_step(_ENGINE_STEPS, "enforce_eager", "toggle", True, "vllm engine: skip graph capture"),
    *_per_step(_ENGINE_STEPS, "max_turns", "int", 0, "answer at most N turns per conversation (0 = all)", minimum=0),
    *_per_step(("train", "eval"), "tracking_dir", "text", None, "tensorboard's folder (default <output-dir>/tracking)",
               nonempty=True),
    _step("regenerate", "chunk_size", "int", 64, "conversations per resumable chunk", positive=True),
    _step("regenerate", "batching", "choice", "auto", "vllm engine: stream (a conversation's next turn queued as "
          "its answer arrives, 2 chunks at once) or rounds (one call per turn of a chunk); auto: stream; hf: rounds",
          choices=("auto", "stream", "rounds")),
    _step("regenerate", "engines", "int", 1, "engines answering at once, each a process with an equal part of what "
          "its GPU had free (round-robin), started one at a time, claiming chunks as it goes: a small target's engine "
          "is bound by one CPU core",
          positive=True),
    _step("regenerate", "seed", "int", 0, "sampling seed"),
    _step("regenerate", "batch_size", "int", 16, "hf engine: prompts per generate call", positive=True),
    _step("regenerate", "self_prompt_tokens", "int", 256, "length cap of a prompt the target writes, in tokens",
          positive=True),
    _step("regenerate", "self_prompt_temperature", "float", 1.0, "sampling temperature of the prompts the target "
          "writes", positive=True),
    _step("regenerate", "long_prompts", "choice", "auto", "a first turn that does not fit: fail or skip it",
          choices=("auto", "fail", "skip")),
    _step("prepare", "on_bad_row", "choice", "auto", "malformed rows: fail naming FILE:LINE, or skip them; auto: "
          "skip for a dataset name, fail for a file", choices=("auto", "fail", "skip")),
    _step("prepare", "shard_size", "int", 10000, "samples per shard file", positive=True),
    _step("prepare", "max_samples", "int", 0, "stop after this many samples (0 = all)", minimum=0),
    _step("prepare", "workers", "int", 0, "tokenizing processes (0: one per CPU core, at most 16)", minimum=0),
    _step("extract", "prepared_dir", "text", None, "read prepared samples here instead of <output-dir>/prepared",
          nonempty=True),
    _step("extract", "validate", "switch", False, "only check the outputs of this rank's range"),
    _step("extract", "overwrite", "switch", False, "re-extract everything, ignore an existing data_config"),
    _step("extract", "no_early_stop", "switch", False, "run the full forward (incl. lm_head)"),
    _step("extract", "write_queue", "int", 16, "max samples waiting for the writer threads", positive=True),
    _step("extract", "writers", "int", None, "writer threads (unset: min(16, cores))", positive=True),
    _step("vocab", "token_freq", "text", None, "frequency file instead of <output-dir>/prepared/token_freq.npy",
          nonempty=True),
    _step("train", "engine_batch_size", "int", 8, "online: documents per engine forward", positive=True),
    _step("train", "tokens_per_step", "int", None, "token budget of one optimizer step over all ranks", positive=True),
    _step("train", "pack_len", "int", None, "tokens per packed row (default: the longest document)", positive=True),
    _step("train", "loader_workers", "int", None, "threads reading batches ahead", minimum=0),
    _step("train", "ttt_decay", "float", 0.8, "loss weight of TTT step k is decay**k", positive=True),
    _step("train", "resume", "switch", False, "continue from the latest checkpoint"),
    _step("train", "parallel", "choice", "auto", "under torchrun: ddp or fsdp", choices=("auto", "ddp", "fsdp")),
    _step("train", "max_steps", "int", None, "cap the total number of optimizer steps", positive=True),
    _step("train", "stop_at_step", "int", None, "checkpoint and exit after this step", positive=True,
          alone="train would stop before its export and the steps after it in `run all` would serve an earlier "
                "one; run `run train` with it, then `run all` with steps.train.resume=true"),
    _step("train", "seed", "int", 0, "initialisation and shuffling seed"),
    _step("train", "log_every", "int", 10, "log every N steps", positive=True),
    _step("train", "save_every", "int", 500, "checkpoint every N steps (and at the end)", positive=True),
    _step("train", "keep_checkpoints", "int", 2, "checkpoints kept", positive=True),
    _step("train", "lr_schedule", "choice", "cosine", "after warm-up: cosine to 10%, linear to 0, or constant",
          choices=("cosine", "linear", "constant")),
    _step("train", "warmup_steps", "int", 0, "linear warm-up steps", minimum=0),
    _step("train", "weight_decay", "float", 0.0, "AdamW weight decay", minimum=0),
    _step("train", "optimizer", "choice", "adamw", "muon: torch.optim.Muon on the weight matrices",
          choices=("adamw", "muon")),
    _step("train", "feature_noise", "float", 0.0, "std of Gaussian noise on the aux features", minimum=0),
    _step("train", "oov_positions", "choice", "mask", "positions without a draft id: leave the loss or keep",
          choices=("mask", "keep")),
    _step("train", "holdout_fraction", "float", 0.02, "documents kept out of training to measure", minimum=0,
          maximum=0.5),
    # 500 documents measure acceptance on ~10^5 positions or more (choose serves 32 of them): a stable figure,
    # while online keeps every held-out document in its spool folder for the whole run; Kimi-K2.5 at 10k tokens a
    # document: ~290 GB, not 2 % of 600k samples' 6.9 TB. Smaller data sets (2 % of under 25k documents) are
    # untouched.
    _step("train", "holdout_max_samples", "int", 500, "at most this many held-out documents (holdout_fraction's "
          "count, capped)", positive=True),
    _step("train", "eval_every", "int", 0, "held-out evaluation every N steps (0 = at the end)", minimum=0),
    _step("train", "trainer", "choice", "ours", "ours, or speculators' own trainer (CUDA)",
          choices=("ours", "speculators")),
    _step("train", "attention", "choice", "auto", "flex (CUDA) or math (any device)", choices=("auto", "flex", "math")),
    _step("train", "compile", "choice", "auto", "torch.compile the decoder layer (auto: on CUDA)",
          choices=("auto", "on", "off")),
    _step("train", "grad_clip", "float", 0.5, "max grad norm, 0 = off", minimum=0),
    _step("train", "norm_before_residual", "choice", 1, "speculators' norm_before_residual", choices=(0, 1)),
    _step("train", "train_lm_head", "switch", False, "also train the draft lm_head"),
    _step("train", "draft_num_heads", "int", None, "draft attention heads (default: the target's)", positive=True),
    _step("train", "draft_num_kv_heads", "int", None, "draft KV heads (default: the target's)", positive=True),
    _step("train", "draft_intermediate_size", "int", None, "draft MLP width (default: the target's)", positive=True),
    _step("train", "draft_layers", "int", 1, "draft decoder layers (EAGLE-3's is 1; vLLM serves more)", minimum=1,
          maximum=4),
    _step("train", "export_embed_tokens", "toggle", True, "include the target's embed_tokens in the export"),
    _step("train", "embed_key", "text", None, "exact tensor name of the target embedding", nonempty=True),
    _step("train", "norm_key", "text", None, "exact tensor name of the target final norm", nonempty=True),
    _step("train", "lm_head_key", "text", None, "exact tensor name of the target lm_head", nonempty=True),
    _step("choose", "prompts", "int", 32, "held-out training documents served per checkpoint (their first user "
          "turn), spread over the whole held-out list", positive=True),
    _step("choose", "max_tokens", "int", 128, "new tokens per served prompt", positive=True),
    _step("choose", "max_k", "int", 5, "draft tokens served; acceptance at every k up to it comes from that one run",
          positive=True, maximum=10),
    _step("choose", "batch_size", "int", 16, "the larger batch whose tokens/s is measured (besides batch 1)",
          positive=True),
    _step("choose", "swap_drafts", "toggle", True, "serve the later checkpoints by swapping each into the engine the "
          "first started, in place (one target load); off: an engine each"),
    *_per_step(("choose",), "vllm_dtype", "text", "auto", _VLLM_DTYPE_DOC, nonempty=True),
    *_per_step(("choose",), "max_model_len", "int", None, "vllm engine context (unset: the longest prompt plus "
               "max_tokens, at least 2048, within the model's positions)", positive=True),
    *_per_step(("choose",), "enforce_eager", "toggle", True, "vllm engine: skip graph capture"),
    _step("eval", "draft", "text", None, "draft export folder (default <output-dir>/draft/export)", nonempty=True),
    _step("eval", "batch_sizes", "text", "1,16", "tokens/s with and without the draft at these batch sizes",
          nonempty=True),
    _step("eval", "timing_prompts", "int", 0, "first turns decoded per batch size (0: twice the largest)", minimum=0),
    _step("eval", "max_batch", "int", 256, "prompts per engine call in the acceptance pass", positive=True),
    _step("eval", "threads", "int", 0,
          "hf engine: torch threads (0: torch's default, one for a target of hidden size below 256)", minimum=0),
    _step("eval", "reuse_baseline", "toggle", True, "reuse the target's answers from an earlier eval"),
    _step("eval", "baseline_dir", "text", None, "where those runs are recorded", nonempty=True),
    _step("eval", "smoke", "switch", False, "serve the export in vLLM on a few prompts; no accepted token fails the step"),
]
SETTINGS: dict[str, Setting] = {s.name: s for s in PIPELINE_SETTINGS}
# Flag aliases a step also accepts: step -> {alias: the flag it stands for}.
ALIASES = {"eval": {"-k": "--num-speculative-tokens"}}


def _index() -> dict[str, dict[str, Setting]]:
    """step -> {key under steps.<step> (the flag's name, underscores): setting}; one setting per key."""
    table: dict[str, dict[str, Setting]] = {s: {} for s in READERS}
    for s in PIPELINE_SETTINGS + STEP_SETTINGS:
        for step, key in s.reads.items():
            if key in table[step]:
                raise AssertionError(f"settings: {step} reads {key} twice")
            table[step][key] = s
    return table


BY_STEP = _index()


def step_setting(step: str, key: str) -> Setting | None:
    return BY_STEP.get(step, {}).get(key)


# ---- checking one value ----------------------------------------------------------------------------------------

def _brief(text: str) -> str:
    return repr(text) if len(text) <= 60 else f"{text[:40]!r}... ({len(text)} characters)"


def _number(s: Setting, key: str, value, integer: bool):
    what = "an integer" if integer else "a number"
    if isinstance(value, bool):
        raise SettingError(key, f"expected {what}, not a boolean (got {value!r})")
    if isinstance(value, str):
        try:
            value = int(value) if integer else float(value)
        except ValueError:  # also beyond int()'s 4300 digits: shown shortened, the line stays readable
            raise SettingError(key, f"expected {what} (got {_brief(value)})") from None
    if integer and isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise SettingError(key, f"expected {what} (got {value!r})")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int beyond any float: YAML reads up to 4300 digits
        raise SettingError(key, f"expected a finite number (got an integer of {len(str(abs(value)))} digits)") from None
    if not finite:
        raise SettingError(key, f"expected a finite number (got {value!r})")
    if not integer:
        value = float(value)
    low = "greater than 0" if s.positive else f"at least {s.minimum:g}" if s.minimum is not None else None
    if (s.positive and value <= 0) or (s.minimum is not None and value < s.minimum) or \
            (s.maximum is not None and value > s.maximum):
        bounds = f"from {s.minimum:g} to {s.maximum:g}" if s.maximum is not None and s.minimum is not None else \
            " and ".join(b for b in (low, f"at most {s.maximum:g}" if s.maximum is not None else None) if b)
        raise SettingError(key, f"expected {what} {bounds} (got {shown(value)})")
    return value


def _text(s: Setting, key: str, value) -> str:
    if isinstance(value, (bool, dict, list)) or value is None:
        raise SettingError(key, f"expected text (got {value!r})")
    value = str(value)
    if s.nonempty and not value.strip():
        raise SettingError(key, "is empty; give a value or leave the setting out")
    bad = next((c for c in value if not c.isprintable()), None)
    if bad is not None:
        raise SettingError(key, f"contains a control character ({ascii(bad)[1:-1]})")
    return value


def _digits(text: str) -> bool:
    """0-9 only: str.isdigit() also takes '²' and other digits int() refuses."""
    return text.isascii() and text.isdigit()


def _ints(s: Setting, key: str, value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        value = [value]  # `engine_gpus: 1` (YAML, KEY=VALUE) reads as an int: one GPU, as `--engine-gpus 1` does
    items = value.split(",") if isinstance(value, str) else value
    what = "GPU" if s.name.endswith("_gpus") else "layer"
    if not isinstance(items, list) or not items:
        example = "[0, 1]" if what == "GPU" else "[2, 16, 29]"
        raise SettingError(key, f"expected a list of {what} numbers like {example} (got {value!r})")
    out = []
    for item in items:
        # a YAML list gives ints, whose sign the digits test of the string form does not see
        if isinstance(item, bool) or not ((isinstance(item, int) and item >= 0) or
                                          (isinstance(item, str) and _digits(item.strip()))):
            raise SettingError(key, f"expected non-negative integers (got {item!r})")
        out.append(int(item))
    dup = sorted({i for i in out if out.count(i) > 1})
    if dup:
        raise SettingError(key, f"{what} {dup[0]} is listed twice (got {out}); each {what} once")
    return out


def _trackers(s: Setting, key: str, value) -> str:
    names = value if isinstance(value, list) else str(value).split(",")
    names = [str(n).strip() for n in names if str(n).strip()]
    bad = [n for n in names if n not in TRACKERS]
    if bad or not names:
        raise SettingError(key, f"{bad[0] if bad else value!r} is not a tracker (choose from {', '.join(TRACKERS)})")
    if len(names) > 1 and {"none", "auto"} & set(names):
        raise SettingError(key, "none and auto stand alone")
    return ",".join(names)


def _choice(s: Setting, key: str, value):
    # YAML 1.1 (files, and KEY=VALUE read as YAML) turns a bare on/off into a bool: where "on"/"off" is a
    # choice, that word is what was written
    word = {True: "on", False: "off"}.get(value) if isinstance(value, bool) else None
    if word in s.choices:
        return word
    for c in s.choices:
        if value == c or (isinstance(value, (str, int)) and not isinstance(value, bool) and str(value) == str(c)):
            return c
    raise SettingError(key, f"expected one of {', '.join(map(str, s.choices))} (got {value!r})")


def _names(s: Setting, key: str, value) -> str:
    """A comma list of names from the setting's choices, as one normalised string ("latin,cyrillic")."""
    names = value if isinstance(value, list) else str(value).split(",")
    names = [str(n).strip() for n in names if str(n).strip()]
    bad = [n for n in names if n not in s.choices]
    if bad or not names:
        raise SettingError(key, f"{bad[0] if bad else value!r} is not one of {', '.join(s.choices)} (a comma list)")
    return ",".join(dict.fromkeys(names))


def _bool(s: Setting, key: str, value) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise SettingError(key, f"expected true or false (got {value!r})")


def _count_or_auto(s: Setting, key: str, value):
    if value == "auto":
        return value
    if isinstance(value, str) and _digits(value):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SettingError(key, f"expected a positive number or auto (got {value!r})")
    return value


_CHECKS = {
    "int": lambda s, k, v: _number(s, k, v, True), "float": lambda s, k, v: _number(s, k, v, False),
    "text": _text, "ints": _ints, "trackers": _trackers, "choice": _choice, "names": _names, "bool": _bool, "switch": _bool,
    "toggle": _bool, "count_or_auto": _count_or_auto,
}


def check(s: Setting, value, key: str | None = None):
    """`value` as the setting holds it (a string from a command line converted), or a SettingError naming `key`.
    None means unset and is accepted."""
    if value is None:
        return None
    return _CHECKS[s.kind](s, key or s.name, value)


# ---- a section of settings ---------------------------------------------------------------------------------------

def check_section(raw: dict, *, recipe: bool = False) -> dict:
    """A `pipeline:` section (inventory, host override) or a recipe, checked and converted: {key: value}, with
    `steps` checked step by step. Unknown keys refused. Raises SettingError naming the key."""
    out: dict = {}
    for key, value in raw.items():
        key = str(key)
        if key == "steps":
            out["steps"] = check_steps(value)
        elif key == "description" and recipe:
            out[key] = None if value is None else str(value)
        elif key in SETTINGS:
            out[key] = check(SETTINGS[key], value)
        else:
            raise SettingError(key, "unknown key" + _did_you_mean(key, SETTINGS))
    if out.get("tiny_model") and out.get("model_source"):
        raise SettingError("model_source", "tiny_model and model_source both build `model`: set only one")
    return out


def check_steps(value) -> dict:
    if not isinstance(value, dict):
        raise SettingError("steps", "expected a mapping STEP: {setting: value}")
    out = {}
    for step, section in value.items():
        step = str(step)
        if step not in STEPS:
            raise SettingError(f"steps.{step}", f"unknown step (choose from {', '.join(STEPS)})")
        if not isinstance(section, dict):
            raise SettingError(f"steps.{step}", "expected a mapping of settings")
        out[step] = {}
        for key, v in section.items():
            key = str(key).replace("-", "_").lstrip("_")
            s = step_setting(step, key)
            if s is None:
                raise SettingError(f"steps.{step}.{key}", f"{step} has no such setting" +
                                   _did_you_mean(key, BY_STEP[step]))
            if s.internal:
                raise SettingError(f"steps.{step}.{key}", f"is set by kimi-eagle for each {step} worker, not a setting")
            try:
                out[step][key] = check(s, v, s.name if s.pipeline else f"steps.{step}.{key}")
            except SettingError as e:
                raise SettingError(e.key, e.message, ("steps", step, key)) from None
    return out


def _did_you_mean(key: str, known) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def renamed(raw: dict) -> list[str]:
    """Renames old keys in `raw` in place; the old keys found. Both old and new given: SettingError."""
    found = []
    for old, new in RENAMED.items():
        if isinstance(raw, dict) and old in raw:
            if new in raw:
                raise SettingError(old, f"renamed to {new}, which is also set: keep only {new}")
            raw[new] = raw.pop(old)
            found.append(old)
    return found


def defaults() -> dict:
    """Every pipeline setting at its default (and no per-step settings)."""
    return {**{s.name: s.default for s in PIPELINE_SETTINGS}, "steps": {}}


# ---- one step's section: what a job's settings.json holds and what a step reads -------------------------------

def step_section(step: str, resolved: dict) -> dict:
    """`step`'s settings from resolved pipeline settings: {flag name (underscores): value}; unset ones left out.
    A per-step value (steps.<step>.KEY) wins over the pipeline's."""
    section = {}
    for key, s in BY_STEP[step].items():
        if s.pipeline and resolved.get(s.name) is not None:
            section[key] = resolved[s.name]
    section.update({k: v for k, v in (resolved.get("steps") or {}).get(step, {}).items() if v is not None})
    return section


def settings_document(resolved: dict, steps: list[str]) -> dict:
    """The settings.json of a job: every resolved pipeline setting, and each step's section."""
    return {"pipeline": {k: v for k, v in resolved.items() if k != "steps"},
            "steps": {s: step_section(s, resolved) for s in steps}}


def section_to_argv(step: str, section: dict) -> list[str]:
    """A step's section as its command-line flags (switches only when on; toggles as --x / --no-x). A value goes
    in the flag's own word (`--output-dir=-o`): as a word of its own, one starting with '-' reads as an option to
    argparse, and the step would refuse a value the settings accepted."""
    argv: list[str] = []
    for key, value in section.items():
        s = BY_STEP[step][key]
        flag = "--" + key.replace("_", "-")
        if s.kind == "switch":
            argv += [flag] if value else []
        elif s.kind == "toggle":
            argv += [flag if value else f"--no-{flag[2:]}"]
        else:
            argv.append(f"{flag}={shown(value)}")
    return argv


def shown(value) -> str:
    """A value as a command line or a message shows it: 2 (not 2.0), 0.0001, 2,16,29."""
    if isinstance(value, list):
        return ",".join(map(shown, value))
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def parse_flags(step: str, argv: list[str]) -> dict:
    """Flags a person typed after `--` for `step`, checked like any other setting: {key: value}.
    Raises SettingError naming the flag."""
    known = BY_STEP[step]
    aliases = ALIASES.get(step, {})
    out: dict = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token == "-":
            raise SettingError(f"step {step}", f"unexpected argument {token!r} (its settings are flags: --name value)")
        flag, eq, value = token.partition("=")
        flag = aliases.get(flag, flag)
        flag = next((s.flag(step) for s in known.values() if flag in old_flags(step, s)), flag)  # the step says so
        if flag in ("-h", "--help"):
            i += 1
            continue
        key = flag[2:].replace("-", "_")
        s, negative = known.get(key), False
        if s is None and key.startswith("no_") and getattr(known.get(key[3:]), "kind", None) == "toggle":
            s, key, negative = known[key[3:]], key[3:], True
        if s is None or not flag.startswith("--"):
            names = [f"--{k.replace('_', '-')}" for k in known]
            hint = _did_you_mean(flag, names) or f" (see: {step}.py --help)"
            raise SettingError(f"step {step}", f"unknown flag {flag}{hint}")
        where = f"step {step}: flag {flag}"
        if not s.takes_value:
            if eq:
                raise SettingError(where, f"takes no value (got {token!r})")
            out[key] = not negative
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise SettingError(where, "needs a value")
            value = argv[i + 1]
            i += 1
        try:
            out[key] = check(s, value, s.name if s.pipeline else f"steps.{step}.{key}")
        except SettingError as e:
            raise SettingError(where, e.message) from None
        i += 1
    return out


# ---- the host side: argparse built from the table ---------------------------------------------------------------

def build_parser(step: str, description: str | None = None) -> argparse.ArgumentParser:
    """`step`'s argparse: every flag, help text, default, choice and range from the table, each value checked by
    `check` (so a step refuses what the controller refuses, in the same words), plus `--settings FILE`
    (step_runtime.parse_step_args reads it). The steps have no other parser."""
    p = argparse.ArgumentParser(prog=f"python -m kimi_eagle_host.pipeline.{step}", description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=None, metavar="FILE",
                   help="a job's settings.json: its section for this step gives the values (flags given win)")
    for key, s in BY_STEP[step].items():
        flags = [s.flag(step)] + [a for a, f in ALIASES.get(step, {}).items() if f == s.flag(step)]
        default = s.default_for(step)
        helptext = _help(s, step, default)
        if s.kind == "switch":
            p.add_argument(*flags, action="store_true", help=helptext)
        elif s.kind == "toggle":
            p.add_argument(*flags, action=argparse.BooleanOptionalAction, default=default, help=helptext)
        else:
            p.add_argument(*flags, type=_argparse_type(key, s), default=default, required=step in s.needed_by,
                           metavar=_metavar(s), help=helptext)
            for old in old_flags(step, s):
                p.add_argument(old, dest=key, type=_argparse_type(key, s), action=RenamedFlag, new=flags[0],
                               help=argparse.SUPPRESS)
    return p


class RenamedFlag(argparse.Action):
    """A flag's old name (RENAMED): it still sets the new flag's value, and says once on stderr what it is called now."""

    def __init__(self, option_strings, dest, new: str, **kw):
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog}: {option_string} is now {self.new} (the old name still works)", file=sys.stderr)
        setattr(namespace, self.dest, values)


def old_flags(step: str, s: Setting) -> list[str]:
    """The old names of `s`'s flag in `step` (--backend for the pipeline's engine)."""
    return ["--" + old.replace("_", "-") for old, new in RENAMED.items() if new == s.name and s.pipeline and step in s.reads]


def _help(s: Setting, step: str, default) -> str:
    text = s.doc + (" (set by kimi-eagle)" if s.internal else "")
    if s.takes_value and default is not None:
        text += f" (default {shown(default)})"
    return text.replace("%", "%%")  # argparse formats help with %


def _metavar(s: Setting) -> str | None:
    """What usage shows for the value: the choices, the shape of a list; else argparse's own (the flag's name)."""
    if s.choices:
        return "{" + ",".join(map(str, s.choices)) + "}"
    return {"ints": "N,N,...", "trackers": "NAME[,NAME]", "count_or_auto": "N|auto"}.get(s.kind)


def _argparse_type(key: str, s: Setting):
    def convert(text: str):
        try:
            return check(s, text, f"--{key.replace('_', '-')}")
        except SettingError as e:
            raise argparse.ArgumentTypeError(e.message) from None
    convert.__name__ = s.kind
    return convert


# ---- docs -------------------------------------------------------------------------------------------------------

def _shown_default(s: Setting) -> str:
    if s.default is None:
        return "unset"
    return json.dumps(s.default) if not isinstance(s.default, str) else s.default


def _shown_range(s: Setting) -> str:
    if s.choices:
        return " \\| ".join(map(str, s.choices))
    if s.kind in ("int", "float"):
        low = "> 0" if s.positive else f"≥ {s.minimum:g}" if s.minimum is not None else ""
        high = f"≤ {s.maximum:g}" if s.maximum is not None else ""
        return ", ".join(x for x in (low, high) if x)
    return {"ints": "unique, ≥ 0", "trackers": ", ".join(TRACKERS), "count_or_auto": "> 0 or auto"}.get(s.kind, "")


def _shown_reader(s: Setting, step: str) -> str:
    """`eval (`--num-prompts`, default 0)`: a reader, its flag where it differs from the name, its own default."""
    notes = [f"`{s.flag(step)}`"] if s.reads[step] != s.name else []
    notes += [f"default {json.dumps(s.step_defaults[step])}"] if step in s.step_defaults else []
    notes += ["needs it"] if step in s.needed_by else []
    return step + (f" ({', '.join(notes)})" if notes else "")


def markdown_table() -> str:
    """docs/CONTRACTS.md's settings table (tests/test_settings.py checks the committed one equals this)."""
    rows = ["| setting | type | default | accepted | read by (flag) | meaning |", "|---|---|---|---|---|---|"]
    for s in PIPELINE_SETTINGS + STEP_SETTINGS:
        name = s.name if s.pipeline else f"steps.{next(iter(s.reads))}.{s.name}"
        reads = ", ".join(_shown_reader(s, st) for st in s.reads)
        name = f"`{name}`" + (" (set by kimi-eagle, not a setting)" if s.internal else "")
        doc = s.doc + ("; its step alone, refused in `run all`" if s.alone else "")
        rows.append(f"| {name} | {s.kind} | {_shown_default(s)} | {_shown_range(s)} | {reads or 'controller'} "
                    f"| {doc.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":  # docs/CONTRACTS.md's settings table
    print(markdown_table(), end="")
