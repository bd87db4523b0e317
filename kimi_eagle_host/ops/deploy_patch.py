#!/usr/bin/env python3
"""Apply, check, diff or revert a data-driven patch set on an installed Python package.

Runs on the GPU host with the host's Python, stdlib only. It never imports the target
package: `importlib.metadata` gives the installed version and the file locations.

    python -m kimi_eagle_host.ops.deploy_patch --patch-set NAME|auto [--patch-dir DIR] [--state-dir DIR]
                                               [--check] [--diff] [--revert]
    python -m kimi_eagle_host.ops.deploy_patch --list [--patch-dir DIR]

Patch sets are JSON files in the package's `patch_sets/` (see docs/deploy-patch.md for
the format). `auto` picks the one set whose package is installed and whose version range
matches the installed version.

Pristine copies: the first apply stores each target's original bytes under
`<state-dir>/<package>-<version>/<relpath>.<sha256[:12]>.pristine`; the default state dir is
`<install location>/.kimi-eagle-pristine` (site-packages or the --target dir). Every apply
starts from that copy, so re-running is idempotent; `--revert` puts it back and deletes it.

Output (stdout, one JSON document):
    {"package", "version", "patch_set", "mode", "state_dir", "ok", "reason"?,
     "files": [{"path", "status", "reason", "sha256_before", "sha256_after", "diff"?}]}
File statuses: ok (already in the wanted state), changed, would-change (--check/--diff),
reverted, skipped (not applied: wrong version, or another file of the set failed), failed.

Exit codes: 0 every file ended in the wanted state (apply: patched; revert: pristine;
check/diff: nothing failing). 1 otherwise. A version outside the set's range is exit 1 with
`"ok": false` and every file `skipped`: the caller asked for a patch and none was applied,
so a deploy must not carry on as if it had been. 2 bad usage or a malformed patch-set file
(one line on stderr naming the file and field); nothing is changed in any failure case.

Test hooks (env KIMI_EAGLE_PATCH_FAULT): `compile` makes the last file of the set fail its
compile check; `swap` makes the swap phase fail after the first file has been replaced, so
the rollback of already-swapped files is exercised.
"""

from __future__ import annotations

import argparse
import base64
import difflib
import hashlib
import importlib.metadata
import json
import os
import py_compile
import re
import sys
import tempfile
from pathlib import Path

from kimi_eagle_host.step_runtime import BadInput, atomic_write
from kimi_eagle_host.versions import at_least, satisfies
from kimi_eagle_host.vllm_compat import NATIVE_FROM, vllm_install
from kimi_eagle_host.step_runtime import log as _log

DEFAULT_PATCH_DIR = Path(__file__).resolve().parent.parent / "patch_sets"
STATE_DIR_NAME = ".kimi-eagle-pristine"


def log(msg: str) -> None:
    _log(msg, "deploy_patch")


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# ---------------------------------------------------------------- versions
# PEP 440 as packaging reads it, stdlib only (kimi_eagle_host/versions.py): "0.4.0rc1" is not ">=0.4.0".
version_matches = satisfies


# ---------------------------------------------------------------- patch-set files
def _text(value, where: str) -> str:
    """A hunk text is a string or a list of lines (joined, each ending in a newline)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return "".join(line + "\n" for line in value)
    raise BadInput(f"{where}: must be a string or a list of strings")


def _nonempty_list(value, label: str) -> list:
    if not isinstance(value, list) or not value:
        raise BadInput(f"{label} must be a non-empty list")
    return value


def load_patch_set(path: Path) -> dict:
    where = str(path)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise BadInput(f"{where}: not readable JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadInput(f"{where}: top level must be an object")
    for key in ("name", "package", "versions", "marker"):
        if not isinstance(data.get(key), str) or not data[key]:
            raise BadInput(f"{where}: field '{key}' must be a non-empty string")
    try:
        version_matches("0", data["versions"])
    except ValueError as exc:
        raise BadInput(f"{where}: field 'versions': {exc}") from None
    if "\n" in data["marker"]:
        raise BadInput(f"{where}: field 'marker' must be one line")
    for i, f in enumerate(_nonempty_list(data.get("files"), f"{where}: field 'files'")):
        fw = f"{where}: files[{i}]"
        if not isinstance(f, dict) or not isinstance(f.get("path"), str) or not f["path"]:
            raise BadInput(f"{fw}.path must be a non-empty string")
        if Path(f["path"]).is_absolute() or ".." in Path(f["path"]).parts:
            raise BadInput(f"{fw}.path must be relative to the install location")
        for j, h in enumerate(_nonempty_list(f.get("hunks"), f"{fw}.hunks")):
            hw = f"{fw}.hunks[{j}]"
            if not isinstance(h, dict):
                raise BadInput(f"{hw} must be an object")
            if "old" in h:
                h["old"], h["new"] = _text(h["old"], hw + ".old"), _text(h.get("new"), hw + ".new")
                if not h["old"]:
                    raise BadInput(f"{hw}.old must not be empty")
            elif "anchor" in h:
                h["anchor"] = _text(h["anchor"], hw + ".anchor")
                keys = [k for k in ("insert_before", "insert_after") if k in h]
                if len(keys) != 1 or not h["anchor"]:
                    raise BadInput(f"{hw}: anchor needs exactly one of insert_before/insert_after")
                h[keys[0]] = _text(h[keys[0]], f"{hw}.{keys[0]}")
            else:
                raise BadInput(f"{hw}: needs 'old'+'new' or 'anchor'+'insert_before|insert_after'")
    data["_file"] = where
    return data


def all_patch_sets(patch_dir: Path) -> list[dict]:
    if not patch_dir.is_dir():
        raise BadInput(f"{patch_dir}: patch directory does not exist")
    sets = [load_patch_set(p) for p in sorted(patch_dir.glob("*.json"))]
    names = [s["name"] for s in sets]
    for n in names:
        if names.count(n) > 1:
            raise BadInput(f"{patch_dir}: field 'name': {n!r} is used by more than one file")
    return sets


def installed_version(package: str) -> str | None:
    try:
        return importlib.metadata.distribution(package).version
    except importlib.metadata.PackageNotFoundError:
        return None


# ---------------------------------------------------------------- applying hunks
class HunkMismatch(Exception):
    pass


def apply_hunks(text: str, hunks: list[dict], marker: str) -> str:
    """Apply hunks in order; each anchor/old block must occur exactly once."""
    for n, h in enumerate(hunks, 1):
        needle = h.get("old", h.get("anchor"))
        count = text.count(needle)
        if count != 1:
            first = needle.strip().splitlines()[0] if needle.strip() else ""
            note = f"; {h['note']}" if h.get("note") else ""
            raise HunkMismatch(
                f"upstream text does not match hunk {n} ({first!r} found {count} times, "
                f"expected once{note})")
        if "old" in h:
            text = text.replace(needle, h["new"], 1)
        elif "insert_before" in h:
            text = text.replace(needle, h["insert_before"] + needle, 1)
        else:
            text = text.replace(needle, needle + h["insert_after"], 1)
    # The marker line lets a human (and --revert) see the file is ours.
    if not text.endswith("\n"):
        text += "\n"
    return text + f"# {marker}\n"


# ---------------------------------------------------------------- one target file
class Target:
    """State of one file of the set: current bytes, pristine bytes, wanted output."""

    def __init__(self, rel: str, live: Path, store_dir: Path, record_hash: str | None):
        self.rel, self.live = rel, live
        self.store_dir = store_dir
        self.record_hash = record_hash  # sha256 hex from the wheel's RECORD, if any
        self.current = live.read_bytes() if live.is_file() else None
        self.pristine_path, self.pristine = self._find_pristine()
        self.new_pristine = False
        self.patched: bytes | None = None
        self.result = {"path": rel, "status": "ok", "reason": "",
                       "sha256_before": sha256(self.current) if self.current is not None else None,
                       "sha256_after": None}

    def _find_pristine(self):
        stem = Path(self.rel).name
        folder = (self.store_dir / self.rel).parent
        found = sorted(folder.glob(f"{glob_escape(stem)}.*.pristine")) if folder.is_dir() else []
        for p in found:
            data = p.read_bytes()
            # The name carries the hash: a truncated/garbled copy is never trusted.
            if p.name == f"{stem}.{sha256(data)[:12]}.pristine":
                return p, data
        return None, None

    def pristine_target(self) -> Path:
        return self.store_dir / f"{self.rel}.{sha256(self.pristine)[:12]}.pristine"

    def set(self, status: str, reason: str = "") -> None:
        self.result["status"], self.result["reason"] = status, reason


def glob_escape(name: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", name)


def record_hashes(dist) -> dict[str, str]:
    """rel path -> sha256 hex from the dist's RECORD (lets us spot pre-edited files)."""
    out = {}
    for f in dist.files or []:
        if f.hash and f.hash.mode == "sha256":
            raw = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4))
            out[str(f).replace("\\", "/")] = raw.hex()
    return out


def write_atomic(path: Path, data: bytes, mode: int | None) -> None:
    atomic_write(str(path), data, mode)


def drop_bytecode(path: Path) -> None:
    # A .pyc is validated by source mtime+size only; an edit within the same second that
    # keeps the size would be masked, so remove the cached bytecode of swapped files.
    cache = path.parent / "__pycache__"
    if cache.is_dir():
        for pyc in cache.glob(f"{glob_escape(path.stem)}.*.pyc"):
            try:
                pyc.unlink()
            except OSError:
                pass


def compile_check(data: bytes, rel: str, workdir: str) -> str | None:
    """py_compile the bytes (in a scratch dir); return the error text or None."""
    src = Path(workdir) / "check.py"
    src.write_bytes(data)
    try:
        py_compile.compile(str(src), cfile=str(src) + "c", dfile=rel, doraise=True)
    except py_compile.PyCompileError as exc:
        return str(exc.msg).strip().splitlines()[-1]
    return None


def swap_all(targets: list["Target"], fault: str) -> None:
    """Replace every live file by its wanted bytes; on any error put all of them back."""
    done: list[tuple[Target, bytes]] = []
    try:
        for t in targets:
            mode = t.live.stat().st_mode & 0o7777
            write_atomic(t.live, t.wanted, mode)
            done.append((t, t.current))
            drop_bytecode(t.live)
            if fault == "swap":
                raise OSError("induced swap fault (KIMI_EAGLE_PATCH_FAULT=swap)")
    except BaseException:
        for t, old in reversed(done):
            write_atomic(t.live, old, t.live.stat().st_mode & 0o7777)
            drop_bytecode(t.live)
        raise


# ---------------------------------------------------------------- when no set matches
def no_matching_set(sets: list[dict], mode: str) -> tuple[dict, int]:
    """No set covers what is installed. The patches fix speculators' vLLM hidden-state generator, which the
    pipeline runs only on vLLM < 0.18; from 0.18 it extracts through vLLM's own extract_hidden_states (and our
    connector), so nothing patched here would run: that is "not needed", exit 0. Below 0.18 it is a refusal."""
    found = {s["package"]: installed_version(s["package"]) for s in sets}
    covered = sorted({f"{s['package']}{s['versions']}" for s in sets})
    base = {"package": None, "version": None, "patch_set": None, "mode": mode, "files": []}
    vllm = vllm_install()
    if vllm and at_least(vllm["version"], NATIVE_FROM):
        what = ", ".join(f"{k} {v}" for k, v in found.items() if v) or "speculators (not installed)"
        return {**base, "ok": True, "not_needed": (
            f"nothing to patch: vLLM {vllm['version']} (>= {NATIVE_FROM}) extracts hidden states natively, so "
            f"speculators' generator, which the patch sets fix, does not run ({what}; sets cover {', '.join(covered)})")}, 0
    engine = f"vLLM {vllm['version']}" if vllm else "no vLLM installed"
    return {**base, "ok": False, "reason": (
        f"no patch set matches the installed versions {found} (sets cover {', '.join(covered)}; {engine}: "
        f"extraction through vLLM needs speculators' generator patched below vLLM {NATIVE_FROM})")}, 1


# ---------------------------------------------------------------- the run
def listed(s: dict) -> dict:
    """A patch set as --list shows it, with whether it matches the installed package."""
    have = installed_version(s["package"])
    return {"name": s["name"], "package": s["package"], "versions": s["versions"],
            "description": s.get("description", ""), "file": s["_file"], "files": [f["path"] for f in s["files"]],
            "installed": have, "matches_installed": have is not None and version_matches(have, s["versions"])}


def write_set(targets: list, to_write: list, mode: str) -> list:
    """Every patched file compiled first, then all of them swapped in (the originals kept on a first apply) or none:
    the targets that failed."""
    failed = []
    fault = os.environ.get("KIMI_EAGLE_PATCH_FAULT", "")
    with tempfile.TemporaryDirectory() as work:  # compile before touching anything
        for t in to_write:
            err = compile_check(t.wanted, t.rel, work)
            if fault == "compile" and t is to_write[-1]:
                err = "induced compile fault (KIMI_EAGLE_PATCH_FAULT=compile)"
            if err:
                t.set("failed", f"patched file does not compile: {err}")
                failed.append(t)
    if failed:
        return failed
    created = []
    try:
        if mode == "apply":
            for t in to_write:
                if t.pristine_path is None:  # first time: keep the original
                    t.pristine_path = t.pristine_target()
                    t.pristine_path.parent.mkdir(parents=True, exist_ok=True)
                    write_atomic(t.pristine_path, t.pristine, 0o444)
                    created.append(t.pristine_path)
        swap_all(to_write, fault)
    except OSError as exc:
        for p in created:
            p.unlink(missing_ok=True)
        for t in to_write:
            t.set("failed", f"swap failed, every file of the set restored: {exc}")
        return to_write
    if mode == "revert":
        for t in targets:
            forget_pristine(t)
    return []


def run(args) -> tuple[dict, int]:
    patch_dir = Path(args.patch_dir)
    sets = all_patch_sets(patch_dir)
    if args.list:
        return {"patch_sets": [listed(s) for s in sets], "ok": True}, 0

    mode = "revert" if args.revert else "diff" if args.diff else "check" if args.check else "apply"
    if args.patch_set == "auto":
        hits = [s for s in sets if (v := installed_version(s["package"])) and version_matches(v, s["versions"])]
        if len(hits) > 1:
            raise BadInput(f"{patch_dir}: field 'versions': sets {[s['name'] for s in hits]} all match")
        if not hits:
            return no_matching_set(sets, mode)
        pset = hits[0]
    else:
        by_name = {s["name"]: s for s in sets}
        by_name.update({Path(s["_file"]).stem: s for s in sets})
        if args.patch_set not in by_name:
            raise BadInput(f"--patch-set: unknown patch set {args.patch_set!r} "
                             f"(available: {sorted(s['name'] for s in sets)})")
        pset = by_name[args.patch_set]

    package = pset["package"]
    doc = {"package": package, "version": None, "patch_set": pset["name"], "mode": mode,
           "state_dir": None, "files": [], "ok": False}
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        doc["files"] = [{"path": f["path"], "status": "failed", "reason": f"{package} is not installed",
                         "sha256_before": None, "sha256_after": None} for f in pset["files"]]
        return doc, 1
    version = doc["version"] = dist.version
    root = Path(dist.locate_file("")).resolve()
    state_dir = Path(args.state_dir) if args.state_dir else root / STATE_DIR_NAME
    doc["state_dir"] = str(state_dir)
    store_dir = state_dir / f"{package}-{version}"
    hold_lock(state_dir, exclusive=mode in ("apply", "revert"))  # until release_lock() at the end of main

    if not version_matches(version, pset["versions"]):
        reason = f"installed {package} {version} is outside the set's range {pset['versions']}"
        log(reason)
        doc["reason"] = reason
        doc["files"] = [{"path": f["path"], "status": "skipped", "reason": reason,
                         "sha256_before": None, "sha256_after": None} for f in pset["files"]]
        return doc, 1

    record = record_hashes(dist)
    targets = []
    for f in pset["files"]:
        t = Target(f["path"], Path(dist.locate_file(f["path"])), store_dir, record.get(f["path"]))
        t.hunks = f["hunks"]
        targets.append(t)
    log(f"{pset['name']}: {package} {version} at {root}, mode {mode}")

    for t in targets:
        plan_target(t, pset["marker"], mode)

    failed = [t for t in targets if t.result["status"] == "failed"]
    to_write = [t for t in targets if t.result["status"] in ("changed", "reverted")]

    if mode in ("apply", "revert") and not failed and to_write:
        failed = write_set(targets, to_write, mode)
    if mode == "revert" and not failed:
        for t in targets:
            if t.result["status"] == "ok":
                forget_pristine(t)

    if failed:
        # A failure changes nothing: whatever else was planned was not written.
        for t in targets:
            if t.result["status"] in ("changed", "reverted"):
                t.set("skipped", "not written: another file of the set failed")
    for t in targets:
        t.result["sha256_after"] = sha256(t.live.read_bytes()) if t.live.is_file() else None
        log(f"{t.rel}: {t.result['status']} {t.result['reason']}".rstrip())
    doc["files"] = [t.result for t in targets]
    doc["ok"] = not failed
    return doc, 0 if doc["ok"] else 1


def forget_pristine(t: Target) -> None:
    if t.pristine_path is not None and t.pristine_path.exists():
        t.pristine_path.unlink()
        # prune now-empty folders of the state tree
        parent = t.pristine_path.parent
        while parent != t.store_dir.parent and parent.exists() and not any(parent.iterdir()):
            parent.rmdir()
            parent = parent.parent


def plan_target(t: Target, marker: str, mode: str) -> None:
    """Decide the status of one file and the bytes it should end with (t.wanted)."""
    if t.current is None:
        return t.set("failed", f"target file {t.live} does not exist")
    first_time = t.pristine is None
    if first_time:
        if marker.encode() in t.current:
            return t.set("failed", "file carries the patch marker but its pristine copy is missing "
                                   f"from {t.store_dir}; reinstall the package to recover")
        if t.record_hash and t.record_hash != sha256(t.current):
            return t.set("failed", "file differs from the installed package's RECORD (hand-edited?); "
                                   "reinstall the package first")
        t.pristine = t.current
    try:
        t.patched = apply_hunks(t.pristine.decode("utf-8"), t.hunks, marker).encode("utf-8")
    except HunkMismatch as exc:
        if mode == "revert" and not first_time:
            t.patched = None  # revert still works from the pristine copy
        else:
            return t.set("failed", str(exc))
    if mode == "diff":
        t.result["diff"] = "".join(difflib.unified_diff(
            t.pristine.decode("utf-8").splitlines(True), t.patched.decode("utf-8").splitlines(True),
            f"a/{t.rel}", f"b/{t.rel}"))

    if mode == "revert":
        if first_time or t.current == t.pristine:
            return t.set("ok", "nothing to revert" if first_time else "already pristine")
        ours = t.current == t.patched if t.patched is not None else marker.encode() in t.current
        if not ours:
            return t.set("failed", f"file was edited after patching (sha256 {sha256(t.current)[:12]} is "
                                   "neither pristine nor our patched output); not reverting over it")
        t.wanted = t.pristine
        return t.set("reverted", f"restored pristine sha256 {sha256(t.pristine)[:12]}")

    if t.current == t.patched:
        return t.set("ok", "already patched")
    if t.current != t.pristine:
        return t.set("failed", f"file was hand-edited (sha256 {sha256(t.current)[:12]} is neither the "
                               f"pristine {sha256(t.pristine)[:12]} nor our patched output "
                               f"{sha256(t.patched)[:12]}); left untouched")
    t.wanted = t.patched
    if mode in ("check", "diff"):
        return t.set("would-change", "")
    t.set("changed", f"patched from pristine sha256 {sha256(t.pristine)[:12]}")


_HELD: list = []  # (lock path, descriptor), held until release_lock()


def hold_lock(state_dir: Path, exclusive: bool):
    """One deploy-patch at a time per install: a lock file beside the pristine copies, held until this process
    ends. Readers (--check/--diff) share it, so they never see a half-applied set; they create nothing."""
    import fcntl

    path = state_dir / ".lock"
    while True:
        try:
            if exclusive:
                state_dir.mkdir(parents=True, exist_ok=True)
                fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            else:
                fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None  # read-only mode before any apply, or an unwritable install (the apply reports that itself)
        kind = fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another deploy-patch on this install ({path})")
            fcntl.flock(fd, kind)
        try:
            if os.stat(path).st_ino == os.fstat(fd).st_ino:
                _HELD.append((path, fd, exclusive))
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)  # the holder before us removed the file (a full revert): lock the new one


def release_lock() -> None:
    """After a revert that left no pristine copy, the lock file is the last thing here: remove it and the folder,
    so a reverted install is byte-for-byte what it was. Done while still holding the lock (see hold_lock)."""
    for path, fd, exclusive in _HELD:
        state = path.parent
        if exclusive and state.is_dir() and not any(p.is_file() and p != path for p in state.rglob("*")):
            try:
                path.unlink()
                for d in sorted((p for p in state.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
                    d.rmdir()
                state.rmdir()
            except OSError:
                pass
        os.close(fd)
    _HELD.clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--patch-set", help="patch set name (or file stem), or 'auto'")
    ap.add_argument("--patch-dir", default=str(DEFAULT_PATCH_DIR), help="folder of patch-set JSON files")
    ap.add_argument("--state-dir", help=f"where pristine copies live (default <install dir>/{STATE_DIR_NAME})")
    ap.add_argument("--check", action="store_true", help="report would-change/ok, change nothing")
    ap.add_argument("--diff", action="store_true", help="like --check, plus the unified diff per file")
    ap.add_argument("--revert", action="store_true", help="restore the pristine files")
    ap.add_argument("--list", action="store_true", help="list the available patch sets")
    try:
        args = ap.parse_args(argv)
    except SystemExit as exc:
        return int(exc.code or 0)
    try:
        if not args.list and not args.patch_set:
            raise BadInput("--patch-set: required (a name or 'auto'), or use --list")
        if args.revert and (args.check or args.diff):
            raise BadInput("--revert: cannot be combined with --check/--diff")
        try:
            doc, code = run(args)
        finally:
            release_lock()
    except BadInput as exc:
        print(f"deploy_patch: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(doc, indent=2))
    return code


if __name__ == "__main__":
    sys.exit(main())
