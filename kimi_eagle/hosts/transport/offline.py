"""A transport that never connects: rendering and validating a job or a payload before (or instead of) a start."""

from __future__ import annotations


class Offline:
    """A transport stand-in for rendering and validating: it never connects."""

    def __init__(self, host):
        self.name = host.name

    def abspath(self, p):
        return p

    def close(self):
        pass
