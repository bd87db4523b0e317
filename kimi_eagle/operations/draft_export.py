"""What a finished pipeline left on the host, told the way a user needs it: where, what, and what next."""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

from ..hosts.session import HostSession, expand
from ..shell import join

# Read on the host: the export's config and its files' sizes (stdlib only). A job that recorded its output folder
# (ops/provenance.py) is described from there, with the k its recorded settings gave.
_DESCRIBE = r"""
import json, os, re, sys
d, pointer, job = sys.argv[1], sys.argv[2], sys.argv[3]
k = None
try:
    with open(pointer) as f:
        out = f.read().strip()
    d = os.path.join(out, "draft", "export")
    with open(os.path.join(out, "runs", job, "recipe.yaml")) as f:
        m = re.search(r"^num_speculative_tokens: *(\d+) *$", f.read(), re.M)
    k = int(m.group(1)) if m else None
except OSError:
    pass
files = sorted((n, os.path.getsize(os.path.join(d, n))) for n in os.listdir(d) if os.path.isfile(os.path.join(d, n)))
try:
    config = json.load(open(os.path.join(d, "config.json")))
except (OSError, ValueError):
    config = {}
print(json.dumps({"path": d, "files": files, "config": config, "k": k}))
"""

PRODUCES = {"train": "draft/export", "choose": "draft/export", "all": "draft/export"}   # choose replaces it


@dataclass
class Export:
    host: str
    path: str  # absolute, on the host
    files: list[tuple[str, int]] = field(default_factory=list)
    config: dict = field(default_factory=dict)
    num_speculative_tokens: int = 3  # k: the run's setting, what eval measured

    @property
    def target(self) -> str | None:
        return ((self.config.get("speculators_config") or {}).get("verifier") or {}).get("name_or_path")

    def what(self) -> str:
        c = self.config
        size = sum(s for _, s in self.files)
        names = " + ".join(n for n, _ in self.files)
        kind = ", ".join(c.get("architectures") or ["draft"])
        return (f"{names} ({size / 2**20:.1f} MiB): {kind} in the speculators format, "
                f"draft vocabulary {c.get('draft_vocab_size')}, reads target layers {c.get('eagle_aux_hidden_state_layer_ids')}")

    def next_command(self) -> str:
        spec = json.dumps({"method": "eagle3", "model": self.path, "num_speculative_tokens": self.num_speculative_tokens})
        return f"vllm serve {join([self.target or '<target model>'])} --speculative-config {join([spec])}"


def export_path(session: HostSession) -> str:
    out = str(expand(session.host.pipeline.output_dir))
    root = session.transport.abspath(out) if out.startswith(("/", "~")) else session.path(out)
    return posixpath.normpath(posixpath.join(root, "draft", "export"))


def describe_export(session: HostSession, step: str, job_id: str | None = None) -> Export | None:
    """The draft a succeeded `train`/`all` job exported, or None (another step, or nothing there)."""
    if step not in PRODUCES:
        return None
    from ..hosts.session import RUNS
    from ..templating import sh_path

    pointer = session.path(f"{RUNS}/{job_id}/output_dir") if job_id else ""
    res = session.transport.run(f"{sh_path(session.host.python)} -c {join([_DESCRIBE, export_path(session), pointer, job_id or ''])}",
                                timeout=60)
    if res.exited != 0:
        return None
    data = json.loads(res.stdout.strip().splitlines()[-1])
    k = data.get("k") or session.host.pipeline.num_speculative_tokens
    return Export(session.name, posixpath.normpath(data["path"]), [tuple(f) for f in data["files"]], data["config"], k)
