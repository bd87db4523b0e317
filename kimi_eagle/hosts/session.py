"""A host plus its open transport: the library's unit of work for one command.

Knows the layout on the host (everything relative to the workdir) and how to deploy and run a payload: the
kimi_eagle_host package, uploaded to <workdir>/.kimi-eagle/payloads/<digest>/kimi_eagle_host/ and run as modules
(`python -m kimi_eagle_host.ops.probe`) with PYTHONPATH naming that <digest> folder.

One folder per payload set, named by its content: a job's script names the folder of the set it was rendered with,
so its later steps import that code even when another checkout (or an upgraded kimi-eagle) deploys its own set to
the same workdir meanwhile; they once all shared one folder and a running job picked up whatever was there last.
"""

from __future__ import annotations

import json
import posixpath
from dataclasses import dataclass, field
from functools import cache

from .. import templating
from ..errors import CommandError, ConfigError
from ..resources import HOST_PACKAGE, payload_files, payloads_dir
from . import stdin_payload, sync
from .transport import open_transport

STATE = ".kimi-eagle"
PAYLOADS = f"{STATE}/payloads"  # one folder per payload set (PayloadSet.folder); kimi_eagle_host.payload_sets
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

    {payloads} is the uploaded package's folder (in this command's payload set), so
    `{payloads}/sample_data/chat.jsonl` still names the bundled data (inventories written before the host code
    became a package keep working)."""
    if isinstance(value, str):
        value = value.replace("{workdir}", ".")
        if "{payloads}" in value:
            value = value.replace("{payloads}", f"{payload_set().folder}/{HOST_PACKAGE}")
    return value


@dataclass(frozen=True)
class PayloadSet:
    """The host package as this process deploys it: its files (in memory) and the digest that names its folder."""

    items: tuple
    digest: str

    @property
    def folder(self) -> str:
        """Where the set lies, relative to the workdir: what PYTHONPATH names."""
        return f"{PAYLOADS}/{self.digest[:16]}"


@cache
def payload_set() -> PayloadSet:
    """Read once per process, like the controller's own modules: the folder a job's script names (rendered before
    connecting) and the files deployed there are then the same set, even when the checkout is edited meanwhile."""
    items = [sync.Item(remote=i.remote, data=i.local.read_bytes(), mode=i.mode) for i in _payload_items()]
    return PayloadSet(tuple(items), _manifest(items))


class HostSession:
    """`read_only`: a dry run's session; it never uploads (deploy_payloads and upload_scripts refuse), and a payload
    the host lacks runs from the call's stdin instead (stdin_payload.py)."""

    def __init__(self, host, transport=None, *, read_only: bool = False):
        self.host = host
        self.transport = transport or open_transport(host)
        self.read_only = read_only
        self._deployed = None

    @property
    def name(self) -> str:
        return self.host.name

    @property
    def payloads(self) -> str:
        """The folder of this command's payload set, relative to the workdir (templates render it into PYTHONPATH)."""
        return payload_set().folder

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
        """Upload what the host lacks of this payload set into its own folder, then seal it (payload_sets.py): its
        MANIFEST written last says the set is whole; sets no deploy and no unfinished job has used for a week go."""
        self._refuse_writes("upload the host package")
        if self._deployed is None:
            ps = payload_set()
            report = sync.sync(self.transport, self.path(ps.folder), list(ps.items))
            self.transport.run(self._module_command("payload_sets", ["seal", ps.digest]), check=True,
                               what="seal the payload set")
            self._deployed = report
        return self._deployed

    def call(self, module: str, args: list[str], *, timeout: float | None = None):
        """Run a payload module (e.g. "ops.jobs") directly, in one round trip when the host already has this set.

        The command checks the set's MANIFEST first; where the set is missing or not whole (exit 222) it is deployed
        and the call repeated.
        """
        ps = payload_set()
        manifest = templating.quote(f"{ps.folder}/{MANIFEST}")
        whole = f"[ \"$(cat {manifest} 2>/dev/null)\" = {templating.quote(ps.digest)} ] || exit 222; "
        command = self._module_command(module, args, first=whole)
        if self._deployed is None:
            res = self.transport.run(command, timeout=timeout)
            if res.exited != 222:
                self._deployed = sync.SyncReport(self.name, self.path(ps.folder))
                return res
            if self.read_only:
                return self._call_from_stdin(module, args, timeout)
            self.deploy_payloads()
        return self.transport.run(command, timeout=timeout)

    def _module_command(self, module: str, args: list[str], first: str = "") -> str:
        """The shell line that runs `python -m kimi_eagle_host.<module> ARGS` from this payload set, in the workdir,
        with the inventory's env as every other payload and job gets it (a KIMI_EAGLE_MACHINE_DIR set there must
        reach the starts and cleans that take claims, not only preflight)."""
        return (f"{self._env_exports()}cd {templating.sh_path(self.host.workdir)} && {first}"
                f"{pythonpath_export(self.payloads)}; "
                f"exec {templating.sh_path(self.host.python)} {templating.sh_join([*module_argv(module), *args])}")

    def _env_exports(self) -> str:
        return "".join(f"export {templating.sh_name(k)}={templating.sh(v)}; " for k, v in self.host.env.items())

    def _call_from_stdin(self, module: str, args: list[str], timeout: float | None):
        """`module` run from the payload set sent on stdin (stdin_payload.py), writing nothing: in the workdir, or in
        / when there is none yet (nothing of ours can be there to read)."""
        ps = payload_set()
        argv = [ps.folder, f"{HOST_PACKAGE}.{module}", *[str(a) for a in args]]
        command = (f"{self._env_exports()}cd {templating.sh_path(self.host.workdir)} 2>/dev/null || cd /; "
                   f"exec {templating.sh_path(self.host.python)} -c {templating.sh(stdin_payload.BOOT)} "
                   f"{templating.sh_join(argv)}")
        return self.transport.run(command, stdin=stdin_payload.package_zip(ps.items, ps.digest), timeout=timeout)

    def _refuse_writes(self, what: str) -> None:
        if self.read_only:   # a bug of ours, never the user's input: a dry run must not write to the host
            raise RuntimeError(f"{self.name}: a read-only session (a dry run) was asked to {what}")

    def payload_wrapper(self, name: str, module: str) -> tuple[str, str]:
        """The wrapper that runs payload `module` with the host's env and Python: (path under the workdir, text).

        It takes the flags at run time ("$@") and is named by a digest of its text, so a file on the host is
        never rewritten with other contents: concurrent callers share it safely or use different ones."""
        import hashlib

        text = templating.render("payload.sh.j2", host=self.host.name, env=self.host.env, workdir=self.host.workdir,
                             python=self.host.python, argv=module_argv(module), payloads=self.payloads)
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


def pythonpath_export(folder: str) -> str:
    """The shell line, run in the workdir, that lets the host's Python import kimi_eagle_host from the payload set
    in `folder` (templates include it)."""
    return templating.render("_pythonpath.sh.j2", payloads=folder).strip()


def _payload_items() -> list[sync.Item]:
    """The host package's files as they land in a payload set's folder (kimi_eagle_host/...)."""
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
