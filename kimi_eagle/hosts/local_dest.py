"""A local folder the user named to receive files (`pull --to`, `render --out`): made and checked before anything
arrives, and every failure to write into it one line naming the path, never a traceback.

Only local file operations are guarded here: a lost connection is an OSError too (ConnectionError), and it
must stay the connection's failure (exit 5), so callers wrap the file calls, not the transfer.
"""

from __future__ import annotations

import errno
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

from ..errors import ConfigError, KimiEagleError

_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)


class LocalWriteFailed(KimiEagleError):
    """The destination is right but this machine could not hold the files (a full disk): exit 1, nothing
    was replaced."""


def prepare_folder(path: str | Path, option: str) -> Path:
    """Make `path` (and its parents) and prove a file can be created in it; one line naming `option` and the
    path otherwise (a file in the way, a read-only file system, no permission, no space)."""
    out = Path(path)
    with writing(out, option):
        out.mkdir(parents=True, exist_ok=True)
        if not out.is_dir():  # a symlink to a file, say: mkdir's exist_ok passed it
            raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), str(out))
        tempfile.TemporaryFile(dir=out, prefix=".kimi-eagle-probe-").close()
    return out


@contextmanager
def writing(root: str | Path, option: str | None = None):
    """Local file operations under `root`: an OSError becomes one line naming the path (ConfigError, exit 2;
    a full disk LocalWriteFailed, exit 1)."""
    try:
        yield
    except (ConnectionError, TimeoutError):
        raise
    except OSError as e:
        raise write_error(root, e, option) from None


def write_error(root: str | Path, e: OSError, option: str | None = None) -> KimiEagleError:
    where = f"{option} {root}" if option else str(root)
    path = e.filename or root
    at = "" if str(path) == str(root) else f" ({path})"
    if e.errno in _NO_SPACE:
        return LocalWriteFailed(f"{where}: no space left on this machine{at}; nothing was replaced")
    if e.errno in (errno.ENOTDIR, errno.EEXIST):
        return ConfigError(f"{where}: a file is in the way where a folder is needed{at}")
    if e.errno == errno.EISDIR:
        return ConfigError(f"{where}: a folder is in the way where a file is needed{at}")
    return ConfigError(f"{where}: cannot write there: {e.strerror or e}{at}")
