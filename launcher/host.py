"""A host plus its open transport: the library's unit of work for one command.

Knows the layout on the host (everything relative to the workdir) and how to deploy and run a payload.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

from . import render, sync
from .errors import CommandError, ConfigError
from .resources import payload_files, payloads_dir
from .transport import open_transport

STATE = ".kimi-eagle"
PAYLOADS = f"{STATE}/payloads"
BIN = f"{STATE}/bin"
RUNS = "runs"


@dataclass
class PayloadResult:
    host: str
    name: str
    exited: int
    data: dict = field(default_factory=dict)
    stderr: str = ""

    @property
    def ok(self) -> bool:
        return self.exited == 0


def expand(value, workdir_rel: bool = True):
    """Placeholders in pipeline settings: paths on the host, relative to the workdir (scripts cd there)."""
    if isinstance(value, str):
        return value.replace("{workdir}", ".").replace("{payloads}", PAYLOADS)
    return value


class HostSession:
    def __init__(self, host, transport=None):
        self.host = host
        self.transport = transport or open_transport(host)
        self._deployed = None

    @property
    def name(self) -> str:
        return self.host.name

    def path(self, rel: str) -> str:
        """Absolute path on the host of something under the workdir."""
        return posixpath.join(self.transport.abspath(self.host.workdir), rel)

    def close(self):
        self.transport.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- payloads ---------------------------------------------------------
    def deploy_payloads(self) -> sync.SyncReport:
        if self._deployed is None:
            root = payloads_dir()
            self._deployed = sync.sync(self.transport, self.path(PAYLOADS), sync.tree_items(root, payload_files()))
        return self._deployed

    def render_payload(self, name: str, script: str, args: list[str]) -> tuple[str, str]:
        text = render.render(
            "payload.sh.j2",
            host=self.host.name,
            env=self.host.env,
            workdir=self.host.workdir,
            python=self.host.python,
            script=f"{PAYLOADS}/{script}",
            args=[str(a) for a in args],
        )
        return f"{BIN}/{name}.sh", text

    def upload_scripts(self, files: dict[str, str]) -> sync.SyncReport:
        items = [sync.Item(remote=rel, data=text.encode(), mode=0o755) for rel, text in files.items()]
        return sync.sync(self.transport, self.path(""), items)

    def run_payload(self, name: str, script: str, args: list[str], *, timeout: float | None = None) -> PayloadResult:
        """Deploy, upload the rendered wrapper, run it once, parse the JSON it prints."""
        self.deploy_payloads()
        rel, text = self.render_payload(name, script, args)
        self.upload_scripts({rel: text})
        res = self.transport.run(f"bash {render.quote(self.path(rel))}", timeout=timeout)
        data = _parse_json(res.stdout)
        if data is None:
            if res.exited == 2:
                raise ConfigError(f"{self.name}: {_last_line(res.stderr) or f'{script} refused its input'}", result=res)
            raise CommandError(
                f"{self.name}: {script} exited {res.exited} without a result: {_last_line(res.stderr) or _last_line(res.stdout)}",
                result=res,
            )
        return PayloadResult(self.name, name, res.exited, data, res.stderr)


def _last_line(text: str) -> str:
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def _parse_json(stdout: str):
    text = stdout.strip()
    if not text:
        return None
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # Tolerate chatter before the document: take the last line that parses.
        for line in reversed(text.splitlines()):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None
