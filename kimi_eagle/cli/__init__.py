"""The `kimi-eagle` command line: parses, calls the library, prints. No work happens here."""

from .app import app, main

__all__ = ["app", "main"]
