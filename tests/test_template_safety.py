"""Rendered scripts against hostile names: nothing a value carries may end a comment or a quote.

A host (or job, step) name with a newline once ended the `#` comment that named it and ran the rest as
commands. Two guards: the inventory refuses control characters in names, and the templates put values into
comments only through the `comment` filter (checked by scanning every template).
"""

from __future__ import annotations

import io
import re
import subprocess
import sys
import tokenize

import pytest

from conftest import REPO, make_env

EVIL_NAMES = ["evil\ntouch {marker}\n", "evil\rtouch {marker}", "e\u2028touch {marker}", "ev\x1b[2Jil\n#\ntouch {marker}"]


def _interpolations(source: str):
    """(lineno, last filter or None, in a comment?) for each {{ }}; in a comment when its line, up to it, is one."""
    from kimi_eagle.templating import environment

    env = environment()
    line_text, out, in_var, filters, prev = "", [], False, [], None
    for lineno, kind, value in env.lex(source):
        if kind == "data":
            tail = value.rsplit("\n", 1)
            line_text = tail[-1] if len(tail) > 1 else line_text + value
        elif kind == "variable_begin":
            in_var, filters, start = True, [], lineno
        elif in_var and kind == "name" and prev == "|":
            filters.append(value)
        elif kind == "variable_end":
            in_var = False
            in_comment = bool(re.match(r"^\s*#", line_text) or re.search(r"\s#", line_text))
            if re.match(r"^#SBATCH ", line_text):
                in_comment = "sbatch"  # a directive sbatch reads: its own filter
            out.append((start, filters[-1] if filters else None, in_comment))
            line_text += "{{…}}"
        prev = value if kind != "whitespace" else prev
    return out


def test_every_value_in_a_comment_goes_through_the_comment_filter():
    templates = sorted((REPO / "templates").glob("*.j2"))
    assert templates
    seen = 0
    for t in templates:
        for lineno, last_filter, in_comment in _interpolations(t.read_text()):
            if in_comment == "sbatch":
                assert last_filter == "sbatch", f"{t.name}:{lineno}: a value on an #SBATCH line must end with | sbatch"
            elif in_comment:
                seen += 1
                assert last_filter == "comment", f"{t.name}:{lineno}: a value in a shell comment must end with | comment"
            else:  # `comment` escapes for the eye, it does not quote for the shell
                assert last_filter != "comment", f"{t.name}:{lineno}: | comment outside a comment"
    assert seen  # the scanner really looks at comments (both templates name the host in one)


def test_scanner_catches_a_shell_quoted_value_in_a_comment():
    bad = "#!/bin/sh\n# host {{ host | sh }}\necho {{ x | sh }}\n"
    assert _interpolations(bad) == [(2, "sh", True), (3, "sh", False)]


def test_comment_filter_keeps_every_value_on_one_line():
    from kimi_eagle.templating import comment

    for name in EVIL_NAMES:
        text = str(comment(name.format(marker="/tmp/x")))
        assert text.isprintable() and "\n" not in text and "\r" not in text, repr(text)


def _host(tmp_path, name):
    from kimi_eagle.config.inventory import Host, Pipeline

    return Host(name=name, address="127.0.0.1", port=None, user=None, identity_file=None, python=sys.executable,
                workdir=str(tmp_path / "w"), env={}, transport="local", known_hosts=None, connect_timeout=5,
                pipeline=Pipeline())


@pytest.mark.parametrize("evil", EVIL_NAMES)
def test_a_host_name_with_a_newline_runs_nothing(tmp_path, evil):
    """Even past the inventory's own check (a Host built by a library caller), rendered scripts run nothing extra."""
    from kimi_eagle.jobs import direct
    from kimi_eagle.hosts.session import HostSession
    from kimi_eagle.hosts.transport.offline import Offline

    marker = tmp_path / "PWNED"
    h = _host(tmp_path, evil.format(marker=marker))
    session = HostSession(h, transport=Offline(h))
    scripts = [*session.render_payload("probe", "ops.probe", ["x"]).values(), direct.render_job(session, "exec", ["true"])[1]]
    for text in scripts:
        subprocess.run(["bash", "-n"], input=text, text=True, check=True)
        # Only the comment lines: running the whole job would start work; the lines before `set` are the header.
        header = "".join(ln for ln in text.splitlines(keepends=True) if not ln.strip() or ln.lstrip().startswith("#"))
        subprocess.run(["bash", "-c", header], check=False, cwd=tmp_path)
        subprocess.run(["bash", "-c", text.split("set -euo pipefail")[0]], check=False, cwd=tmp_path)
        assert not list(tmp_path.glob("PWNED*")), text


@pytest.mark.parametrize("evil", EVIL_NAMES[:2])
def test_inventory_refuses_control_characters_in_names(tmp_path, evil):
    marker = tmp_path / "PWNED"
    e = make_env(tmp_path, None)
    import json

    e.inventory.write_text(f"hosts:\n  {json.dumps(evil.format(marker=marker))}:\n    transport: local\n")
    r = e.cli("hosts", "check")
    assert r.code == 2, (r.stdout, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and "control character" in r.stderr, r.stderr
    assert not marker.exists()
