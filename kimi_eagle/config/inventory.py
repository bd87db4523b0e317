"""inventory.yaml: hosts, groups and pipeline settings, validated before any host is contacted.

Every mistake becomes one ConfigError naming the file, the line (where YAML tells it),
the host and the field.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
import re
from typing import Annotated, Any, Literal, Optional

import yaml
from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model, field_validator,
                      model_validator)

from kimi_eagle_host import settings

from ..errors import ConfigError
from .yaml_files import read_config_text, read_yaml

DEFAULT_INVENTORY = Path(__file__).resolve().parent / "default_inventory.yaml"
EMBEDDED = "<embedded default>"


MAX_CONNECT_TIMEOUT_S = 3600.0
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")   # fullmatch: `$` would also take a name ending in a newline


def _no_bool(value):
    # YAML's `true` would otherwise pass as the number 1 (`port: true` meaning port 1).
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    return value


def _control_chars(text: str) -> str | None:
    """The first character of `text` that is not printable (newline, tab, escape, NUL…), as an escape."""
    for c in text:
        if not c.isprintable():
            return ascii(c)[1:-1]
    return None


def _printable(value):
    # A newline or escape in a name or path ends a shell comment, splits a log line or fools a terminal.
    if isinstance(value, str) and (bad := _control_chars(value)):
        raise ValueError(f"contains a control character ({bad})")
    return value


def _host_name(value):
    # An address or rendezvous address reaches ssh, torchrun and log lines: one printable token that no
    # program can take for an option (`-oProxyCommand=...` is a hostname to nobody).
    _printable(value)
    if isinstance(value, str):
        if not value:
            raise ValueError("is empty")
        if value.startswith("-"):
            raise ValueError("starts with '-' (it would reach ssh as an option)")
        if any(c.isspace() for c in value):
            raise ValueError("contains white space")
        # `user@host` and `host:port` work for fabric's small commands but reach OpenSSH (large uploads) and torchrun
        # as a host name: they go in their own fields. Two colons or more are an IPv6 address.
        if "@" in value:
            raise ValueError("contains '@': give the login name as `user:` and the host alone here")
        if value.count(":") == 1:
            raise ValueError("contains ':': give the port as `port:` (`rdzv_port:` for rdzv_address) and the host "
                             "alone here")
        _idna(value)
    return value


def _idna(value: str) -> None:
    # Every connection encodes the name as IDNA (socket, paramiko): `a..b` or a label past 63 characters fails
    # there as a UnicodeError at the first command; here it is the file's line and the field.
    try:
        value.encode("idna")
    except UnicodeError as e:
        reason = re.search(r"UnicodeError: (.*)\)$", str(e))
        raise ValueError(f"is not a host name ({reason.group(1) if reason else e}; the parts between dots are 1 to "
                         f"63 characters)") from None


def _given(value):
    # An empty value would not fall back to the default (only a missing one does): ssh gets `-i ''`, the
    # host runs `'' script.py`.
    _printable(value)
    if isinstance(value, str) and not value.strip():
        raise ValueError("is empty (leave the field out for the default)")
    return value


def _host_folder(value):
    # Every script cds into the workdir and the controller names paths under it from the host's home: a
    # relative one resolves against wherever a shell starts, so the job started and was then `lost`. `~user/`
    # is not one either: the scripts quote the path and only expand a leading `~/`.
    _given(value)
    if isinstance(value, str) and not (value.startswith("/") or value == "~" or value.startswith("~/")):
        raise ValueError("must be an absolute path (/...) or start with ~/ (the host's home)")
    return value


Number = Annotated[int, BeforeValidator(_no_bool)]
Real = Annotated[float, BeforeValidator(_no_bool)]
Text = Annotated[str, BeforeValidator(_printable)]
HostName = Annotated[str, BeforeValidator(_host_name)]
Given = Annotated[str, BeforeValidator(_given)]
HostFolder = Annotated[str, BeforeValidator(_host_folder)]


class _Strict(BaseModel):
    # protected_namespaces: pydantic < 2.10 warns on stderr for fields named model_* (model_source), which would
    # break bad input's one line
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def _checked_section(value, recipe: bool = False):
    # The values of a pipeline section as the settings schema holds them (kimi_eagle_host/settings.py): the one
    # check of every setting. parse() and recipe.load() run it first with the file's line; this is the backstop.
    if not isinstance(value, dict):
        return value
    try:
        return settings.check_section(dict(value), recipe=recipe)
    except settings.SettingError as e:
        raise ValueError(str(e)) from None


def _pipeline_model(name: str, doc: str, optional: bool) -> type[BaseModel]:
    """A pydantic model whose fields are the schema's pipeline settings (and `steps`): derived, so a new setting
    needs no second declaration. `optional`: every field unset by default (a host's override, a recipe)."""
    fields: dict[str, Any] = {s.name: (Any, None if optional else s.default) for s in settings.PIPELINE_SETTINGS}
    fields["steps"] = (Optional[dict], None) if optional else (dict, Field(default_factory=dict))
    return create_model(name, __base__=_Strict, __doc__=doc, __module__=__name__, **fields)


class Pipeline(_pipeline_model("_PipelineFields", "", optional=False)):
    """Settings of the pipeline steps (kimi_eagle_host/settings.py). Strings may use {workdir} and {payloads}."""

    @model_validator(mode="before")
    @classmethod
    def _check(cls, value):
        return _checked_section(value)


class PipelineOverride(_pipeline_model("_OverrideFields", "", optional=True)):
    """Per-host overrides: the same fields, all optional."""

    @model_validator(mode="before")
    @classmethod
    def _check(cls, value):
        return _checked_section(value)


# Values that go into `#SBATCH` lines and Slurm commands: Slurm's own syntax, never spaces or quotes.
_SLURM_SYNTAX = {
    "partition": (r"[A-Za-z0-9_.+\-\[\],]+", "a Slurm name (letters, digits, _ . + - , [ ])"),
    "account": (r"[A-Za-z0-9_.+\-]+", "a Slurm account name"),
    "qos": (r"[A-Za-z0-9_.+\-]+", "a Slurm QOS name"),
    "constraint": (r"[A-Za-z0-9_.+\-\[\],&|*]+", "a Slurm feature expression without spaces"),
    "gres": (r"[A-Za-z0-9_]+(:[A-Za-z0-9_.\-]+)?(:\d+)?(,[A-Za-z0-9_]+(:[A-Za-z0-9_.\-]+)?(:\d+)?)*",
             "a gres list like gpu:8 or gpu:h200:8"),
    "time_limit": (r"(\d+-)?\d+(:\d{1,2}){0,2}|UNLIMITED|INFINITE", "a Slurm time limit: MM, HH:MM:SS, D-HH:MM:SS or UNLIMITED"),
    "mem": (r"\d+[KMGT]?", "a memory size like 64G"),
}
_SBATCH_ARG = r"--[a-z][a-z0-9-]*(=[A-Za-z0-9_.:,+=%@/\-\[\]]+)?"
# sbatch flags the product sets itself (the log files, the job's directory, the array, the nodes) or that change
# what a submission means (--test-only submits nothing, --parsable/--wait change sbatch's answer), and the ones
# with a field of their own. sbatch accepts any unambiguous prefix of a long option (`--out=`), so those count too.
_MANAGED_SBATCH = {
    "output": None, "error": None, "input": None, "chdir": None, "workdir": None, "array": None, "job-name": None,
    "nodes": "slurm.nodes", "ntasks-per-node": None, "open-mode": None, "test-only": None, "parsable": None,
    "wait": None, "wrap": None, "partition": "slurm.partition", "account": "slurm.account", "qos": "slurm.qos",
    "constraint": "slurm.constraint", "time": "slurm.time_limit", "gres": "slurm.gres",
    "cpus-per-task": "slurm.cpus_per_task", "mem": "slurm.mem",
}


def _managed_sbatch_flag(arg: str) -> str | None:
    """The product-managed flag that `--name[=value]` sets (as sbatch would read it), or None."""
    name = arg[2:].split("=", 1)[0]
    hits = [m for m in _MANAGED_SBATCH if m == name or m.startswith(name)]
    return name if name in _MANAGED_SBATCH else (hits[0] if hits else None)


class SlurmSettings(_Strict):
    """How a job is submitted on a Slurm login node (`scheduler: slurm`)."""

    partition: str
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    gres: str | None = None  # per node, e.g. gpu:8 or gpu:h200:8
    time_limit: str | None = None
    nodes: int = Field(1, gt=0)  # nodes of a multi-node (torchrun) job
    cpus_per_task: int | None = Field(None, gt=0)
    mem: str | None = None
    array_parallelism: int | None = Field(None, gt=0)  # at most this many extraction shards at once (%N)
    shards: int = Field(1, gt=0)  # extraction: array tasks (ranks), one node each
    sbatch_args: list[str] = Field(default_factory=list)  # more flags, `--name=value` form only

    @field_validator(*_SLURM_SYNTAX)
    @classmethod
    def _syntax(cls, value, info):
        import re

        pattern, what = _SLURM_SYNTAX[info.field_name]
        if value is not None and not re.fullmatch(pattern, value):
            raise ValueError(f"not {what}")
        return value

    @field_validator("sbatch_args")
    @classmethod
    def _flags(cls, args: list[str]) -> list[str]:
        import re

        for a in args:
            if not re.fullmatch(_SBATCH_ARG, a):
                raise ValueError(f"{a!r} is not an sbatch flag of the form --name=value")
            if managed := _managed_sbatch_flag(a):
                field = _MANAGED_SBATCH[managed]
                raise ValueError(f"{a!r} sets --{managed}, which kimi-eagle manages"
                                 + (f"; use the field {field}" if field else ""))
        return args


class HostFields(_Strict):
    address: HostName | None = None  # hostname, IP or ~/.ssh/config alias; defaults to the host's name
    port: Number | None = Field(None, gt=0, lt=65536)
    user: Given | None = None
    identity_file: Given | None = None
    python: Given | None = None
    workdir: HostFolder | None = None
    env: dict[str, str] = Field(default_factory=dict)
    transport: Literal["ssh", "local"] | None = None
    known_hosts: Given | None = None
    # finite and at most an hour: inf or 1e300 overflowed the socket's deadline (OverflowError at the first connect)
    connect_timeout: Real | None = Field(None, gt=0, le=MAX_CONNECT_TIMEOUT_S, allow_inf_nan=False)
    pipeline: PipelineOverride | None = None
    # Several hosts and Slurm (how jobs are launched; see kimi_eagle/jobs/scheduler.py):
    scheduler: Literal["direct", "slurm"] | None = None  # direct: a detached process group; slurm: sbatch
    slurm: SlurmSettings | None = None
    gpus: int | None = Field(None, ge=0)  # GPUs used per host: shard weight and torchrun's processes per node
    rdzv_address: HostName | None = None  # how the other hosts of a group reach this one (default: address)
    # torchrun's c10d rendezvous port. Unset: a group's first host takes 29500 (layout.DEFAULT_RDZV_PORT); a
    # multi-node Slurm job takes a port free on its first node when it starts (two jobs may share that node).
    rdzv_port: int | None = Field(None, gt=0, lt=65536)

    @field_validator("env")
    @classmethod
    def _env_names(cls, env: dict[str, str]) -> dict[str, str]:
        for name, value in env.items():
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
            if "\x00" in value:
                # Values may hold newlines (quoted, they arrive intact); a NUL no environment can carry.
                raise ValueError(f"the value of {name} contains a NUL byte, which no environment variable can carry")
        return env


class InventoryFile(_Strict):
    defaults: HostFields = Field(default_factory=HostFields)
    hosts: dict[str, HostFields]
    groups: dict[str, list[str]] = Field(default_factory=dict)
    pipeline: Pipeline = Field(default_factory=Pipeline)


class Host(BaseModel):
    """A host with defaults applied: what the transports and commands use."""

    name: str
    address: str
    port: int | None
    user: str | None
    identity_file: str | None
    python: str
    workdir: str
    env: dict[str, str]
    transport: Literal["ssh", "local"]
    known_hosts: str | None
    connect_timeout: float
    pipeline: Pipeline
    scheduler: Literal["direct", "slurm"] = "direct"
    slurm: SlurmSettings | None = None
    gpus: int | None = None
    rdzv_address: str | None = None  # None: the address
    rdzv_port: int | None = None  # None: unset (HostFields.rdzv_port says what that means)
    recipe_source: str | None = None  # the recipe file and overrides over this host's pipeline, for the record


class Inventory:
    def __init__(self, path: str, data: InventoryFile, recipe: PipelineOverride | None = None,
                 recipe_source: str | None = None):
        self.path = path
        self.data = data
        self.recipe = recipe  # a recipe's settings, over every host's pipeline (recipe.py)
        self.recipe_source = recipe_source
        self.hosts: dict[str, Host] = {n: self._resolve(n, h) for n, h in data.hosts.items()}

    def _resolve(self, name: str, h: HostFields) -> Host:
        d = self.data.defaults
        pick = lambda field, default=None: (  # noqa: E731
            getattr(h, field) if getattr(h, field) is not None else getattr(d, field) if getattr(d, field) is not None else default
        )
        pipeline = self.data.pipeline.model_dump()
        for over in (d.pipeline, h.pipeline, self.recipe):
            if over is not None:
                given = over.model_dump(exclude_unset=True, include=set(PipelineOverride.model_fields))
                steps = {**pipeline.get("steps", {})}
                for step, flags in (given.pop("steps", None) or {}).items():  # flag by flag, not step by step
                    steps[step] = {**steps.get(step, {}), **flags}
                given["steps"] = steps
                # One way to build `model`: a level that picks one replaces the other one inherited.
                for mine, other in (("tiny_model", "model_source"), ("model_source", "tiny_model")):
                    if given.get(mine) and other not in given:
                        pipeline[other] = None
                pipeline.update(given)
        if pipeline.get("tiny_model") and pipeline.get("model_source"):
            raise ConfigError(f"{self.path}: host {name!r}: pipeline sets both tiny_model and model_source; "
                              f"set only one")
        known_hosts = pick("known_hosts")
        if known_hosts and not os.path.isabs(os.path.expanduser(known_hosts)) and self.path != EMBEDDED:
            known_hosts = str(Path(self.path).resolve().parent / known_hosts)
        address = pick("address", name)
        try:
            _host_name(address)  # the host's name stands in for a missing address: the same rules
        except ValueError as e:
            raise ConfigError(f"{self.path}: host {name!r}, field address: {e} (got {address!r})") from None
        return Host(
            name=name,
            address=address,
            port=pick("port"),
            user=pick("user"),
            identity_file=pick("identity_file"),
            python=pick("python", sys.executable if pick("transport", "ssh") == "local" else "python3"),
            workdir=pick("workdir", "~/eagle3-train"),
            env={**d.env, **h.env},
            transport=pick("transport", "ssh"),
            known_hosts=known_hosts,
            connect_timeout=pick("connect_timeout", 10.0),
            pipeline=Pipeline(**pipeline),
            scheduler=pick("scheduler", "direct"),
            slurm=pick("slurm"),
            gpus=pick("gpus"),
            rdzv_address=pick("rdzv_address"),
            rdzv_port=pick("rdzv_port"),
            recipe_source=self.recipe_source,
        )

    def sets(self, name: str, setting: str) -> bool:
        """Whether the inventory (its pipeline, its defaults, host `name`) or the recipe and overrides give this
        pipeline setting themselves: a value the user chose, not the schema's default."""
        levels = (self.data.pipeline, self.data.defaults.pipeline, self.data.hosts[name].pipeline, self.recipe)
        return any(lv is not None and setting in lv.model_dump(exclude_unset=True) for lv in levels)

    def with_recipe(self, recipe: PipelineOverride | None, source: str | None = None) -> "Inventory":
        """The same hosts with a recipe's settings over their pipeline (the recipe wins)."""
        return self if recipe is None else Inventory(self.path, self.data, recipe, source)

    def select(self, host: str | None = None, group: str | None = None) -> list[Host]:
        """Hosts named by --host/--group (a name may be a host or a group); all hosts when neither."""
        if host and group:
            raise ConfigError("give --host or --group, not both")
        name = host or group
        if name is None:
            return list(self.hosts.values())
        if name in self.hosts and not group:
            return [self.hosts[name]]
        if name in self.data.groups:
            return [self.hosts[m] for m in self.data.groups[name]]
        raise ConfigError(f"{self.path}: no host or group named {name!r} (hosts: {', '.join(self.hosts)})")

    def one(self, host: str | None) -> Host:
        """The single host a job command targets; the only host when the inventory has one."""
        if host is None:
            if len(self.hosts) == 1:
                return next(iter(self.hosts.values()))
            raise ConfigError(f"{self.path}: several hosts; name one with --host ({', '.join(self.hosts)})")
        hosts = self.select(host)
        if len(hosts) != 1:
            raise ConfigError(f"{host!r} is a group; this command takes one host")
        return hosts[0]


def default_path() -> str | None:
    """--inventory default: $KIMI_EAGLE_INVENTORY, else ./inventory.yaml, else the embedded default."""
    env = os.environ.get("KIMI_EAGLE_INVENTORY")
    if env:
        return env
    if Path("inventory.yaml").is_file():
        return "inventory.yaml"
    return None


def load(path: str | os.PathLike | None = None) -> Inventory:
    if path is None:
        path = default_path()
    if path is None:
        text, shown = DEFAULT_INVENTORY.read_text(), EMBEDDED
    else:
        shown = str(path)
        text = read_config_text(path, "inventory")
    return parse(text, shown)


def parse(text: str, shown: str) -> Inventory:
    raw, node = read_yaml(text, shown)
    if not isinstance(raw, dict):
        raise ConfigError(f"{shown}: the inventory must be a mapping with a 'hosts' section")
    refuse_duplicate_keys(shown, node)
    _refuse_bad_names(shown, node, raw)
    _check_pipelines(shown, node, raw)
    try:
        data = InventoryFile.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        raise ConfigError(describe_error(shown, node, err)) from None
    for group, members in data.groups.items():
        for m in members:
            if m not in data.hosts:
                line = line_of(node, ("groups", group))
                raise ConfigError(f"{shown}{line}: group {group!r} names unknown host {m!r}")
        if group in data.hosts:
            raise ConfigError(f"{shown}{line_of(node, ('groups', group))}: group {group!r} has the name of a host")
    _check_schedulers(shown, node, data)
    return Inventory(shown, data)


def _check_pipelines(shown: str, node, raw: dict) -> None:
    """Every `pipeline:` section (top level, defaults, each host) against the settings schema, before the
    inventory's own model: a bad value is one line with the file's line, the host and the field."""
    sections = [(("pipeline",), raw.get("pipeline"), None)]
    if isinstance(raw.get("defaults"), dict):
        sections.append((("defaults", "pipeline"), raw["defaults"].get("pipeline"), None))
    for name, h in (raw.get("hosts") or {}).items() if isinstance(raw.get("hosts"), dict) else ():
        if isinstance(h, dict):
            sections.append((("hosts", name, "pipeline"), h.get("pipeline"), name))
    for loc, section, host in sections:
        if isinstance(section, dict):
            check_settings(section, shown, node, loc, host)


def check_settings(section: dict, shown: str, node, loc: tuple, host: str | None = None, recipe: bool = False) -> dict:
    """One section of settings (a `pipeline:` section, a recipe) checked by the schema, old key names renamed in
    place with one line saying so; a bad value is a ConfigError naming the file, line, host and field."""
    where = f"host {host!r}, field " if host else "field "
    field_of = lambda path: ".".join(map(str, (*loc[2 if host else 0:], *path)))  # noqa: E731
    try:
        olds = settings.renamed(section)
        checked = settings.check_section(section, recipe=recipe)
    except settings.SettingError as e:
        back = {settings.RENAMED[o]: o for o in locals().get("olds", [])}
        path = (back.get(e.path[0], e.path[0]), *e.path[1:])  # a renamed key is shown where the file has it
        raise ConfigError(f"{shown}{line_of(node, (*loc, *path))}: {where}{field_of(path)}: {e.message}") from None
    for old in olds:  # only once the section is good: a bad file gets its one error line alone
        print(f"{shown}{line_of(node, (*loc, old))}: {where}{field_of((old,))} is renamed to "
              f"{settings.RENAMED[old]}; read as {settings.RENAMED[old]} (rename it to silence this note)",
              file=sys.stderr)
    return checked


def refuse_duplicate_keys(shown: str, node, path: tuple = ()) -> None:
    """YAML lets a later key silently replace an earlier one (a second host of the same name): refuse it."""
    if isinstance(node, yaml.MappingNode):
        first: dict = {}
        for k, v in node.value:
            key = k.value if isinstance(k, yaml.ScalarNode) else None
            if key is not None and key in first:
                what = f"host {key!r}" if path == ("hosts",) else f"group {key!r}" if path == ("groups",) else f"key {key!r}"
                inside = f" in {'.'.join(path)}" if path and path not in (("hosts",), ("groups",)) else ""
                raise ConfigError(f"{shown}:{k.start_mark.line + 1}: {what}{inside} is defined twice "
                                  f"(first at line {first[key]}); remove one")
            if key is not None:
                first[key] = k.start_mark.line + 1
            refuse_duplicate_keys(shown, v, path + (key,))
    elif isinstance(node, yaml.SequenceNode):
        for v in node.value:
            refuse_duplicate_keys(shown, v, path)


def _refuse_bad_names(shown: str, node, raw: dict) -> None:
    """Host and group names land in scripts, comments and log prefixes: printable text only."""
    for section, kind in (("hosts", "host"), ("groups", "group")):
        names = raw.get(section)
        if not isinstance(names, dict):
            continue
        for name, members in names.items():
            bad = _control_chars(str(name))
            if bad:
                raise ConfigError(f"{shown}{line_of(node, (section, name))}: {kind} name {name!r} contains a "
                                  f"control character ({bad})")
            for m in members if section == "groups" and isinstance(members, list) else []:
                if isinstance(m, str) and (bad := _control_chars(m)):
                    raise ConfigError(f"{shown}{line_of(node, (section, name))}: group {name!r} names host {m!r}, "
                                      f"which contains a control character ({bad})")


def _check_schedulers(shown: str, node, data: InventoryFile) -> None:
    """`scheduler: slurm` needs a `slurm:` section (here or in defaults), and a `slurm:` section needs the scheduler."""
    d = data.defaults
    for name, h in data.hosts.items():
        scheduler = h.scheduler or d.scheduler or "direct"
        has_slurm = (h.slurm or d.slurm) is not None
        if scheduler == "slurm" and not has_slurm:
            line = line_of(node, ("hosts", name, "scheduler"))
            raise ConfigError(f"{shown}{line}: host {name!r}, field slurm: required with scheduler: slurm (partition, ...)")
        if scheduler != "slurm" and h.slurm is not None:
            line = line_of(node, ("hosts", name, "slurm"))
            raise ConfigError(f"{shown}{line}: host {name!r}, field slurm: only used with scheduler: slurm")


def describe_error(shown: str, node, err: dict[str, Any]) -> str:
    loc = tuple(err["loc"])
    line = line_of(node, loc)
    where = ""
    if len(loc) >= 2 and loc[0] == "hosts":
        where = f"host {loc[1]!r}, field {'.'.join(map(str, loc[2:])) or '(host)'}"
    else:
        where = f"field {'.'.join(map(str, loc))}"
    msg = err["msg"].removeprefix("Value error, ")
    if err["type"] == "extra_forbidden":
        msg = "unknown key"
    elif err["type"] == "missing":
        msg = "required field is missing"
    value = err.get("input")
    shown_value = f" (got {value!r})" if err["type"] not in ("extra_forbidden", "missing") and not isinstance(value, dict) else ""
    return f"{shown}{line}: {where}: {msg}{shown_value}"


def line_of(node, loc: tuple) -> str:
    """':LINE' of the deepest YAML node on the path `loc`, or '' when unknown."""
    best = node
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = None
            for k, v in node.value:
                if k.value == str(key):
                    best, nxt = k, v
                    break
            if nxt is None:
                break
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = best = node.value[key]
        else:
            break
    return f":{best.start_mark.line + 1}" if best is not None else ""
