"""The hosts' stdlib version comparison gives packaging's answers (PEP 440), pre-releases included, and the
controller and every host script compare versions through it or through packaging itself."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version as Reference

from conftest import REPO
from kimi_eagle_host import versions

VERSIONS = ["0.15.9", "0.16", "0.16.0", "0.16.0rc1", "0.16.0rc2+cu130", "0.16.0+cu130", "0.16.0.dev3", "0.16.0a1",
            "0.16.0b2", "0.16.0.post1", "0.16.1", "0.16.1.dev0", "0.17.0rc1", "0.17.0", "0.17", "0.18.0.dev0+g1234",
            "0.18.0", "0.25.1", "0.32.0", "1.0", "1.0.0.post2.dev1", "2!0.1", "0.3.0", "0.4.0rc1", "0.10.0",
            "0.9.9", "0.16.0-1", "0.16.0.RC1", "v0.16.0", "0.16.0+cpu.avx512", "0.16.0+cpu.1"]
SPECS = [">=0.16", ">=0.16,<0.17", "<0.17", "<=0.16", ">0.16", ">0.16.0", "==0.16", "==0.16.0", "!=0.16.0",
         "==0.16.*", "!=0.16.*", "~=0.16.0", "~=0.16", ">=0.16.0rc1", "<0.17.0rc1", ">=0.5", "<0.18", ">=0.3.0,<0.3.1",
         ">=0.4.0,<0.5", ">=0.12.0,<0.17", "==0.16.0+cu130", ">=0.16.0.dev0", ">0.16.0rc1", "", "<2!0", ">=1!0"]


@pytest.mark.parametrize("spec", SPECS)
def test_the_same_answer_as_packaging(spec):
    wrong = [(v, spec) for v in VERSIONS
             if versions.satisfies(v, spec) != SpecifierSet(spec, prereleases=True).contains(v)]
    assert not wrong, wrong


def test_the_same_order_as_packaging():
    for a, b in itertools.product(VERSIONS, repeat=2):
        assert (versions.Version(a) < versions.Version(b)) == (Reference(a) < Reference(b)), (a, b)
        assert (versions.Version(a) == versions.Version(b)) == (Reference(a) == Reference(b)), (a, b)


def test_what_the_issue_names():
    assert not versions.satisfies("0.16.0rc1", ">=0.16")
    assert versions.satisfies("0.16.0+cu130", ">=0.16,<0.17") and not versions.at_least("0.17.0rc1", "0.17")
    assert not versions.at_least(None, "0.5") and not versions.at_least("garbage", "0.5")
    with pytest.raises(ValueError):
        versions.satisfies("0.16", "=>0.16")


def test_host_scripts_compare_through_it():
    """No loose tuple comparison is left in the host scripts' version decisions; the ops scripts still run on a
    bare interpreter (-I -S: no site-packages, so no packaging)."""
    for path in (REPO / "kimi_eagle_host").rglob("*.py"):
        text = path.read_text()
        assert "def vtuple" not in text and "def parse_version" not in text and "def version_key" not in text, path
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from kimi_eagle_host import versions; "
            "print(versions.satisfies('0.16.0rc1', '>=0.16'))")
    out = subprocess.run([sys.executable, "-I", "-S", "-c", code, str(REPO)],
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
