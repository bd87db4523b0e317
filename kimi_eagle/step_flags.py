"""Every flag of every pipeline step's script, declared once, so a typo is refused here before anything runs.

The steps (kimi_eagle_host/pipeline/*.py) parse their own flags with argparse on the host; this table is
what the controller knows of them. tests/test_step_flags.py reads each script's argparse and fails when the two
differ, so they cannot drift apart: a flag added to a step is added here too.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

from .errors import ConfigError


@dataclass(frozen=True)
class Flag:
    kind: str  # text | int | float | choice | switch (no value: store_true) | toggle (--x / --no-x)
    choices: tuple[str, ...] = ()

    def check(self, value: str) -> str | None:
        """Why `value` is not acceptable, or None."""
        try:
            if self.kind == "int":
                int(value)
            elif self.kind == "float":
                float(value)
        except ValueError:
            return f"expects {'an integer' if self.kind == 'int' else 'a number'}"
        if self.kind == "choice" and value not in self.choices:
            return f"expects one of {', '.join(self.choices)}"
        return None

    @property
    def takes_value(self) -> bool:
        return self.kind not in ("switch", "toggle")


TEXT, INT, FLOAT, SWITCH, TOGGLE = Flag("text"), Flag("int"), Flag("float"), Flag("switch"), Flag("toggle")


def choice(*values) -> Flag:
    return Flag("choice", tuple(str(v) for v in values))


DEVICE = choice("auto", "cpu", "cuda")
DTYPE = choice("auto", "float32", "bfloat16")
ENGINE = choice("auto", "vllm", "hf")
REPORT_TO = TEXT  # comma list of tensorboard, wandb, trackio, mlflow, none, auto (checked by the step and the recipe)

# step -> {flag: kind}. Aliases are separate entries (eval's -k).
STEP_FLAGS: dict[str, dict[str, Flag]] = {
    "regenerate": {
        "--model": TEXT, "--dataset": TEXT, "--output-dir": TEXT, "--out": TEXT, "--temperature": FLOAT,
        "--max-tokens": INT, "--max-prompts": INT, "--chunk-size": INT, "--rank": INT, "--world-size": INT,
        "--engine": ENGINE, "--seed": INT, "--batch-size": INT, "--device": DEVICE, "--dtype": DTYPE,
        "--vllm-dtype": TEXT, "--max-model-len": INT, "--tp-size": INT, "--enforce-eager": TOGGLE,
        "--max-turns": INT, "--long-prompts": choice("auto", "fail", "skip"),
    },
    "prepare": {
        "--model": TEXT, "--dataset": TEXT, "--output-dir": TEXT, "--out": TEXT, "--seq-len": INT,
        "--on-bad-row": choice("fail", "skip"), "--shard-size": INT, "--max-samples": INT,
    },
    "extract": {
        "--model": TEXT, "--output-dir": TEXT, "--prepared-dir": TEXT, "--out": TEXT, "--layer-ids": TEXT,
        "--backend": choice("hf", "vllm"), "--batch-size": INT, "--tp-size": INT, "--seq-len": INT,
        "--dtype": choice("auto", "float32", "bfloat16", "float16"), "--device": DEVICE, "--rank": INT,
        "--world-size": INT, "--validate": SWITCH, "--overwrite": SWITCH, "--no-early-stop": SWITCH,
        "--write-queue": INT, "--writers": INT,
    },
    "vocab": {
        "--model": TEXT, "--output-dir": TEXT, "--token-freq": TEXT, "--out": TEXT, "--draft-vocab-size": INT,
    },
    "train": {
        "--model": TEXT, "--output-dir": TEXT, "--epochs": FLOAT, "--lr": FLOAT, "--batch-size": INT,
        "--ttt-steps": INT, "--ttt-decay": FLOAT, "--device": DEVICE, "--dtype": DTYPE, "--resume": SWITCH,
        "--parallel": choice("auto", "ddp", "fsdp"), "--max-steps": INT, "--stop-at-step": INT, "--seed": INT,
        "--log-every": INT, "--save-every": INT, "--keep-checkpoints": INT,
        "--lr-schedule": choice("cosine", "linear", "constant"), "--warmup-steps": INT, "--weight-decay": FLOAT,
        "--tokens-per-step": INT, "--pack-len": INT, "--loader-workers": INT, "--optimizer": choice("adamw", "muon"),
        "--feature-noise": FLOAT, "--oov-positions": choice("mask", "keep"), "--holdout-fraction": FLOAT,
        "--eval-every": INT, "--attention": choice("auto", "flex", "math"), "--compile": choice("auto", "on", "off"),
        "--trainer": choice("ours", "speculators"),
        "--grad-clip": FLOAT, "--norm-before-residual": choice(0, 1), "--train-lm-head": SWITCH,
        "--draft-num-heads": INT, "--draft-num-kv-heads": INT, "--draft-intermediate-size": INT,
        "--export-embed-tokens": TOGGLE, "--embed-key": TEXT, "--norm-key": TEXT, "--lm-head-key": TEXT,
        "--report-to": REPORT_TO, "--tracking-dir": TEXT,
    },
    "eval": {
        "--model": TEXT, "--output-dir": TEXT, "--draft": TEXT, "--out": TEXT, "--prompts": TEXT,
        "--num-prompts": INT, "--max-tokens": INT, "--num-speculative-tokens": INT, "-k": INT, "--engine": ENGINE,
        "--device": DEVICE, "--dtype": DTYPE, "--threads": INT, "--vllm-dtype": TEXT, "--max-model-len": INT,
        "--tp-size": INT, "--enforce-eager": TOGGLE, "--report-to": REPORT_TO, "--tracking-dir": TEXT,
        "--max-turns": INT, "--batch-sizes": TEXT, "--timing-prompts": INT, "--max-batch": INT,
        "--reuse-baseline": TOGGLE, "--baseline-dir": TEXT, "--smoke": SWITCH,
    },
}


def _known(step: str, flag: str) -> Flag | None:
    flags = STEP_FLAGS[step]
    if flag in ("-h", "--help"):
        return SWITCH  # every step prints its own help
    if flag in flags:
        return flags[flag]
    if flag.startswith("--no-") and flags.get("--" + flag[5:]) == TOGGLE:
        return SWITCH  # the negative form of a toggle takes no value either
    return None


def _unknown(step: str, flag: str) -> ConfigError:
    names = list(STEP_FLAGS[step]) + [f"--no-{f[2:]}" for f, k in STEP_FLAGS[step].items() if k == TOGGLE]
    close = difflib.get_close_matches(flag, names, n=1)
    hint = f" (did you mean {close[0]}?)" if close else f" (see: {step}.py --help)"
    return ConfigError(f"step {step}: unknown flag {flag}{hint}")


def validate(step: str, argv: list[str]) -> None:
    """Refuse, in one line naming the flag and the step, any flag `step` does not take or a value of the wrong type."""
    if step not in STEP_FLAGS:
        return
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-") or token == "-":
            raise ConfigError(f"step {step}: unexpected argument {token!r} (its settings are flags: --name value)")
        flag, eq, value = token.partition("=")
        kind = _known(step, flag)
        if kind is None:
            raise _unknown(step, flag)
        if not kind.takes_value:
            if eq:
                raise ConfigError(f"step {step}: flag {flag} takes no value (got {token!r})")
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ConfigError(f"step {step}: flag {flag} needs a value")
            value = argv[i + 1]
            i += 1
        if (why := kind.check(value)) is not None:
            raise ConfigError(f"step {step}: flag {flag} {why} (got {value!r})")
        i += 1


def mapping_to_argv(step: str, settings: dict) -> list[str]:
    """A recipe's `steps: {STEP: {name: value}}` entry as the step's flags (validated): `true` turns a switch
    on, `false` leaves it off (a toggle: --no-NAME)."""
    if step not in STEP_FLAGS:
        raise ConfigError(f"steps: unknown step {step!r} (choose from {', '.join(STEP_FLAGS)})")
    argv: list[str] = []
    for name, value in settings.items():
        flag = "--" + str(name).replace("_", "-")
        kind = STEP_FLAGS[step].get(flag)
        if kind is None:
            raise _unknown(step, flag)
        if kind in (SWITCH, TOGGLE):
            if not isinstance(value, bool):
                raise ConfigError(f"step {step}: flag {flag} expects true or false (got {value!r})")
            argv += [flag] if value else ([f"--no-{flag[2:]}"] if kind == TOGGLE else [])
            continue
        if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
            raise ConfigError(f"step {step}: flag {flag} expects a single value (got {value!r})")
        argv += [flag, str(value)]
    validate(step, argv)
    return argv
