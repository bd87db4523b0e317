"""The pipeline steps: which payload each runs and which inventory settings become its flags."""

from __future__ import annotations

from dataclasses import dataclass, field

from . import step_flags
from .errors import ConfigError
from .host import RUNS, expand, module_argv

STEPS = ("regenerate", "prepare", "extract", "vocab", "train", "eval")
# Steps that use the GPUs take the per-host GPU lock (`exec` runs any command; it takes the lock with --gpu).
GPU_STEPS = {"regenerate", "extract", "train", "eval", "all"}
# Steps that may run as several processes. They start through kimi_eagle_host.pipeline.launch, which decides on the host
# (it sees the GPUs and the model) between one process and torchrun workers (docs/CONTRACTS.md).
TORCHRUN_STEPS = {"extract", "train"}

# inventory key -> the step's flag (a plain name means --name-with-dashes)
FLAGS = {
    "regenerate": ("model", "dataset", "output_dir", "temperature", "max_tokens", "max_prompts", "tp_size", "dtype"),
    "prepare": ("model", "dataset", "output_dir", "seq_len"),
    "extract": ("model", "output_dir", "layer_ids", "backend", "batch_size", "tp_size", "seq_len", "dtype"),
    "vocab": ("model", "output_dir", "draft_vocab_size"),
    "train": ("model", "output_dir", "epochs", "lr", "batch_size", "ttt_steps", "dtype", "report_to"),
    "eval": ("model", "output_dir", ("eval_prompts", "prompts"), ("eval_num_prompts", "num_prompts"),
             ("eval_max_tokens", "max_tokens"), "num_speculative_tokens", "tp_size", "dtype", "report_to"),
}
REQUIRED = {"model", "dataset", "eval_prompts"}
# Where prepare finds the regenerated conversations (regenerate.py writes it there).
REGENERATED = "regenerated/chat.jsonl"

@dataclass
class Step:
    name: str
    argv: list[str]  # after the host's Python when `python` is set, else the whole command
    python: bool = True
    unless_exists: str | None = None
    env: dict[str, str] = field(default_factory=dict)  # exported for this command only
    branches: list["Step"] = field(default_factory=list)  # run at once instead of argv; the step fails if one does


def step_args(step: str, pipeline, entries=None) -> list[str]:
    args: list[str] = []
    for entry in FLAGS[step] if entries is None else entries:
        key, flag = entry if isinstance(entry, tuple) else (entry, entry)
        value = getattr(pipeline, key)
        if step == "prepare" and key == "dataset" and pipeline.regenerate:
            value = f"{pipeline.output_dir.rstrip('/')}/{REGENERATED}"  # the target's own answers
        if value is None:
            if key in REQUIRED:
                raise ConfigError(f"pipeline.{key} is not set (inventory `pipeline:` section or the host's override)")
            continue
        if isinstance(value, list):
            value = ",".join(str(v) for v in value)
        args += [f"--{flag.replace('_', '-')}", str(expand(value))]
    return args


def chain(pipeline) -> list[str]:
    """The steps of `run all`: regenerate when the pipeline says so, eval when it names held-out prompts."""
    names = ["prepare", "extract", "vocab", "train"]
    if pipeline.regenerate:
        names.insert(0, "regenerate")
    if pipeline.eval_prompts:
        names.append("eval")
    return names


def plan(step: str, pipeline, extra: list[str] | None = None) -> list[Step]:
    """The commands a job runs, in order. `extra` (after --) is appended to the step's flags."""
    extra = list(extra or [])
    if step == "exec":
        if not extra:
            raise ConfigError("`run exec` needs a command after --, e.g. kimi-eagle run exec -- nvidia-smi")
        return [Step("exec", extra, python=False)]
    if step == "all" and extra:
        raise ConfigError("`run all` takes no extra flags after --: set them in a recipe (steps: {STEP: {flag: value}}) "
                          "or as overrides, e.g. steps.train.warmup_steps=100")
    if step == "all":
        names = chain(pipeline)
    elif step in STEPS:
        names = [step]
    else:
        raise ConfigError(f"unknown step {step!r} (choose from {', '.join(STEPS)}, all, exec)")
    steps = []
    if pipeline.tiny_model:
        model = str(expand(pipeline.model))
        steps.append(Step("tiny-model", [*module_argv("pipeline.tiny_model"), "--kind", pipeline.tiny_model, "--out", model],
                          unless_exists=f"{model}/config.json"))
    elif pipeline.model_source:
        model = str(expand(pipeline.model))
        steps.append(Step("model", [*module_argv("pipeline.models"), "--source", pipeline.model_source, "--out", model],
                          unless_exists=f"{model}/config.json"))
    step_flags.validate(names[0], extra)  # a typo is refused here, before anything is rendered or uploaded
    for n in names:
        argv = [*module_argv(f"pipeline.{n}"), *step_args(n, pipeline),
                *step_flags.mapping_to_argv(n, pipeline.steps.get(n) or {}), *extra]
        if n in TORCHRUN_STEPS:
            argv = [*module_argv("pipeline.launch"), *launch_flags(n, pipeline), "--", *argv]
        steps.append(Step(n, argv))
    if step == "all":   # a run whose export vLLM cannot serve does not end as succeeded (eval --smoke)
        if "eval" in names:
            steps[-1].argv.append("--smoke")
        else:
            steps.append(Step("smoke", [*module_argv("pipeline.eval"), *smoke_args(pipeline), "--smoke"]))
    return steps


def smoke_args(pipeline) -> list[str]:
    """eval's flags without held-out prompts (its served smoke test alone), with the recipe's eval flags."""
    plain = [entry for entry in FLAGS["eval"] if not isinstance(entry, tuple)]
    return [*step_args("eval", pipeline, plain), *step_flags.mapping_to_argv("eval", pipeline.steps.get("eval") or {})]


def plan_for_host(step: str, host, extra: list[str] | None = None) -> list[Step]:
    """The plan, led (for pipeline steps) by the record of what the run used: the resolved settings, the versions
    on the host and ours, written by kimi_eagle_host.ops.provenance under {output_dir}/runs/<job-id>/ next to the outputs."""
    from . import __version__
    from .recipe import resolved_yaml

    steps = plan(step, host.pipeline, extra)
    if step == "exec":
        return steps
    settings = resolved_yaml(host.pipeline, source=host.recipe_source, host=host.name)
    record = Step("record", [*module_argv("ops.provenance"), "--output-dir", str(expand(host.pipeline.output_dir)),
                             "--runs-dir", RUNS, "--product-version", __version__, "--settings", settings])
    return [record, *steps]


def output_record(step: str, session) -> dict[str, str]:
    """What a pipeline job's start uploads next to its script: <runs>/<job>/output_dir (where its outputs are),
    written before the job starts, so `clean` (kimi_eagle_host.ops.clean, under the lock a start holds) never misses a
    job that has started and not yet recorded its folder. {name under the job folder: text}; {} for exec."""
    if step == "exec":
        return {}
    out = str(expand(session.host.pipeline.output_dir))
    path = out if out.startswith("/") else session.transport.abspath(out) if out.startswith("~") else session.path(out)
    return {"output_dir": path + "\n"}


def launch_flags(step: str, pipeline) -> list[str]:
    """The launcher's flags (kimi_eagle_host.pipeline.launch) from the inventory; what is not set there it finds out on
    the host."""
    flags = []
    if pipeline.nproc_per_node is not None:
        flags += ["--nproc-per-node", str(pipeline.nproc_per_node)]
    if step == "extract":
        flags += ["--gpus-per-replica", str(pipeline.gpus_per_replica)]
    return flags
