"""Reading the YAML files a user hands us (the inventory, a recipe) within bounds of size, depth and expansion.

A YAML alias repeats a whole subtree without repeating its text: a few hundred bytes of nested aliases (a
"billion laughs") stand for 10^9 values, which the checks after loading would walk for minutes. Deep nesting
(`[[[[…`) overflows Python's stack in the composer. Files of settings need neither, so both are refused
with one line naming the file, before anything walks the document.
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from ..errors import ConfigError

# An inventory or recipe is a few KiB; a MiB is far beyond any real one and still quick to read.
MAX_BYTES = 1 << 20
# Settings nest a handful of levels (hosts.NAME.pipeline.steps.STEP.flag); 64 leaves room and stays far below
# the interpreter's recursion limit in every walk of the tree.
MAX_DEPTH = 64
# Values the document would have with every alias written out: a real file has hundreds.
MAX_EXPANDED_NODES = 100_000


class _Refused(Exception):
    """Inside the loader: the document breaks a bound (message, YAML mark)."""

    def __init__(self, message: str, mark=None):
        super().__init__(message)
        self.mark = mark


class _BoundedLoader(yaml.SafeLoader):
    """SafeLoader whose composer refuses nesting deeper than MAX_DEPTH, before the recursion gets deep."""

    def __init__(self, stream):
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise _Refused(f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_object(self, node, deep=False):
        # A scalar of the right form and an impossible value (2024-02-30, an int of 5000 digits) fails in the
        # constructor with a bare ValueError or OverflowError: named here, where the node's line is known.
        try:
            return super().construct_object(node, deep)
        except (ValueError, OverflowError) as e:
            if isinstance(e, yaml.YAMLError):
                raise
            raise _Refused(_unreadable(node, e), node.start_mark) from None


CANNOT_READ = "cannot be read as"


def _unreadable(node, error: Exception) -> str:
    text = str(node.value) if isinstance(node, yaml.ScalarNode) else "value"
    text = repr(text) if len(text) <= 40 else f"{text[:20]!r}... ({len(text)} characters)"
    reason = str(error).split(";")[0]  # int()'s advice to raise the interpreter's digit limit is not the user's
    return f"{text} {CANNOT_READ} {node.tag.rsplit(':', 1)[-1]} ({reason}); quote it to mean text"


def read_config_text(path: str | os.PathLike, what: str) -> str:
    """A YAML file's text (the inventory, a recipe), or one ConfigError line naming the file."""
    try:
        with Path(path).open("rb") as f:
            data = f.read(MAX_BYTES + 1)  # never more: /dev/zero or a huge file is refused, not read whole
    except FileNotFoundError:
        raise ConfigError(f"{path}: {what} file not found") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the {what}: {e}") from None
    if len(data) > MAX_BYTES:
        raise ConfigError(f"{path}: larger than {MAX_BYTES >> 20} MiB, too large for the {what} (a real one is a "
                          f"few KiB)")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: cannot read the {what}: {e}") from None


def read_yaml(text: str, shown: str):
    """(the parsed document, its node tree for line numbers); a syntax error or a document beyond the bounds
    is one ConfigError naming the file and the line."""
    if len(text) > MAX_BYTES:
        raise ConfigError(f"{shown}: larger than {MAX_BYTES >> 20} MiB, too large for settings")
    loader = _BoundedLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None, None
        _refuse_large_expansion(node)
        return loader.construct_document(node), node
    except _Refused as e:
        raise ConfigError(f"{shown}{_line(e.mark)}: {e}") from None
    except yaml.YAMLError as e:
        problem = getattr(e, "problem", None) or str(e).splitlines()[0]
        raise ConfigError(f"{shown}{_line(getattr(e, 'problem_mark', None))}: YAML syntax error: {problem}") from None
    except RecursionError:  # a bound above should have caught it first; still one line, never a traceback
        raise ConfigError(f"{shown}: nested too deeply") from None
    finally:
        loader.dispose()


def _line(mark) -> str:
    return f":{mark.line + 1}" if mark is not None else ""


def _refuse_large_expansion(root) -> None:
    """Count the values the document holds with its aliases written out, each shared node once per use
    (memoised, so counting costs what the text does); refuse beyond MAX_EXPANDED_NODES, or a node that
    contains itself through an alias (what no setting can be)."""
    sizes: dict[int, int] = {}
    on_path: set[int] = set()
    stack = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        key = id(node)
        if key in sizes:
            continue
        children = _children(node)
        if children_done:
            on_path.discard(key)
            sizes[key] = total = 1 + sum(sizes[id(c)] for c in children)
            if total > MAX_EXPANDED_NODES:
                raise _Refused(f"its aliases expand to more than {MAX_EXPANDED_NODES} values (an alias bomb?); "
                               f"write the settings out", node.start_mark)
            continue
        if key in on_path:
            raise _Refused("an alias refers to a node that contains it", node.start_mark)
        on_path.add(key)
        stack.append((node, True))
        for c in children:
            if id(c) in on_path:
                raise _Refused("an alias refers to a node that contains it", c.start_mark)
            stack.append((c, False))


def _children(node) -> list:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []
