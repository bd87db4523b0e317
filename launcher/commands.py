"""Commands that live in their own modules register on the app when imported here."""

from . import cli_gpu, cli_jobs, cli_patch, cli_preflight  # noqa: F401
