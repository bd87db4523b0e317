"""Every test file has its level in tests/levels.py, so `pytest -m unit|integration|e2e` leaves no test out."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import spread
from levels import E2E, E2E_MARKERS, EXCEPTIONS, FILES, LEVELS, MISFILED, UNIT, level_of

TESTS = Path(__file__).resolve().parent


def test_every_test_file_has_a_level():
    files = sorted(p.name for p in TESTS.glob("test_*.py"))
    missing = [name for name in files if name not in FILES]
    assert not missing, f"tests/levels.py gives no level to {missing}: add each to FILES (unit, integration or e2e)"
    gone = sorted(set(FILES) - set(files))
    assert not gone, f"tests/levels.py names test files that are gone: {gone}"
    assert set(FILES.values()) <= set(LEVELS)


def test_each_exception_names_a_test_of_its_file_and_another_level():
    for file_name, tests in EXCEPTIONS.items():
        text = (TESTS / file_name).read_text()
        for name, level in tests.items():
            assert re.search(rf"^(async )?def {name}\(", text, re.M), f"{file_name} has no test {name}"
            assert level in LEVELS and level != FILES[file_name], (file_name, name, level)


def test_the_slow_tiers_are_end_to_end_wherever_they_are():
    for marker in E2E_MARKERS:
        assert level_of("test_jobs.py", "test_any", {marker}) == E2E


def test_collected_tests_carry_their_level(request):
    assert request.node.get_closest_marker(UNIT) is not None


def test_no_unit_test_starts_the_sshd():
    assert not MISFILED, f"these start the sshd: give them `integration` in tests/levels.py's EXCEPTIONS: {MISFILED}"


def repeated_keys(source: str) -> list[str]:
    """`line N: KEY` for each key a dict display (or a tuple of names a comprehension spreads) of `source` holds
    twice: Python keeps the last silently, so a second row for one file would drop the first's exceptions."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            keys = [k for k in node.keys if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.DictComp) and isinstance(node.generators[0].iter, (ast.Tuple, ast.List)):
            keys = [k for k in node.generators[0].iter.elts if isinstance(k, ast.Constant)]
        else:
            continue
        seen = set()
        for k in keys:
            if k.value in seen:
                found.append(f"line {k.lineno}: {k.value}")
            seen.add(k.value)
    return found


def test_levels_names_each_file_and_each_exception_once():
    assert repeated_keys((TESTS / "levels.py").read_text()) == [], "tests/levels.py: a key given twice"
    twice = 'E = {\n "a.py": {"t": 1},\n "b.py": {n: 1 for n in ("t", "u", "t")},\n "a.py": {"v": 1}}\n'
    assert sorted(repeated_keys(twice)) == ["line 3: t", "line 4: a.py"]


def test_the_spread_tables_name_test_files_and_units():
    files = {p.name for p in TESTS.glob("test_*.py")}
    assert set(spread.GROUPS) <= files, set(spread.GROUPS) - files
    units = {spread.unit_of(name) for name in files}
    assert set(spread.SECONDS) <= units, set(spread.SECONDS) - units
    for name in spread.ALONE:
        file_name, _, function = name.partition("::")
        assert file_name in files and (not function or re.search(rf"^def {function}\(", (TESTS / file_name).read_text(),
                                                                  re.M)), name


def test_files_sharing_a_session_fixture_are_one_unit(request):
    """A session fixture is set up again on each worker that runs a test needing it: the files that share one (a
    trained draft, installed wheels) are one unit of work (tests/spread.py GROUPS), so it is set up once."""
    units: dict[str, set[str]] = {}
    for item in request.session.items:
        for name, defs in item._fixtureinfo.name2fixturedefs.items():
            d = defs[-1]
            if d.scope == "session" and name not in spread.CHEAP and Path(d.func.__code__.co_filename).parent == TESTS:
                units.setdefault(name, set()).add(spread.unit_of(str(item.fspath), item.originalname))
    assert {name: u for name, u in units.items() if len(u) > 1} == {}
