"""Where train and eval send their metrics besides the log: `--report-to` tensorboard, wandb, trackio, mlflow,
none, or auto (tensorboard when the host's Python has it, else none). A comma list sends to several.

    tracker = open_tracker(args.report_to, tracking_dir(args.output_dir, args.tracking_dir), config=vars(args))
    tracker.log(step, {"train/loss": 1.23, "train/acc_0": 0.41})
    tracker.close()

One run per job: the run is named by the job's id (KIMI_EAGLE_JOB_ID), so a `run all` chain shows its train and
eval figures as one run. Only the process that logs (rank 0) opens a tracker; the others get a silent one.
A tracker that was asked for by name and is not installed is bad input (exit 2), said before any work starts.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the payload root: step_runtime
from step_runtime import BadInput, log  # noqa: E402

KNOWN = ("tensorboard", "wandb", "trackio", "mlflow")
PROJECT = os.environ.get("KIMI_EAGLE_PROJECT", "kimi-eagle")


def run_name() -> str:
    return os.environ.get("KIMI_EAGLE_JOB_ID") or time.strftime("run-%Y%m%d-%H%M%S")


def tracking_dir(output_dir: str, given: str | None = None) -> str:
    """Where file-based trackers write (tensorboard's event files): <output-dir>/tracking unless given."""
    return os.path.abspath(given or os.path.join(output_dir, "tracking"))


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def wanted(report_to: str) -> list[str]:
    """The trackers `report_to` names, checked: unknown or missing ones are BadInput."""
    names = [n.strip() for n in (report_to or "auto").split(",") if n.strip()]
    if names in (["none"], []):
        return []
    if names == ["auto"]:
        return ["tensorboard"] if _installed("tensorboard") else []
    for n in names:
        if n not in KNOWN:
            raise BadInput(f"--report-to {n}: not a tracker (choose from {', '.join(KNOWN)}, none, auto)")
        if not _installed(n):
            raise BadInput(f"--report-to {n}: the host's Python has no {n} (pip install {n}), or use report_to: none")
    return names


class _TensorBoard:
    def __init__(self, directory: str, name: str, config: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.path = os.path.join(directory, name)
        self.writer = SummaryWriter(log_dir=self.path)
        self.writer.add_text("settings", "\n".join(f"    {k}: {v}" for k, v in sorted(config.items())))

    def log(self, step, metrics):
        for k, v in metrics.items():
            self.writer.add_scalar(k, v, step)
        self.writer.flush()  # a user watching tensorboard sees each point as it comes

    def close(self):
        self.writer.close()


class _WandbLike:
    """wandb and trackio share this API (trackio mirrors wandb's)."""

    def __init__(self, module: str, directory: str, name: str, config: dict):
        import importlib

        self.lib = importlib.import_module(module)
        kwargs = {"dir": directory} if module == "wandb" else {}
        self.run = self.lib.init(project=PROJECT, name=name, config=config, **kwargs)

    def log(self, step, metrics):
        self.lib.log(dict(metrics), step=step)

    def close(self):
        self.lib.finish()


class _MLflow:
    def __init__(self, directory: str, name: str, config: dict):
        import mlflow

        self.lib = mlflow
        mlflow.set_experiment(PROJECT)
        self.run = mlflow.start_run(run_name=name)
        mlflow.log_params({k: str(v)[:500] for k, v in config.items()})

    def log(self, step, metrics):
        self.lib.log_metrics(dict(metrics), step=step)

    def close(self):
        self.lib.end_run()


class Tracker:
    """Sends each `log(step, metrics)` to every opened sink; a sink that breaks mid-run is dropped with one
    warning, never the training."""

    def __init__(self, sinks: list | None = None):
        self.sinks = list(sinks or [])

    def log(self, step: int, metrics: dict) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None}
        for s in list(self.sinks):
            try:
                s.log(int(step), clean)
            except Exception as e:  # noqa: BLE001 - a tracker's trouble must not end a training
                log(f"tracker {type(s).__name__} failed ({type(e).__name__}: {e}); not logging to it any more", "tracker")
                self.sinks.remove(s)

    def close(self) -> None:
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:  # noqa: BLE001
                log(f"tracker {type(s).__name__} did not close cleanly: {e}", "tracker")
        self.sinks = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def open_tracker(report_to: str, directory: str, *, config: dict | None = None, main: bool = True) -> Tracker:
    """The tracker for this process: the sinks `report_to` names (checked), or a silent one off rank 0."""
    names = wanted(report_to)
    if not main or not names:
        return Tracker()
    name, config = run_name(), {k: v for k, v in (config or {}).items() if isinstance(v, (str, int, float, bool))}
    sinks = []
    for n in names:
        if n == "tensorboard":
            sinks.append(_TensorBoard(directory, name, config))
            log(f"tensorboard: {sinks[-1].path} (tensorboard --logdir {directory})", "tracker")
        elif n == "mlflow":
            sinks.append(_MLflow(directory, name, config))
        else:
            sinks.append(_WandbLike(n, directory, name, config))
    return Tracker(sinks)
