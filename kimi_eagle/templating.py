"""One Jinja2 environment for every rendered script.

Values reach shell lines only through the `sh`, `sh_path`, `sh_join` and `sh_name` filters, shell
comments only through `comment` (a shell-quoted value may still carry a newline, which ends a comment), and
`#SBATCH` lines (read by sbatch, not a shell) only through `sbatch`; `finalize` refuses anything else at render
time, and tests/test_render_and_upload.py and tests/test_template_safety.py scan the templates for
interpolations that skip the filters.
"""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from . import __version__
from .errors import ConfigError
from .resources import templates_dir
from .shell import quote  # noqa: F401  (re-exported for callers)

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")   # fullmatch: `$` would also take a name ending in a newline


class Quoted(str):
    """A string that is already safe to place on a shell line."""


def sh(value) -> Quoted:
    return Quoted(quote(value))


def sh_path(value) -> Quoted:
    """Quote a path, keeping a leading ~/ meaning the host's home directory."""
    s = str(value)
    if s == "~":
        return Quoted('"$HOME"')
    if s.startswith("~/"):
        return Quoted('"$HOME"/' + quote(s[2:]))
    return Quoted(quote(s))


def sh_join(values) -> Quoted:
    return Quoted(" ".join(quote(v) for v in values))


def sh_name(value) -> Quoted:
    if not _NAME.fullmatch(str(value)):
        raise ConfigError(f"{value!r} is not a valid shell variable name")
    return Quoted(str(value))


def comment(value) -> Quoted:
    """A value for a `#` comment: printable, on one line. Anything a terminal or shell could read as a
    line end or a control sequence is written as a Python escape (`\\n`, `\\x1b`, `\\u2028`)."""
    s = str(value)
    return Quoted("".join(c if c.isprintable() else ascii(c)[1:-1] for c in s))


def sbatch(value) -> Quoted:
    """A value on an `#SBATCH` line: sbatch reads those itself (no shell), so the value must be one plain token."""
    s = str(value)
    if not s or not s.isprintable() or re.search(r"[\s'\"#\\$`;]", s):
        raise ConfigError(f"{s[:40]!r} cannot go on an #SBATCH line (spaces, quotes, #, $, ; are not allowed)")
    return Quoted(s)


def _finalize(value):
    if isinstance(value, Quoted):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    raise ConfigError(
        f"template bug: value {str(value)[:40]!r} reached a shell line without a quoting filter"
    )


@cache
def environment():
    import jinja2

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(str(templates_dir())),
        undefined=jinja2.StrictUndefined,
        autoescape=False,
        keep_trailing_newline=True,
        finalize=_finalize,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters.update(sh=sh, sh_path=sh_path, sh_join=sh_join, sh_name=sh_name, comment=comment, sbatch=sbatch)
    env.globals["version"] = Quoted(__version__)
    return env


def render(template: str, **context) -> str:
    import jinja2

    try:
        return environment().get_template(template).render(**context)
    except jinja2.UndefinedError as e:
        raise ConfigError(f"template {template}: {e}") from None


def write(out_dir: str | Path, files: dict[str, str]) -> list[Path]:
    """Write rendered files into a local folder (for `kimi-eagle render`)."""
    from .hosts.local_dest import prepare_folder, writing

    out = prepare_folder(out_dir, "--out")
    written = []
    for rel, text in files.items():
        p = out / rel
        with writing(out, "--out"):
            p.parent.mkdir(parents=True, exist_ok=True)
            p.write_text(text)
            if rel.endswith(".sh"):
                p.chmod(0o755)
        written.append(p)
    return written
