"""(commands of this feature register here)"""

from .cli import app, state  # noqa: F401
