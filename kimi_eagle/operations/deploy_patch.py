"""deploy-patch: run kimi_eagle_host/ops/deploy_patch.py on hosts and read back what it did per file.

The engine and its patch-set JSON files travel with every payload deploy (HostSession.deploy_payloads);
this module only picks the engine's arguments, checks the patch-set name against the local copies of
the sets (the very files that get uploaded) before any host is contacted, and parses the engine's JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from ..errors import ConfigError
from ..hosts.parallel import HostOutcome, each_host
from ..hosts.session import HostSession, payload_set
from ..resources import host_package_dir, payload_files, payloads_dir

ENGINE = "ops.deploy_patch"  # the host half, a module of kimi_eagle_host
SETS_DIR = "patch_sets"  # in the host package
# The engine's files and what it imports, relative to the host package (for `render patch`).
ENGINE_FILES = ("__init__.py", "ops/__init__.py", "ops/deploy_patch.py", "step_runtime.py", "versions.py",
                "vllm_compat.py")
PAYLOAD_NAME = "patch"
MODES = ("apply", "check", "diff", "revert")
# Per mode, the file statuses that count as "ended in the wanted state".
GOOD = {
    "apply": {"changed", "ok"},
    "revert": {"reverted", "ok"},
    "check": {"would-change", "ok"},
    "diff": {"would-change", "ok"},
}


@dataclass
class FileResult:
    path: str
    status: str
    reason: str = ""
    sha256_before: str | None = None
    sha256_after: str | None = None
    diff: str | None = None

    @classmethod
    def from_json(cls, d: dict) -> "FileResult":
        return cls(
            path=str(d.get("path", "?")),
            status=str(d.get("status", "failed")),
            reason=str(d.get("reason") or ""),
            sha256_before=d.get("sha256_before"),
            sha256_after=d.get("sha256_after"),
            diff=d.get("diff"),
        )


@dataclass
class PatchResult:
    """What the engine reported for one host."""

    host: str
    mode: str
    exited: int
    package: str | None = None
    version: str | None = None
    patch_set: str | None = None
    state_dir: str | None = None
    reason: str = ""
    engine_ok: bool = False
    files: list[FileResult] = field(default_factory=list)
    not_needed: str = ""  # why nothing on this host needs the patch (then there are no files and that is ok)

    @property
    def ok(self) -> bool:
        """Every file ended in the wanted state (for check/diff: nothing failed or was skipped), or the host
        needs no patch at all."""
        if self.exited != 0 or not self.engine_ok:
            return False
        if self.not_needed and not self.files:
            return True
        return bool(self.files) and all(f.status in GOOD[self.mode] for f in self.files)

    def why_not(self) -> str:
        """The reason the run fell short, naming the file that failed first (files skipped because of another
        file's failure only echo that failure)."""
        bad = [f for f in self.files if f.status not in GOOD[self.mode]]
        bad.sort(key=lambda f: f.status != "failed")
        named = "; ".join(f"{f.path}: {f.reason}" for f in bad if f.status == "failed")
        return self.reason or named or next((f"{f.path}: {f.reason}" for f in bad), "")

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for f in self.files:
            out[f.status] = out.get(f.status, 0) + 1
        return out

    def to_dict(self) -> dict:
        d = asdict(self)
        d["ok"] = self.ok
        d["files"] = [{k: v for k, v in asdict(f).items() if k != "diff" or v is not None} for f in self.files]
        return d


def parse(host: str, mode: str, exited: int, data: dict) -> PatchResult:
    return PatchResult(
        host=host,
        mode=str(data.get("mode") or mode),
        exited=exited,
        package=data.get("package"),
        version=data.get("version"),
        patch_set=data.get("patch_set"),
        state_dir=data.get("state_dir"),
        reason=str(data.get("reason") or ""),
        engine_ok=bool(data.get("ok")),
        not_needed=str(data.get("not_needed") or ""),
        files=[FileResult.from_json(f) for f in data.get("files") or [] if isinstance(f, dict)],
    )


def engine_args(patch_set: str = "auto", mode: str = "apply") -> list[str]:
    if mode not in MODES:
        raise ConfigError(f"deploy-patch: unknown mode {mode!r} (choose from {', '.join(MODES)})")
    args = ["--patch-set", patch_set]
    if mode != "apply":
        args.append(f"--{mode}")
    return args


def available_sets() -> list[str]:
    """Names of the patch sets that travel with the payloads (file stems are accepted too)."""
    names = []
    for f in sorted((host_package_dir() / SETS_DIR).glob("*.json")):
        try:
            name = json.loads(f.read_text()).get("name")
        except (OSError, ValueError, AttributeError):
            name = None  # a malformed set: the engine names the file and field when it reads it
        names.append(name if isinstance(name, str) and name else f.stem)
    return names


def check_patch_set(patch_set: str) -> None:
    """Refuse an unknown set name before any host is contacted (exit 2)."""
    if patch_set == "auto":
        return
    folder = host_package_dir() / SETS_DIR
    known = set(available_sets()) | {f.stem for f in folder.glob("*.json")}
    if patch_set not in known:
        raise ConfigError(
            f"--patch-set: unknown patch set {patch_set!r} (available: auto, {', '.join(available_sets())})"
        )


def deploy(hosts, patch_set: str = "auto", mode: str = "apply") -> list[HostOutcome]:
    """Apply/check/diff/revert a patch set on every host in parallel. Outcome values are PatchResult."""
    args = engine_args(patch_set, mode)
    check_patch_set(patch_set)

    def one(session: HostSession) -> PatchResult:
        res = session.run_payload(PAYLOAD_NAME, ENGINE, args)
        return parse(session.name, mode, res.exited, res.data)

    return each_host(hosts, one)


def succeeded(outcome: HostOutcome) -> bool:
    return outcome.ok and outcome.value is not None and outcome.value.ok


# ---------------------------------------------------------------------------------------------- render
def upload_files() -> dict[str, str]:
    """The engine and the patch sets exactly as they land on the host, keyed by path under the workdir."""
    package, root = host_package_dir(), payloads_dir()
    out = {}
    for f in payload_files():
        rel = f.relative_to(package).as_posix()
        if rel in ENGINE_FILES or (rel.startswith(f"{SETS_DIR}/") and rel.endswith(".json")):
            out[f"{payload_set().folder}/{f.relative_to(root).as_posix()}"] = f.read_text()
    return out


def render_files(session: HostSession, step=None, patch_set: str = "auto", mode: str = "apply") -> dict[str, str]:
    """For `kimi-eagle render patch`: the wrapper script plus the files it runs. Never connects."""
    if step is not None:
        raise ConfigError(f"render patch: takes no STEP (got {step!r})")
    return {**session.render_payload(PAYLOAD_NAME, ENGINE, engine_args(patch_set, mode)), **upload_files()}
