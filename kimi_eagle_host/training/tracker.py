"""Where train and eval send their metrics besides the log: `--report-to` tensorboard, wandb, trackio, mlflow,
none, or auto (tensorboard when the host's Python has it, else none). A comma list sends to several.

    tracker = open_tracker(args.report_to, tracking_dir(args.output_dir, args.tracking_dir), config=vars(args))
    tracker.log(step, {"train/loss": 1.23, "train/acc_0": 0.41})
    tracker.close()

One run per job: the run is named by the job's id (KIMI_EAGLE_JOB_ID), so a `run all` chain shows its train and
eval figures as one run. Only the process that logs (rank 0) opens a tracker; the others get a silent one.
A tracker that was asked for by name and is not installed is bad input (exit 2), said before any work starts.

Every tracker works on a host without a network, writing under <tracking dir>/<job> (what `kimi-eagle pull`
brings back), unless the host's environment names a server:
  tensorboard  event files in <tracking dir>/<job>
  wandb        online when the host has an API key (WANDB_API_KEY or `wandb login`) or WANDB_MODE says so, else
               offline into <tracking dir>/<job>/wandb (upload later with `wandb sync`)
  mlflow       MLFLOW_TRACKING_URI when set, else a file store in <tracking dir>/<job>/mlruns
  trackio      TRACKIO_DIR when set, else <tracking dir>/<job>/trackio (`trackio show` with TRACKIO_DIR there)
"""

from __future__ import annotations

import os
import time

from kimi_eagle_host.step_runtime import BadInput, log

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


def _wandb_has_key() -> bool:
    """An API key wandb would use: WANDB_API_KEY, or a `wandb login` entry in ~/.netrc."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    try:
        with open(os.path.expanduser(os.environ.get("NETRC") or "~/.netrc")) as f:
            return "api.wandb.ai" in f.read()
    except OSError:
        return False


class _WandbLike:
    """wandb and trackio share this API (trackio mirrors wandb's)."""

    def __init__(self, module: str, directory: str, name: str, config: dict):
        import importlib

        self.path = os.path.join(directory, name)
        os.makedirs(self.path, exist_ok=True)
        kwargs = {}
        if module == "wandb":
            kwargs["dir"] = self.path  # wandb writes <dir>/wandb/
            if not os.environ.get("WANDB_MODE") and not _wandb_has_key():
                kwargs["mode"] = "offline"  # never a login prompt in a detached job
                log(f"wandb: no API key on this host (WANDB_API_KEY or wandb login): logging offline to "
                    f"{self.path}/wandb; upload later with: wandb sync {self.path}/wandb/offline-run-*", "tracker")
        else:  # trackio reads its folder from the environment when imported
            if not os.environ.get("TRACKIO_DIR"):
                os.environ["TRACKIO_DIR"] = os.path.join(self.path, "trackio")
            log(f"trackio: {os.environ['TRACKIO_DIR']} (TRACKIO_DIR={os.environ['TRACKIO_DIR']} trackio show)", "tracker")
        self.lib = importlib.import_module(module)
        self.run = self.lib.init(project=PROJECT, name=name, config=config, **kwargs)

    def log(self, step, metrics):
        self.lib.log(dict(metrics), step=step)

    def close(self):
        self.lib.finish()


class _MLflow:
    def __init__(self, directory: str, name: str, config: dict):
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            # A local file store next to the outputs (mlflow 3 wants this said: MLFLOW_ALLOW_FILE_STORE).
            os.environ["MLFLOW_TRACKING_URI"] = "file:" + os.path.join(directory, name, "mlruns")
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        import mlflow

        self.lib = mlflow
        log(f"mlflow: {mlflow.get_tracking_uri()} (mlflow ui --backend-store-uri {mlflow.get_tracking_uri()})", "tracker")
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
