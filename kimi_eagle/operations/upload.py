"""`kimi-eagle upload`: local files and folders to one or more hosts (see sync.py for the guarantees)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ConfigError
from ..hosts import sync
from ..hosts.parallel import each_host


def collect(paths: list[Path]) -> list[sync.Item]:
    items: list[sync.Item] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            files = sorted(f for f in p.rglob("*") if f.is_file())
            items += sync.tree_items(p.parent, files)
        elif p.is_file():
            items += sync.tree_items(p.parent, [p])
        else:
            raise ConfigError(f"{p}: no such file or folder")
    names = [i.remote for i in items]
    if len(set(names)) != len(names):
        raise ConfigError("two of the given paths would land on the same name on the host")
    return items


def upload(hosts, paths: list[Path], to: str):
    items = collect(paths)

    def one(session):
        root = to if to.startswith(("/", "~")) else session.path(to)
        return sync.sync(session.transport, root, items)

    return each_host(hosts, one)
