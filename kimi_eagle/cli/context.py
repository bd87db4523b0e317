"""What every command module shares: the global options' state and the printing module. No commands here."""

from __future__ import annotations

from typing import Optional


class State:
    inventory_path: Optional[str] = None
    json: bool = False
    verbose: int = 0
    _inventory = None

    @property
    def inventory(self):
        if self._inventory is None:
            from .. import inventory

            self._inventory = inventory.load(self.inventory_path)
        return self._inventory


state = State()


def console_ui():
    """The printing module, imported on first use so that `--help` stays fast."""
    from .. import ui

    return ui
