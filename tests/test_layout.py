"""The code's shape stays as documented: no import circles in the CLI, payloads never import the controller,
ops payloads stay stdlib-only (checked by running them in tests/test_patch_engine.py)."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imports_of(path: Path, package: str) -> set[str]:
    """Absolute names of the modules `path` imports (relative imports resolved against `package`)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module
            out.add(mod)
            out |= {f"{mod}.{a.name}" for a in node.names}
    return out


def test_cli_command_modules_never_import_the_app():
    cli = REPO / "kimi_eagle" / "cli"
    for path in cli.glob("*.py"):
        if path.name in ("__init__.py", "app.py"):
            continue
        names = imports_of(path, "kimi_eagle.cli")
        assert not {"kimi_eagle.cli.app", "kimi_eagle.cli"} & names, f"{path.name} imports the app back"


def test_payloads_never_import_the_controller():
    for path in (REPO / "remote_payloads").rglob("*.py"):
        names = imports_of(path, "remote_payloads")
        assert not any(n == "kimi_eagle" or n.startswith("kimi_eagle.") for n in names), path
