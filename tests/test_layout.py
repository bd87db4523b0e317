"""The code's shape stays as documented: no import circles in the CLI, the host package never imports the controller
and never edits sys.path, ops payloads stay stdlib-only (checked by running them in tests/test_patch_engine.py)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

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
            if node.module or not node.level:  # `from . import x` imports the module x, not its package's code
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


HOST = REPO / "kimi_eagle_host"


def host_modules():
    """(path, dotted name of its package) of every module of the host package."""
    for path in sorted(HOST.rglob("*.py")):
        yield path, ".".join(("kimi_eagle_host", *path.relative_to(HOST).parent.parts))


def test_the_host_package_never_imports_the_controller():
    for path, package in host_modules():
        names = imports_of(path, package)
        assert not any(n == "kimi_eagle" or n.startswith("kimi_eagle.") for n in names), path


def test_the_host_package_never_edits_the_import_path():
    """It runs as `python -m kimi_eagle_host...` with its folder on PYTHONPATH; every import names the package, so
    no module reaches for sys.path (one that did could pick up a stale copy left on a host)."""
    found = [f"{path.relative_to(REPO)}:{n}" for path, _ in host_modules()
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"\bsys\.path\b", line)]
    assert not found, found


def test_the_host_package_imports_itself_by_its_name():
    """A bare `import step_runtime` works only with a folder put on sys.path by hand: every import of our own
    modules names kimi_eagle_host (or is relative)."""
    ours = {p.stem for p in HOST.rglob("*.py")} - {"__init__"}
    for path, package in host_modules():
        bare = {n.split(".")[0] for n in imports_of(path, package)} & ours
        assert not bare, f"{path.relative_to(REPO)} imports {sorted(bare)} by a bare name"


def test_no_host_module_imports_a_step():
    """Steps share pieces through modules of their own (data/, target/, training/, ...): importing a step for one
    of its pieces would load the whole step and tie the two steps together. Steps are entry points only."""
    pipeline = HOST / "pipeline"
    # a step runs itself by name: run_step("extract", ...) or, under torchrun, run_step_then_leave("train", ...)
    steps = {f"kimi_eagle_host.pipeline.{p.stem}" for p in pipeline.glob("*.py")
             if re.search(r'\brun_step(_then_leave)?\("', p.read_text())}
    assert {f"kimi_eagle_host.pipeline.{s}" for s in ("prepare", "extract", "vocab", "train", "regenerate", "eval")} <= steps
    for path, package in host_modules():
        own = f"{package}.{path.stem}"
        imported = {n for n in imports_of(path, package) if n in steps} - {own}
        assert not imported, f"{path.relative_to(REPO)} imports the step(s) {sorted(imported)}"


def test_no_pointers_to_what_does_not_ship():
    """Tracker numbers and the team's private notes mean nothing to a reader of the released code and docs."""
    import re

    pointer = re.compile(r"\b[Ii]ssues?[ -]?#?\d+\b|\(i\d{1,2}[a-z]?\)|" + "shared" + r"/reference")
    roots = ["kimi_eagle", "kimi_eagle_host", "templates", "docs", "bench", "tests", "recipes", ".ci"]
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


def test_each_host_rule_is_written_once():
    """Where nvidia-smi is, how big a model's stored weights are, and the default layer ids: each rule has one home
    in the host package (they were written two or three times, and the copies drifted)."""
    rules = {
        "where nvidia-smi is": (r'which\("nvidia-smi"\)|"/usr/(local/nvidia/)?bin/nvidia-smi"', "gpus.py"),
        "a model's stored weight bytes": (r'\["total_size"\]|get\("total_size"\)', "model_size.py"),
        "the default layer ids": (r"\bn // 2, n - 3\b", "target/model_layers.py"),
    }
    for rule, (pattern, home) in rules.items():
        places = sorted(str(path.relative_to(HOST)) for path, _ in host_modules() if re.search(pattern, path.read_text()))
        assert places == [home], f"{rule}: written in {places}, its home is {home}"


LONGEST = 80   # lines of a function, its decorators aside


def test_no_product_function_is_over_80_lines():
    """A function does one job and reads in one sitting: none of the controller or the host package is over 80
    lines (train's loop, its setup pieces, preflight's checks, gpu-reset's phases, eval's engine each have their
    own)."""
    long = []
    for path in sorted([*HOST.rglob("*.py"), *(REPO / "kimi_eagle").rglob("*.py")]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno + 1 > LONGEST:
                long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert not long, f"functions over {LONGEST} lines: {long}"


CONTROLLER = REPO / "kimi_eagle"
# The controller's wings, each importing only the ones before it (and the shared modules at the top level):
# a host and what runs on it never depend on how jobs or operations use them.
WINGS = ("hosts", "config", "jobs", "operations")


def controller_imports(root: Path = CONTROLLER) -> dict[str, set[str]]:
    """{module: the controller modules (of `root`'s package) it imports (at any depth of the code: lazy imports
    count)}."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(REPO).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = (path, name if path.name == "__init__.py" else name.rsplit(".", 1)[0])
    graph = {}
    for name, (path, package) in modules.items():
        found = set()
        for n in imports_of(path, package):
            while n not in modules and "." in n:  # `from .x import name`: the module x
                n = n.rsplit(".", 1)[0]
            if n in modules and n != name:
                found.add(n)
        graph[name] = found
    return graph


@pytest.mark.parametrize("root", [CONTROLLER, HOST], ids=["controller", "host"])
def test_no_import_circle(root):
    graph = controller_imports(root)
    done, path = set(), []

    def visit(m):
        if m in path:
            raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        path.append(m)
        for n in sorted(graph[m]):
            visit(n)
        path.pop()
        done.add(m)

    for m in sorted(graph):
        visit(m)


def test_a_wing_imports_only_the_wings_before_it():
    def wing(m):
        parts = m.split(".")
        return parts[1] if len(parts) > 2 and parts[1] in WINGS else None

    wrong = sorted(f"{a} imports {b}" for a, deps in controller_imports().items() for b in deps
                   if wing(a) and wing(b) and WINGS.index(wing(b)) > WINGS.index(wing(a)))
    assert not wrong, wrong
