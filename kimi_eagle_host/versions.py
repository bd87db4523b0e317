"""Version comparison on the host, stdlib only (hosts need not have `packaging`): PEP 440 as `packaging` reads it.

    satisfies("0.16.0rc1", ">=0.16")        -> False  (a pre-release comes before its release)
    satisfies("0.16.0+cu130", ">=0.16,<0.17") -> True   (a local label is ignored against a public version)
    satisfies("0.17.0rc1", "<0.17")          -> False  (`<V` excludes V's own pre-releases)
    at_least("0.18.0", "0.18")               -> True

Pre-releases are compared, never filtered out (packaging's `prereleases=True`): the question here is where an
installed version lies. tests/test_versions.py checks these answers against packaging's on many pairs.
"""

from __future__ import annotations

import re

_VERSION = re.compile(
    r"^\s*v?(?:(?P<epoch>\d+)!)?(?P<release>\d+(?:\.\d+)*)"
    r"(?:[-_.]?(?P<pre_l>a|b|c|rc|alpha|beta|pre|preview)[-_.]?(?P<pre_n>\d+)?)?"
    r"(?:-(?P<post_n1>\d+)|[-_.]?(?P<post_l>post|rev|r)[-_.]?(?P<post_n2>\d+)?)?"
    r"(?:[-_.]?(?P<dev_l>dev)[-_.]?(?P<dev_n>\d+)?)?"
    r"(?:\+(?P<local>[a-z0-9]+(?:[-_.][a-z0-9]+)*))?\s*$",
    re.IGNORECASE,
)
_PRE = {"a": "a", "alpha": "a", "b": "b", "beta": "b", "c": "rc", "rc": "rc", "pre": "rc", "preview": "rc"}
_CLAUSE = re.compile(r"^\s*(===|~=|==|!=|<=|>=|<|>)\s*(\S+?)\s*$")


class Version:
    """A parsed version; ordered as PEP 440 orders them. Raises ValueError on what is not a version."""

    def __init__(self, text: str):
        m = _VERSION.match(str(text))
        if not m:
            raise ValueError(f"not a version: {text!r}")
        self.text = str(text).strip()
        self.epoch = int(m.group("epoch") or 0)
        self.release = tuple(int(x) for x in m.group("release").split("."))
        self.pre = (_PRE[m.group("pre_l").lower()], int(m.group("pre_n") or 0)) if m.group("pre_l") else None
        post = m.group("post_n1") or (m.group("post_n2") or "0" if m.group("post_l") else None)
        self.post = int(post) if post is not None else None
        self.dev = int(m.group("dev_n") or 0) if m.group("dev_l") else None
        local = m.group("local")
        self.local = tuple(int(p) if p.isdigit() else p.lower() for p in re.split(r"[-_.]", local)) if local else None

    @property
    def is_prerelease(self) -> bool:
        return self.pre is not None or self.dev is not None

    def replace(self, **parts) -> "Version":
        v = Version.__new__(Version)
        v.__dict__.update(self.__dict__, **parts)
        return v

    def public(self) -> "Version":
        return self.replace(local=None)

    def key(self) -> tuple:
        # dev-only releases sort before pre-releases, which sort before the release, then post-releases.
        if self.pre is None and self.post is None and self.dev is not None:
            pre = (-1,)
        elif self.pre is None:
            pre = (2,)
        else:
            pre = (1, {"a": 0, "b": 1, "rc": 2}[self.pre[0]], self.pre[1])
        post = (-1,) if self.post is None else (0, self.post)
        dev = (1,) if self.dev is None else (0, self.dev)
        # A local label sorts after the same public version; numbers after strings within a segment.
        local = () if self.local is None else tuple((1, p, "") if isinstance(p, int) else (0, 0, p) for p in self.local)
        return (self.epoch, _trim(self.release), pre, post, dev, (0,) if self.local is None else (1, local))

    def __lt__(self, other):
        return self.key() < other.key()

    def __le__(self, other):
        return self.key() <= other.key()

    def __gt__(self, other):
        return self.key() > other.key()

    def __ge__(self, other):
        return self.key() >= other.key()

    def __eq__(self, other):
        return isinstance(other, Version) and self.key() == other.key()

    def __hash__(self):
        return hash(self.key())

    def __repr__(self):
        return f"Version({self.text!r})"


def _trim(release: tuple) -> tuple:
    r = list(release)
    while len(r) > 1 and r[-1] == 0:
        r.pop()
    return tuple(r)


def _prefix_match(v: Version, spec_text: str) -> bool:
    """`==X.Y.*`: v's release starts with X.Y (its pre/post/dev parts do not matter)."""
    spec = Version(spec_text[:-2])
    n = len(spec.release)
    padded = v.release + (0,) * max(0, n - len(v.release))
    return v.epoch == spec.epoch and padded[:n] == spec.release


def _clause(v: Version, op: str, ref_text: str) -> bool:
    if op == "===":
        return v.text.lower() == ref_text.lower()
    if ref_text.endswith(".*"):
        if op not in ("==", "!="):
            raise ValueError(f"{op}{ref_text}: a wildcard goes only with == or !=")
        return _prefix_match(v, ref_text) == (op == "==")
    ref = Version(ref_text)
    if op == "~=":
        if len(ref.release) < 2:
            raise ValueError(f"~={ref_text}: needs at least two release numbers")
        prefix = ".".join(map(str, ref.release[:-1])) + ".*"
        if ref.epoch:
            prefix = f"{ref.epoch}!{prefix}"
        return v >= ref and _prefix_match(v, prefix)
    # Against a public version a candidate's local label is ignored (== and the ordered comparisons alike).
    cand = v.public() if ref.local is None else v
    if op == "==":
        return cand == ref
    if op == "!=":
        return cand != ref
    if op == "<=":
        return cand <= ref
    if op == ">=":
        return cand >= ref
    if op == "<":
        # <V excludes V's own pre-releases unless V is one: "<0.17" does not take 0.17.0rc1 (nor 0.17.dev0).
        if not v < ref:
            return False
        return ref.is_prerelease or not (v.is_prerelease and v >= ref.replace(dev=0, local=None))
    if op == ">":
        # >V excludes V's post-releases (unless V is one) and V with a local label: ">0.16" takes neither
        # 0.16.post1 nor 0.16+cu130.
        if not v > ref:
            return False
        if ref.post is None and v.post is not None and v.replace(post=None, dev=None, local=None) == ref:
            return False
        return not (v.local is not None and v.public() == ref)
    raise ValueError(f"unknown operator {op!r}")


def satisfies(version: str, spec: str) -> bool:
    """Whether `version` meets every clause of `spec` ("" is any version), e.g. ">=0.3.0,<0.4.0"."""
    v = Version(version)
    for clause in filter(None, (c.strip() for c in spec.split(","))):
        m = _CLAUSE.match(clause)
        if not m:
            raise ValueError(f"bad version clause {clause!r}")
        if not _clause(v, m.group(1), m.group(2)):
            return False
    return True


def at_least(version: str | None, minimum: str) -> bool:
    """`version >= minimum`; False for a missing or unreadable version."""
    try:
        return version is not None and satisfies(version, f">={minimum}")
    except ValueError:
        return False
