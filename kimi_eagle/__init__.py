"""kimi-eagle: a local controller for EAGLE-3 draft training on remote GPU hosts.

The library is usable from Python; `kimi_eagle.cli` is a thin layer that parses and prints.
Heavy modules (fabric, paramiko, jinja2, pydantic) are imported lazily so that
`kimi-eagle --help` starts fast.
"""

__version__ = "0.1.0"
