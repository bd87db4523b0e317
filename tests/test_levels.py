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


def test_a_units_tests_run_on_one_worker_and_alone_last(tmp_path):
    """A real xdist run (2 workers) of a small suite under this scheduler: a file's tests share one worker and one
    module fixture, and ALONE's tests run on one worker once every other worker has stopped taking work (beside,
    at most, the last test another worker is finishing: in a full suite's run one ended after ALONE began). Under
    pytest 9.2 xdist's group marks stopped reaching the scheduler and each test was a unit of its own."""
    import subprocess
    import sys

    log = tmp_path / "log"
    suite = tmp_path / "suite"
    suite.mkdir()
    (suite / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS)!r})\nimport spread\n\n"
        "def pytest_xdist_make_scheduler(config, log):\n    return spread.make_scheduler(config, log)\n")
    record = (f"import os, time\n\ndef record(what):\n    with open({str(log)!r}, 'a') as f:\n"
              "        f.write(f\"{what} {os.environ['PYTEST_XDIST_WORKER']} {time.time()}\\n\")\n")
    alone = sorted(n for n in spread.ALONE if "::" not in n)[0]
    (suite / alone).write_text(record + "import pytest\n\n@pytest.fixture(scope='module')\ndef once():\n"
                               "    record('fixture')\n\n"
                               + "".join(f"def test_{i}(once):\n    record('alone')\n\n" for i in range(3)))
    for n in range(4):
        (suite / f"test_other{n}.py").write_text(
            record + "".join(f"@__import__('pytest').mark.parametrize('x', [1, 2])\ndef test_{i}(x):\n"
                             f"    time.sleep(0.2)\n    record('other{n}')\n\n" for i in range(2)))
    p = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                        "-p", "no:randomly", str(suite)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
    rows = [line.split() for line in log.read_text().splitlines()]
    by_unit: dict[str, set[str]] = {}
    for what, worker, _ in rows:
        by_unit.setdefault(what.replace("fixture", "alone"), set()).add(worker)
    assert all(len(workers) == 1 for workers in by_unit.values()), by_unit
    assert [what for what, _, _ in rows].count("fixture") == 1
    # ALONE starts once the other workers have stopped taking work: it may run beside the one test another worker
    # was finishing then (spread.make_scheduler), never beside a test started after it, nor after its own worker's
    first_alone = min(float(t) for what, _, t in rows if what in ("alone", "fixture"))
    (alone_worker,) = by_unit["alone"]
    late = [worker for what, worker, t in rows if what.startswith("other") and float(t) > first_alone]
    assert alone_worker not in late and len(late) == len(set(late)), rows
