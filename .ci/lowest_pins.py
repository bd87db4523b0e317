"""Print pyproject.toml's [project] dependencies pinned at their lower bounds (`rich>=13` -> `rich==13`), one per
line: CI installs the controller at the lowest versions its ranges allow. A dependency without a lower bound is
printed as it is (pip picks its newest)."""

import re
import tomllib
from pathlib import Path

for dep in tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]["dependencies"]:
    name = re.match(r"[A-Za-z0-9_.\-]+(\[[^\]]*\])?", dep).group(0)
    lowest = re.search(r">=\s*([^,;\s]+)", dep)
    print(f"{name}=={lowest.group(1)}" if lowest else dep)
