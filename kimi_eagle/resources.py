"""Where the templates and the host package live: inside the wheel, or in the source tree."""

from __future__ import annotations

from functools import cache
from importlib.util import find_spec
from pathlib import Path

_PKG = Path(__file__).resolve().parent
# The code that runs on the hosts: a package of its own, shipped in the same wheel, uploaded as it is.
HOST_PACKAGE = "kimi_eagle_host"


@cache
def data_dir(name: str) -> Path:
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kimi-eagle installation is missing its {name}/ folder")


def templates_dir() -> Path:
    return data_dir("templates")


@cache
def host_package_dir() -> Path:
    """The kimi_eagle_host package's folder (found, not imported: the controller never runs host code)."""
    spec = find_spec(HOST_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"kimi-eagle installation is missing its {HOST_PACKAGE} package")
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def payloads_dir() -> Path:
    """The folder that holds the host package: its files go to <workdir>/.kimi-eagle/payloads/ under the same
    relative paths (kimi_eagle_host/...)."""
    return host_package_dir().parent


def payload_files() -> list[Path]:
    """Every file of the host package that travels to the host, in a stable order (caches excluded)."""
    root = host_package_dir()
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
    )
