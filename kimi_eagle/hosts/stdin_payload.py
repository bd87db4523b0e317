"""Run a host module without writing to the host: what a dry run does where the host lacks this payload set.

A normal call uploads the kimi_eagle_host package to its payload set's folder, <workdir>/.kimi-eagle/payloads/<digest>/,
first (session.py). A dry run promises not to act, so it must not create that folder (or the workdir) either: the
package's Python files travel on the call's stdin as a zip, and a short bootstrap given to `python -c` imports them
from memory. The modules see the paths they would have had when deployed (`__file__` under that folder), so what
they derive from their own place (the runs folder) is the same either way; none of them reads a file of the package.
"""

from __future__ import annotations

import io
import zipfile


# Runs on the host's Python (3.8+, stdlib only, like the ops payloads) as `python -c BOOT FOLDER MODULE ARGS...`:
# FOLDER the payload set's folder under the workdir (where __file__ would be), stdin the zip.
BOOT = '''\
import importlib.abc, importlib.util, io, os, runpy, sys, zipfile
ZIP = zipfile.ZipFile(io.BytesIO(sys.stdin.buffer.read()))
ROOT = os.path.join(os.getcwd(), sys.argv[1])
class InMemory(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    names = set(ZIP.namelist())
    def find_spec(self, name, path=None, target=None):
        base = name.replace(".", "/")
        for rel, package in ((base + "/__init__.py", True), (base + ".py", False)):
            if rel in self.names:
                spec = importlib.util.spec_from_loader(name, self, origin=os.path.join(ROOT, rel), is_package=package)
                spec.has_location = True
                if package:
                    spec.submodule_search_locations = [os.path.join(ROOT, base)]
                return spec
        return None
    def create_module(self, spec):
        return None
    def get_code(self, name):
        origin = self.find_spec(name).origin
        return compile(ZIP.read(origin[len(ROOT) + 1:]), origin, "exec")
    def exec_module(self, module):
        exec(self.get_code(module.__name__), module.__dict__)
sys.meta_path.insert(0, InMemory())
sys.stdin.close()
module, sys.argv = sys.argv[2], sys.argv[2:]
runpy.run_module(module, run_name="__main__", alter_sys=True)
'''


_ZIPS: dict[str, bytes] = {}


def package_zip(items, digest: str) -> bytes:
    """The payload set's Python files (sync.Items under the payloads folder: kimi_eagle_host/...), zipped; once per
    set and process."""
    if digest not in _ZIPS:
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
            for item in items:
                if item.remote.endswith(".py"):
                    z.writestr(item.remote, item.data)
        _ZIPS[digest] = buf.getvalue()
    return _ZIPS[digest]

