"""A host plus its open transport: the library's unit of work for one command.

Knows the layout on the host (everything relative to the workdir) and how to deploy and run a payload: the
kimi_eagle_host package, uploaded to <workdir>/.kimi-eagle/payloads/kimi_eagle_host/ and run as modules
(`python -m kimi_eagle_host.ops.probe`) with PYTHONPATH naming <workdir>/.kimi-eagle/payloads.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field

from .. import templating
from ..errors import CommandError, ConfigError
from ..resources import HOST_PACKAGE, payload_files, payloads_dir
from . import stdin_payload, sync
from .transport import open_transport

STATE = ".kimi-eagle"
PAYLOADS = f"{STATE}/payloads"
BIN = f"{STATE}/bin"
RUNS = "runs"
MANIFEST = "MANIFEST"


def module_argv(module: str) -> list[str]:
    """How the host's Python runs one of our entry points: `-m kimi_eagle_host.<module>` (e.g. "ops.probe")."""
    return ["-m", f"{HOST_PACKAGE}.{module}"]


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


def expand(value):
    """Placeholders in pipeline settings: paths on the host, relative to the workdir (scripts cd there).

    {payloads} is the uploaded package's folder, so `{payloads}/sample_data/chat.jsonl` still names the bundled data
    (inventories written before the host code became a package keep working)."""
    if isinstance(value, str):
        return value.replace("{workdir}", ".").replace("{payloads}", f"{PAYLOADS}/{HOST_PACKAGE}")
    return value


class HostSession:
    """`read_only`: a dry run's session; it never uploads (deploy_payloads and upload_scripts refuse), and a payload
    the host lacks runs from the call's stdin instead (stdin_payload.py)."""

    def __init__(self, host, transport=None, *, read_only: bool = False):
        self.host = host
        self.transport = transport or open_transport(host)
        self.read_only = read_only
        self._deployed = None
        self._deployed_digest = None

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
        """Upload what changed in the kimi_eagle_host package, then record the set's digest in MANIFEST."""
        self._refuse_writes("upload the host package")
        if self._deployed is None:
            items = _payload_items()
            report = sync.sync(self.transport, self.path(PAYLOADS), items)
            self._deployed_digest = _manifest(items)
            sync.sync(self.transport, self.path(PAYLOADS), [sync.Item(remote=MANIFEST, data=self._deployed_digest.encode())])
            self._deployed = report
        return self._deployed

    def call(self, module: str, args: list[str], *, timeout: float | None = None):
        """Run a payload module (e.g. "ops.jobs") directly, in one round trip when the host already has this set.

        The command checks MANIFEST first; on a mismatch (exit 222) the set is deployed and the call repeated.
        """
        python = templating.sh_path(self.host.python)

        def command(digest: str) -> str:
            return (f"cd {templating.sh_path(self.host.workdir)} && "
                    f"[ \"$(cat {PAYLOADS}/{MANIFEST} 2>/dev/null)\" = {templating.quote(digest)} ] || exit 222; "
                    f"{pythonpath_export()}; exec {python} {templating.sh_join([*module_argv(module), *args])}")

        if self._deployed is None:
            digest = _manifest(_payload_items())
            res = self.transport.run(command(digest), timeout=timeout)
            if res.exited != 222:
                self._deployed, self._deployed_digest = sync.SyncReport(self.name, self.path(PAYLOADS)), digest
                return res
            if self.read_only:
                return self._call_from_stdin(module, args, timeout)
            self.deploy_payloads()
        # The digest of the set deployed, not one read before it: a checkout edited in between (a developer saving a
        # file while a command runs) would otherwise fail this call with a bare exit 222.
        return self.transport.run(command(self._deployed_digest), timeout=timeout)

    def _call_from_stdin(self, module: str, args: list[str], timeout: float | None):
        return self.transport.run(stdin_payload.command(workdir=self.host.workdir, python=self.host.python,
                                                        env=self.host.env, payloads=PAYLOADS, module=module,
                                                        args=[str(a) for a in args]),
                                  stdin=stdin_payload.package_zip(), timeout=timeout)

    def _refuse_writes(self, what: str) -> None:
        if self.read_only:   # a bug of ours, never the user's input: a dry run must not write to the host
            raise RuntimeError(f"{self.name}: a read-only session (a dry run) was asked to {what}")

    def payload_wrapper(self, name: str, module: str) -> tuple[str, str]:
        """The wrapper that runs payload `module` with the host's env and Python: (path under the workdir, text).

        It takes the flags at run time ("$@") and is named by a digest of its text, so a file on the host is
        never rewritten with other contents: concurrent callers share it safely or use different ones."""
        import hashlib

        text = templating.render("payload.sh.j2", host=self.host.name, env=self.host.env, workdir=self.host.workdir,
                             python=self.host.python, argv=module_argv(module), payloads=PAYLOADS)
        return f"{BIN}/{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.sh", text

    def render_payload(self, name: str, module: str, args: list[str]) -> dict[str, str]:
        """For `kimi-eagle render`: the wrapper as uploaded, plus `<name>.sh` that runs it with these flags."""
        rel, text = self.payload_wrapper(name, module)
        call = templating.render("payload_call.sh.j2", host=self.host.name, wrapper=posixpath.basename(rel),
                             args=[str(a) for a in args])
        return {rel: text, f"{BIN}/{name}.sh": call}

    def upload_scripts(self, files: dict[str, str]) -> sync.SyncReport:
        self._refuse_writes("upload scripts")
        items = [sync.Item(remote=rel, data=text.encode(), mode=0o755) for rel, text in files.items()]
        return sync.sync(self.transport, self.path(""), items)

    def run_payload(self, name: str, module: str, args: list[str], *, timeout: float | None = None) -> PayloadResult:
        """Deploy, upload the rendered wrapper, run it once, parse the JSON it prints. Read-only: the module runs
        from the deployed set where the host has it, else from stdin; nothing is uploaded."""
        if self.read_only:
            res = self._call_from_stdin(module, args, timeout)
        else:
            self.deploy_payloads()
            rel, text = self.payload_wrapper(name, module)
            self.upload_scripts({rel: text})
            res = self.transport.run(f"bash {templating.sh_join([self.path(rel), *args])}", timeout=timeout)
        data = _parse_json(res.stdout)
        if data is None:
            if res.exited == 2:
                raise ConfigError(f"{self.name}: {_last_line(res.stderr) or f'{module} refused its input'}", result=res)
            raise CommandError(
                f"{self.name}: {module} exited {res.exited} without a result: {_last_line(res.stderr) or _last_line(res.stdout)}",
                result=res,
            )
        return PayloadResult(self.name, name, res.exited, data, res.stderr)


def pythonpath_export() -> str:
    """The shell line, run in the workdir, that lets the host's Python import kimi_eagle_host (templates include it)."""
    return templating.render("_pythonpath.sh.j2", payloads=PAYLOADS).strip()


def _payload_items() -> list[sync.Item]:
    """The host package's files as they land under <workdir>/.kimi-eagle/payloads/ (kimi_eagle_host/...)."""
    return sync.tree_items(payloads_dir(), payload_files())


def _manifest(items) -> str:
    """One digest for the whole payload set: changes when any file's path, content or mode changes."""
    import hashlib

    h = hashlib.sha256()
    for i in sorted(items, key=lambda i: i.remote):
        h.update(f"{i.remote}\0{i.digest()}\0{i.mode:o}\n".encode())
    return h.hexdigest()


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
