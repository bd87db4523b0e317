"""The step contract every payload follows (docs/CONTRACTS.md), in one place. Stdlib only.

- one JSON document on stdout: the result;
- human progress on stderr;
- exit 0 success, 1 the operation failed or was refused (the JSON says why), 2 bad usage or input
  (one line on stderr naming the file/field; nothing changed);
- every output file written atomically: a temporary name in the same folder, then os.replace.

Every entry point runs as a module (`python -m kimi_eagle_host.pipeline.train ...`) with the folder that holds
the package on PYTHONPATH, so it runs the same from a checkout, a wheel or a host.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import time


class BadInput(ValueError):
    """Exit 2: bad usage or input. The message names the file, flag or field."""


class Refused(RuntimeError):
    """Exit 1 without a traceback: the step declined to act (e.g. outputs of another run are in the way)."""


def log(msg: str, prefix: str = "") -> None:
    print(f"[{prefix}] {msg}" if prefix else msg, file=sys.stderr, flush=True)


def progress(iterable, total=None, desc=""):
    """tqdm on stderr when available (the controller renders tqdm bars), else the plain iterable.

    A bar driven by `update(n)` (extract, regenerate) also prints the machine-readable progress line of the step
    named by `desc` ("extract[vllm]" -> extract); `update(n, tokens=k)` adds the tokens/s figure."""
    try:
        from tqdm import tqdm
    except ImportError:
        return iterable if iterable is not None else _Counted(desc, total)

    class Bar(tqdm):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.points = _Counted(desc, total)

        def update(self, n=1, tokens=0):
            self.points.update(n, tokens)
            return super().update(n)

    return Bar(iterable, total=total, desc=desc, file=sys.stderr, dynamic_ncols=True, mininterval=0.5)


class _Counted:
    """Counts what a bar's updates report and prints them as progress lines."""

    def __init__(self, desc: str, total):
        self.step, self.total, self.done, self.tokens = desc.split("[")[0] or "progress", total, 0, 0
        self.t0 = time.monotonic()
        _progress_start.setdefault(self.step, (self.t0, 0))  # the ETA counts from the bar's start

    def update(self, n=1, tokens=0):
        self.done, self.tokens = self.done + n, self.tokens + tokens
        if self.total:
            rate = self.tokens / max(time.monotonic() - self.t0, 1e-9) if self.tokens else None
            progress_line(self.step, self.done, self.total, tok_s=rate)

    def close(self):
        pass


# The machine-readable progress line `kimi-eagle logs` turns into a bar (kimi_eagle/jobs/log_printer.py parses it):
#   @kimi-eagle-progress {"step": "train", "done": 40, "total": 100, "loss": 2.31, "acc": 0.41, "tok_s": 5400}
PROGRESS_MARK = "@kimi-eagle-progress "


_progress_start: dict = {}  # step -> (monotonic time, done) of its first progress point in this process
_progress_shown: dict = {}  # step -> monotonic time of the last line printed


def progress_line(step: str, done: int, total: int, *, every_s: float = 1.0, **metrics) -> None:
    """One progress point of a long step on stderr: done/total, the ETA (from this process's pace since its
    first point) and figures such as loss, acc (the acceptance signal: the draft's top-1 agreement at the first
    draft position) and tok_s. At most one line per `every_s` seconds besides the last; rank 0 only."""
    if os.environ.get("RANK", "0") != "0":
        return
    now = time.monotonic()
    t0, d0 = _progress_start.setdefault(step, (now, done))
    if done < total and now - _progress_shown.get(step, -1e9) < every_s:
        return
    _progress_shown[step] = now
    point = {"step": step, "done": int(done), "total": int(total)}
    if done > d0:
        point["eta_s"] = round((now - t0) / (done - d0) * max(total - done, 0), 1)
    point.update({k: (round(v, 4) if isinstance(v, float) else v) for k, v in metrics.items() if v is not None})
    print(PROGRESS_MARK + json.dumps(point), file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- atomic writes
def atomic_write_via(path: str, writer, mode: int | None = None, make_folder: bool = True) -> None:
    """Write `path` through `writer(tmp_path)`; readers see the old file or the whole new one, never a part.

    The temporary name is unique to this call (mkstemp), so concurrent writers of one path never mix bytes.
    make_folder=False: a missing folder is FileNotFoundError, not made (a folder someone removed stays removed).
    """
    d = os.path.dirname(os.path.abspath(path))
    if make_folder:
        os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=d)
    os.close(fd)
    try:
        writer(tmp)
        if mode is None:  # mkstemp makes 0600; give what a plain open() would (vLLM may run as another user)
            umask = os.umask(0)
            os.umask(umask)
            mode = 0o666 & ~umask
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write(path: str, data, mode: int | None = None, make_folder: bool = True) -> None:
    """Bytes or text (UTF-8), fsynced before the rename."""
    raw = data.encode("utf-8") if isinstance(data, str) else data

    def write(tmp):
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())

    atomic_write_via(path, write, mode, make_folder)


def atomic_write_json(path: str, obj, make_folder: bool = True) -> None:
    atomic_write(path, json.dumps(obj, indent=2, ensure_ascii=False) + "\n", make_folder=make_folder)


def atomic_save_npy(path: str, array) -> None:
    import io

    import numpy as np

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    atomic_write(path, buf.getvalue())


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def files_digest(folder: str, names) -> str:
    """16 hex digits of the named files' contents: the code behind an output that a later run may reuse."""
    h = hashlib.sha256()
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            h.update(f.read())
    return h.hexdigest()[:16]


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".gguf", ".json")
# model_fingerprint reads this many windows of this many bytes of each file, evenly spread from its first
# byte to its last: 1 MiB a file, so ~64 MiB for a Kimi-K2.5 folder, never the gigabytes.
FINGERPRINT_WINDOWS, FINGERPRINT_WINDOW = 16, 64 << 10


def model_fingerprint(model: str | None) -> str | None:
    """16 hex digits that change when a local model folder's config or weights do; None for a hub id.

    From each file's name, size and bytes sampled across it (a safetensors header and windows through its
    tensors), not its mtime: the same weights downloaded again, or copied to each node's own disk, are the
    same model, while weights rebuilt or trained in place differ in every window. The one change it can miss
    is a few tensors rewritten in place at the same size: for that, extract --overwrite, eval
    --no-reuse-baseline or another regenerate --output-dir."""
    if not model or not os.path.isdir(model):
        return None
    h = hashlib.sha256()
    for name in sorted(os.listdir(model)):
        path = os.path.join(model, name)
        if name.endswith(WEIGHT_SUFFIXES) and os.path.isfile(path):
            size = os.path.getsize(path)
            h.update(f"{name}\0{size}\n".encode())
            with open(path, "rb") as f:
                if size <= FINGERPRINT_WINDOWS * FINGERPRINT_WINDOW:
                    h.update(f.read())
                    continue
                last = size - FINGERPRINT_WINDOW
                for i in range(FINGERPRINT_WINDOWS):
                    f.seek(i * last // (FINGERPRINT_WINDOWS - 1))
                    h.update(f.read(FINGERPRINT_WINDOW))
    return h.hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- main
def emit(result, code: int) -> int:
    # Under torchrun every worker runs the step; rank 0 answers for all of them (one JSON document on
    # stdout), the others' results go to the log.
    rank = os.environ.get("RANK", "0")
    if rank == "0":
        print(json.dumps(result, ensure_ascii=False))
    else:
        print(f"[rank {rank}] result: {json.dumps(result, ensure_ascii=False)}", file=sys.stderr, flush=True)
    return code


def parse_step_args(step: str, argv=None, description: str | None = None, require=None):
    """A step's arguments, by the parser the settings schema builds (kimi_eagle_host/settings.py): its section of a
    job's settings.json (`--settings FILE`, written by the controller with the job) gives the values, checked as
    any setting is, and a flag given on the command line wins. `require(args)` may name what is still missing
    (usage error, exit 2)."""
    from kimi_eagle_host import settings

    parser = settings.build_parser(step, description)
    args = list(sys.argv[1:] if argv is None else argv)
    path = next((a.split("=", 1)[1] for a in args if a.startswith("--settings=")), None)
    if path is None and "--settings" in args[:-1]:
        path = args[args.index("--settings") + 1]
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                section = dict(json.load(f)["steps"][step])
        except (OSError, ValueError, KeyError, TypeError) as e:
            parser.error(f"--settings {path}: no settings for {step} there ({type(e).__name__}: {e})")
        try:  # a job rendered before a setting was renamed (backend -> engine) resumes with its old file
            for old in settings.renamed(section):
                log(f"--settings {path}: {old} is now {settings.RENAMED[old]}")
        except settings.SettingError as e:
            parser.error(f"--settings {path}: {e}")
        for action in parser._actions:
            if action.dest in section:
                try:
                    action.default = settings.check(settings.BY_STEP[step][action.dest], section[action.dest],
                                                    f"--settings {path}: {action.dest}")
                except settings.SettingError as e:
                    parser.error(str(e))
                action.required = False
    parsed = parser.parse_args(args)
    missing = require(parsed) if require else None
    if missing:
        parser.error(missing)
    return parsed


def run_step(step: str, fn, args, refused=()) -> int:
    """A step's main: fn(args) returns its result (or (result, exit code)).

    BadInput exits 2 with one line; Refused (and the classes in `refused`) exit 1 with one line; anything
    else exits 1 with its traceback in the log, since that is a bug or an environment failure to debug.
    """
    try:
        result = fn(args)
        result, code = result if isinstance(result, tuple) else (result, 0)
        return emit(result, code)
    except BadInput as e:
        print(f"{step}: {e}", file=sys.stderr)
        return emit({"ok": False, "step": step, "error": str(e), "kind": "usage"}, 2)
    except (Refused, *refused) as e:
        print(f"{step}: {e}", file=sys.stderr)
        return emit({"ok": False, "step": step, "error": str(e)}, 1)
    except Exception as e:  # noqa: BLE001 - the operation failed: keep the traceback in the log
        import traceback

        traceback.print_exc()
        return emit({"ok": False, "step": step, "error": f"{type(e).__name__}: {e}"}, 1)


def model_identity(model: str | None) -> str | None:
    """A target's identity in records that guard resumes: a local folder by its real path (so a relative
    path recorded from the workdir and an absolute one name the same model), a hub id as given."""
    if model and os.path.isdir(model):
        return os.path.realpath(model)
    return model


def settings_changed(old: dict, new: dict, keys) -> list[str]:
    """The keys whose recorded value differs from now. A record written before a key was recorded says
    nothing about it (an upgrade must not refuse its own earlier outputs); `model` compares identities."""
    changed = []
    for k in keys:
        if k not in old:
            continue
        before = model_identity(old[k]) if k == "model" else old[k]
        if before != new[k]:
            changed.append(k)
    return changed


def package_dir() -> str:
    """The kimi_eagle_host package's own folder (its data: sample_data/, patch_sets/)."""
    return os.path.dirname(os.path.abspath(__file__))


def payload_root() -> str:
    """The folder that holds the package (on a host, a payload set's <workdir>/.kimi-eagle/payloads/<digest>: what
    PYTHONPATH names)."""
    return os.path.dirname(package_dir())


def host_workdir() -> str | None:
    """<workdir> when these payloads were deployed to a payload set's folder, <workdir>/.kimi-eagle/payloads/<digest>,
    else None (a checkout, an installed package)."""
    payloads = os.path.dirname(payload_root())
    if os.path.basename(payloads) == "payloads" and os.path.basename(os.path.dirname(payloads)) == ".kimi-eagle":
        return os.path.dirname(os.path.dirname(payloads))
    return None


def host_runs_dir() -> str | None:
    """<workdir>/runs when these payloads were deployed to a host's workdir (host_workdir), else None."""
    workdir = host_workdir()
    return os.path.join(workdir, "runs") if workdir else None


# How many times the scheduler has started this job's script again (a Slurm requeue after a preemption): the
# Slurm batch script (templates/slurm_job.sbatch.j2) exports Slurm's SLURM_RESTART_COUNT under this name; 0 or
# unset on a job's first run and outside Slurm.
RESTART_ENV = "KIMI_EAGLE_RESTART_COUNT"


def restart_count() -> int:
    text = os.environ.get(RESTART_ENV, "").strip()
    return int(text) if text.isdigit() else 0


def job_headline(text: str) -> str | None:
    """Record a step's one-line result for `kimi-eagle status`/`logs` (<runs>/<job-id>/headline), when
    running inside a kimi-eagle job on a host; the last step of a chain to call it wins. Returns the path."""
    job_id, runs = os.environ.get("KIMI_EAGLE_JOB_ID"), host_runs_dir()
    if not job_id or not runs or os.sep in job_id or not os.path.isdir(os.path.join(runs, job_id)):
        return None
    path = os.path.join(runs, job_id, "headline")
    atomic_write(path, text.strip().splitlines()[0] + "\n" if text.strip() else "\n")
    return path


def stdout_for_result_only() -> None:
    """Send everything else that writes to file descriptor 1 to stderr, for good.

    Engines such as vLLM log to stdout, from this process and from the worker processes they spawn (which
    inherit fd 1), and keep logging at interpreter exit. After this call fd 1 is stderr, and sys.stdout is
    a new stream on the original stdout, so only the step's JSON result (printed by run_step) lands there.
    Call it before importing the engine."""
    if getattr(sys.stdout, "_kimi_eagle_result_only", False):
        return
    # vLLM binds its log handler to the sys.stdout of import time (ext://sys.stdout), which is the result
    # stream after this call: point it at stderr unless the user chose otherwise.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.stdout.flush()
    real = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = os.fdopen(real, "w", buffering=1, encoding="utf-8")
    sys.stdout._kimi_eagle_result_only = True  # type: ignore[attr-defined]
