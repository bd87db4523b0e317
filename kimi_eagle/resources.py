"""Where the templates and remote payloads live: inside the wheel, or in the source tree."""

from __future__ import annotations

from functools import cache
from pathlib import Path

_PKG = Path(__file__).resolve().parent


@cache
def data_dir(name: str) -> Path:
    for candidate in (_PKG / "_data" / name, _PKG.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"kimi-eagle installation is missing its {name}/ folder")


def templates_dir() -> Path:
    return data_dir("templates")


def payloads_dir() -> Path:
    return data_dir("remote_payloads")


def payload_files() -> list[Path]:
    """Every file that travels to the host, in a stable order (tests and caches excluded)."""
    root = payloads_dir()
    return sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")
    )
