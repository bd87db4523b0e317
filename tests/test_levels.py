"""Every test file has its level in tests/levels.py, so `pytest -m unit|integration|e2e` leaves no test out."""

from __future__ import annotations

import re
from pathlib import Path

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
