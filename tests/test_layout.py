"""The code's shape stays as documented: no import circles in the CLI, payloads never import the controller,
ops payloads stay stdlib-only (checked by running them in tests/test_patch_engine.py)."""

from __future__ import annotations

import ast
import re
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


def test_no_pipeline_module_imports_a_step():
    """Steps share pieces through modules of their own (prepared_data, hidden_state_files, hf_target, ...):
    importing a step for one of its pieces would load the whole step and tie the two steps together."""
    pipeline = REPO / "remote_payloads" / "pipeline"
    # a step runs itself by name: run_step("extract", ...) or, under torchrun, run_step_then_leave("train", ...)
    steps = {p.stem for p in pipeline.glob("*.py") if re.search(r'\brun_step(_then_leave)?\("', p.read_text())}
    assert {"prepare", "extract", "vocab", "train", "regenerate", "eval"} <= steps, steps
    for path in sorted(pipeline.glob("*.py")):
        imported = {n.split(".")[0] for n in imports_of(path, "remote_payloads.pipeline")}
        assert not (imported & steps) - {path.stem}, f"{path.name} imports the step(s) {sorted((imported & steps) - {path.stem})}"


def test_no_pointers_to_what_does_not_ship():
    """Tracker numbers and the team's private notes mean nothing to a reader of the released code and docs."""
    import re

    pointer = re.compile(r"\b[Ii]ssues?[ -]?#?\d+\b|\(i\d{1,2}[a-z]?\)|" + "shared" + r"/reference")
    roots = ["kimi_eagle", "remote_payloads", "templates", "docs", "bench", "tests", "recipes", ".ci"]
    files = [REPO / "README.md", REPO / "pyproject.toml"] + [
        p for r in roots for p in (REPO / r).rglob("*")
        if p.is_file() and "results" not in p.relative_to(REPO).parts and p.suffix not in (".pyc", ".png", ".gguf")]
    found = []
    for p in files:
        try:
            text = p.read_text()
        except UnicodeDecodeError:
            continue
        found += [f"{p.relative_to(REPO)}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)}" for m in pointer.finditer(text)]
    assert not found, "\n".join(found)
