"""The pipeline steps: which payload each runs and which inventory settings become its flags."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kimi_eagle_host import settings

from ..errors import ConfigError
from ..hosts.session import RUNS, expand, module_argv

STEPS = ("regenerate", "prepare", "extract", "vocab", "train", "choose", "eval")
# Steps that use the GPUs take the per-host GPU lock (`exec` runs any command; it takes the lock with --gpu).
GPU_STEPS = {"regenerate", "extract", "train", "choose", "eval", "all"}
# Steps that may run as several processes. They start through kimi_eagle_host.pipeline.launch, which decides on the host
# (it sees the GPUs and the model) between one process and torchrun workers (docs/CONTRACTS.md).
TORCHRUN_STEPS = {"extract", "train"}

# Settings `run` cannot do without (kimi_eagle_host/settings.py marks them required; eval_prompts only for eval).
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


def step_section(step: str, pipeline, extra: dict | None = None, required: bool = True) -> dict:
    """What `step` runs with: {its flag's key: value} from the resolved settings (kimi_eagle_host/settings.py),
    `steps.<step>` over the pipeline's, then `extra` (the flags after --, already checked). Paths expanded.
    `required`: refuse a missing required setting (preflight, which reports it as a check, passes False)."""
    section = settings.step_section(step, pipeline.model_dump())
    if step == "prepare" and pipeline.regenerate:
        section["dataset"] = f"{pipeline.output_dir.rstrip('/')}/{REGENERATED}"  # the target's own answers
    section.update(extra or {})
    for key, s in settings.BY_STEP[step].items():
        if required and s.pipeline and s.name in REQUIRED and section.get(key) is None:
            raise ConfigError(f"pipeline.{s.name} is not set (inventory `pipeline:` section, the host's override, "
                              f"a recipe or {s.name}=VALUE)")
    return {k: str(expand(v)) if isinstance(v, str) else v for k, v in section.items()}


def step_args(step: str, pipeline) -> list[str]:
    return settings.section_to_argv(step, step_section(step, pipeline))


def extra_settings(step: str, extra: list[str]) -> dict:
    """The flags typed after `--` for `step`, checked by the schema: {key: value}; one line (exit 2) if one is bad."""
    try:
        return settings.parse_flags(step, extra)
    except settings.SettingError as e:
        raise ConfigError(str(e)) from None


def chain(pipeline) -> list[str]:
    """The steps of `run all`: regenerate when the pipeline says so, choose (the best of the checkpoints train
    exported, by serving them) when choose_checkpoints is set, eval (of that export) when it names held-out
    prompts; no extract with `hidden_states: online` (train runs the engine itself)."""
    names = ["prepare", "vocab", "train"] if pipeline.hidden_states == "online" else ["prepare", "extract", "vocab", "train"]
    if pipeline.self_prompts and not pipeline.regenerate:  # else the setting would be dropped without a word
        raise ConfigError(f"self_prompts: {pipeline.self_prompts} needs regenerate: true (the target writes the "
                          "prompts in regenerate, then answers them)")
    if pipeline.regenerate:
        names.insert(0, "regenerate")
    if pipeline.choose_checkpoints:
        names.append("choose")
    if pipeline.eval_prompts:
        names.append("eval")
    refuse_broken_links(names, pipeline)
    return names


# The steps whose output a later step of `run all` reads from its place under output_dir (prepare the regenerated
# conversations, extract and train the prepared data, train the hidden states and the vocabulary).
def refuse_broken_links(names: list[str], pipeline) -> None:
    """One line (exit 2) for a `run all` whose later steps would read another run's outputs, or none: a setting
    declared for its step alone (settings.Setting.alone: `steps.<step>.out` while the next steps read its usual
    folder; a train's `stop_at_step` while choose, eval or the smoke test serve whatever export an earlier run
    left)."""
    resolved = pipeline.model_dump()
    for name in names:
        section = settings.step_section(name, resolved)
        for key, s in settings.BY_STEP[name].items():
            if s.alone and section.get(key):
                raise ConfigError(f"steps.{name}.{key}: " + s.alone.format(step=name, value=section[key]))


def trainer(pipeline) -> str:
    """The trainer train runs (steps.train.trainer): ours trains online too; speculators' reads hidden-state files."""
    return settings.step_section("train", pipeline.model_dump()).get("trainer") or \
        settings.BY_STEP["train"]["trainer"].default


def refuse_online_file_trainer(names: list[str], pipeline) -> None:
    """One line (exit 2) for a job whose train would refuse its hidden states only when it starts, after the steps
    before it ran: online streams them, and speculators' trainer reads files."""
    if "train" in names and settings.step_section("train", pipeline.model_dump()).get("hidden_states") == "online" \
            and trainer(pipeline) != "ours":
        raise ConfigError(f"steps.train.trainer: {trainer(pipeline)} reads the hidden states as files, and "
                          "hidden_states: online streams them to the trainer without files: set "
                          "steps.train.trainer=ours, or hidden_states=offline")


def step_names(step: str, pipeline) -> list[str]:
    """The pipeline steps a job of `step` runs (`all`: the chain)."""
    if step == "all":
        names = chain(pipeline)
    elif step in STEPS:
        names = [step]
    else:
        raise ConfigError(f"unknown step {step!r} (choose from {', '.join(STEPS)}, all, exec)")
    refuse_online_file_trainer(names, pipeline)
    return names


def plan(step: str, pipeline, extra: list[str] | None = None, settings_path: str | None = None,
         gpus: int | None = None) -> list[Step]:
    """The commands a job runs, in order. `extra` (after --) is appended to the step's flags. With `settings_path`
    (the job's settings.json, see job_settings) each step reads its section from there instead of flags. `gpus`:
    the host's `gpus:`, for the launcher (launch_flags)."""
    extra = list(extra or [])
    if step == "exec":
        if not extra:
            raise ConfigError("`run exec` needs a command after --, e.g. kimi-eagle run exec -- nvidia-smi")
        return [Step("exec", extra, python=False)]
    if step == "all" and extra:
        raise ConfigError("`run all` takes no extra flags after --: set them in a recipe (steps: {STEP: {flag: value}}) "
                          "or as overrides, e.g. steps.train.warmup_steps=100")
    names = step_names(step, pipeline)
    steps = []
    if pipeline.tiny_model:
        model = str(expand(pipeline.model))
        # `--flag=value` wherever a value comes from the inventory: one starting with '-' is a value, not an option.
        steps.append(Step("tiny-model", [*module_argv("pipeline.tiny_model"), f"--kind={pipeline.tiny_model}", f"--out={model}"],
                          unless_exists=f"{model}/config.json"))
    elif pipeline.model_source:
        model = str(expand(pipeline.model))
        steps.append(Step("model", [*module_argv("pipeline.models"), f"--source={pipeline.model_source}", f"--out={model}"],
                          unless_exists=f"{model}/config.json"))
    refuse_output_flags(step, extra)
    given = extra_settings(names[0], extra)  # a typo or a bad value is refused here, before anything is rendered
    for n in names:
        if settings_path:
            args = ["--settings", settings_path]
            step_section(n, pipeline)  # a required setting that is missing is refused here, as without the file
        else:
            # Each flag once: what was typed after -- goes as typed, in place of the setting's own value.
            section = {k: v for k, v in step_section(n, pipeline).items() if k not in given}
            args = settings.section_to_argv(n, section)
        argv = [*module_argv(f"pipeline.{n}"), *args, *extra]
        if n in TORCHRUN_STEPS:
            argv = [*module_argv("pipeline.launch"), *launch_flags(n, pipeline, gpus), "--", *argv]
        steps.append(Step(n, argv))
    if step == "all":   # a run whose export vLLM cannot serve does not end as succeeded (eval --smoke)
        if "eval" in names:
            steps[-1].argv.append("--smoke")
        else:
            steps.append(smoke_step(pipeline))
    return steps


# eval's settings that belong to its held-out prompts: the smoke test alone serves its own few prompts.
HELD_OUT_KEYS = ("prompts", "num_prompts", "max_tokens")


def smoke_step(pipeline) -> Step:
    """eval's served smoke test alone, for a run with no held-out prompts: eval's section without them."""
    resolved = pipeline.model_dump()
    section = {k: v for k, v in settings.step_section("eval", resolved).items() if k not in HELD_OUT_KEYS}
    section = {k: str(expand(v)) if isinstance(v, str) else v for k, v in section.items()}
    return Step("smoke", [*module_argv("pipeline.eval"), *settings.section_to_argv("eval", section), "--smoke"])


def refuse_output_flags(step: str, extra: list[str]) -> None:
    """A step's outputs go where the job records them (output_dir): `clean` and `pull` find them by that record.
    `--output-dir`/`--out` after `--` (or an abbreviation argparse would take) would move them unrecorded."""
    moved = [a for a in extra if a.split("=", 1)[0].startswith("--out")]
    if moved:
        raise ConfigError(f"`run {step} -- {moved[0]}`: the output folder is a setting, not a step flag; set "
                          "output_dir=DIR (an override or `output_dir:` in the recipe), so that the job records it")


def job_settings(step: str, pipeline, extra: list[str] | None = None) -> dict:
    """A job's settings.json: every resolved pipeline setting and, per step it runs, the section that step reads
    (the flags typed after -- included: they win, as on the command line)."""
    names = step_names(step, pipeline)
    given = extra_settings(names[0], list(extra or []))
    doc = settings.settings_document(pipeline.model_dump(), [])
    doc["steps"] = {n: step_section(n, pipeline, given if n == names[0] else None) for n in names}
    return doc


def settings_path(job_id: str) -> str:
    """Where a job's settings.json is, relative to the workdir (the job runs there)."""
    return f"{RUNS}/{job_id}/settings.json"


def settings_file(step: str, host, extra: list[str], job_id: str) -> dict[str, str]:
    """{settings_path: text} for a pipeline job; {} for exec."""
    if step == "exec":
        return {}
    text = json.dumps(job_settings(step, host.pipeline, extra), indent=1, sort_keys=True)
    return {settings_path(job_id): text + "\n"}


def plan_for_host(step: str, host, extra: list[str] | None = None, job_id: str | None = None) -> list[Step]:
    """The plan, led (for pipeline steps) by the record of what the run used: the resolved settings, the versions
    on the host and ours, written by kimi_eagle_host.ops.provenance under {output_dir}/runs/<job-id>/ next to the
    outputs. With `job_id`, the steps read their settings from the job's settings.json (settings_file)."""
    from .. import __version__
    from .recipe import resolved_yaml

    steps = plan(step, host.pipeline, extra, settings_path(job_id) if job_id and step != "exec" else None, host.gpus)
    if step == "exec":
        return steps
    settings_yaml = resolved_yaml(host.pipeline, source=host.recipe_source, host=host.name)
    record = Step("record", [*module_argv("ops.provenance"), f"--output-dir={expand(host.pipeline.output_dir)}",
                             "--runs-dir", RUNS, "--product-version", __version__, f"--settings={settings_yaml}"])
    return [record, *steps]


def output_record(step: str, session, job_id: str) -> dict[str, str]:
    """What a pipeline job's start uploads next to its script: <runs>/<job>/output_dir (where its outputs are),
    written before the job starts, so `clean` (kimi_eagle_host.ops.clean, under the lock a start holds) never misses a
    job that has started and not yet recorded its folder. {path relative to the workdir: text}; {} for exec."""
    if step == "exec":
        return {}
    out = str(expand(session.host.pipeline.output_dir))
    path = out if out.startswith("/") else session.transport.abspath(out) if out.startswith("~") else session.path(out)
    return {f"{RUNS}/{job_id}/output_dir": path + "\n"}


def launch_flags(step: str, pipeline, gpus: int | None = None) -> list[str]:
    """The launcher's flags (kimi_eagle_host.pipeline.launch) from the inventory; what is not set there it finds out on
    the host. `gpus` (the host's `gpus:`) caps the GPUs the step may use there: without --gpus the launcher starts a
    worker on every GPU it sees (0 or unset: all of them, as the group layouts read it too)."""
    flags = ["--gpus", str(gpus)] if gpus else []
    if pipeline.nproc_per_node is not None:
        flags += ["--nproc-per-node", str(pipeline.nproc_per_node)]
    if step == "extract":
        flags += ["--gpus-per-replica", str(pipeline.gpus_per_replica)]
    return flags
