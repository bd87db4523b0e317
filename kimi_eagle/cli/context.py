"""What every command module shares: the global options' state and the printing module. No commands here."""

from __future__ import annotations

from typing import Optional


class State:
    inventory_path: Optional[str] = None
    json: bool = False
    verbose: int = 0
    argv: Optional[list] = None  # the command line as given (to tell KEY=VALUE before `--` from flags after it)
    recipe_path: Optional[str] = None
    overrides: list = []
    _inventory = None

    @property
    def inventory(self):
        if self._inventory is None:
            from ..config import inventory, recipe

            found = inventory.load(self.inventory_path)
            loaded = recipe.load(self.recipe_path, self.overrides)
            self._inventory = found.with_recipe(loaded, recipe.source(self.recipe_path, self.overrides))
        return self._inventory

    @property
    def api(self):
        """The library the commands call (kimi_eagle.api), over the inventory (and recipe) of this command."""
        from ..api import Controller

        return Controller(self.inventory)

    def use_recipe(self, path: Optional[str], overrides: list) -> None:
        """`--recipe FILE` and KEY=VALUE overrides of a command; read with the inventory on first use."""
        self.recipe_path, self.overrides, self._inventory = path, list(overrides), None


state = State()


def split_extra(ctx, *, step_takes_command: bool = False) -> tuple[list[str], list[str]]:
    """A command's extra arguments: (KEY=VALUE overrides given before `--`, the flags given after it).

    Click hands both over as one list; the raw command line tells where `--` was. An option before `--` that
    the command does not know is a usage error (a typo such as --hots), never passed on."""
    from ..errors import ConfigError

    extra = list(ctx.args)
    argv = state.argv
    if argv is None:  # called without main() (a library caller): everything is the step's
        return [], extra
    after = len(argv) - argv.index("--") - 1 if "--" in argv else 0
    before, flags = extra[: len(extra) - after], extra[len(extra) - after:]
    for word in before:
        if word.startswith("-"):
            hint = "flags for the step go after --" if not step_takes_command else "the command goes after --"
            raise ConfigError(f"{ctx.command_path}: no such option: {word} ({hint}; see: {ctx.command_path} --help)")
        if "=" not in word:
            raise ConfigError(f"{ctx.command_path}: unexpected argument {word!r} (settings are KEY=VALUE, e.g. "
                              f"epochs=3; see: {ctx.command_path} --help)")
    return before, flags


RECIPE_HELP = "Recipe file (YAML): the run's settings over the inventory's pipeline; KEY=VALUE arguments override it."


def console_ui():
    """The printing module, imported on first use so that `--help` stays fast."""
    from . import ui

    return ui
