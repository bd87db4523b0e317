"""The built wheel carries templates/ and the host package (kimi_eagle_host, with its data), so an installed
kimi-eagle works anywhere: it uploads the package from site-packages and runs it with `python -m`."""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from conftest import REPO


def _venv_seeing_our_dependencies(venv: Path) -> Path:
    """A venv that sees this interpreter's installed packages (the dependencies) but not the source tree.

    Not `--system-site-packages`: inside a venv that sees the *base* interpreter's packages, which on a fresh
    machine lack typer & co. A .pth with plain paths adds our site dirs without running their .pth files, so an
    editable install of this checkout stays out of sight.
    """
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    ours = [p for p in sys.path if p.rstrip("/").endswith(("site-packages", "dist-packages")) and Path(p).is_dir()]
    purelib = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True).stdout.strip()
    (Path(purelib) / "kimi_eagle_test_deps.pth").write_text("".join(p + "\n" for p in ours))
    return venv


def test_wheel_works_from_any_directory(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path / "dist"), str(REPO)],
                   check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("kimi_eagle-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for needed in ("kimi_eagle/_data/templates/job.sh.j2", "kimi_eagle_host/__init__.py",
                   "kimi_eagle_host/pipeline/extract.py", "kimi_eagle_host/engine/vllm_hs_connector.py",
                   "kimi_eagle_host/patch_sets/speculators-0.3.0-vllm-0.16.json",
                   "kimi_eagle_host/sample_data/chat.jsonl", "kimi_eagle/config/default_inventory.yaml",
                   "kimi_eagle_host/settings.py"):
        assert needed in names, needed
    assert not [n for n in names if "remote_payloads" in n], names  # the folder of scripts it replaced
    # The product's import names only: no generic top-level package (such as `launcher`) lands in site-packages.
    assert {n.split("/")[0] for n in names} == {"kimi_eagle", "kimi_eagle_host",
                                                 wheel.name.split("-py")[0] + ".dist-info"}, names
    venv = _venv_seeing_our_dependencies(tmp_path / "venv")
    subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", "--force-reinstall", str(wheel)],
                   check=True, capture_output=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PATH": f"{venv / 'bin'}:/usr/bin:/bin", "HOME": str(tmp_path), "NO_COLOR": "1"}
    r = subprocess.run([str(venv / "bin" / "kimi-eagle"), "render", "job", "all", "--host", "local", "--out", "r"],
                       cwd=elsewhere, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    script = next((elsewhere / "r").rglob("job.sh")).read_text()
    assert "-m kimi_eagle_host.pipeline.tiny_model" in script and "-m kimi_eagle_host.pipeline.train" in script
    located = subprocess.run([str(venv / "bin" / "python"), "-c",
                              "import kimi_eagle.resources as r; print(r.host_package_dir())"],
                             cwd=elsewhere, env=env, capture_output=True, text=True).stdout
    assert located.strip().endswith("site-packages/kimi_eagle_host") and str(REPO) not in located, located
    # A payload from the installed package, uploaded to the local host's workdir and run there as a module.
    r = subprocess.run([str(venv / "bin" / "kimi-eagle"), "--json", "hosts", "check", "local"], cwd=elsewhere, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout, r.stderr)
    uploaded = next(tmp_path.rglob(".kimi-eagle/payloads/*/kimi_eagle_host/ops/probe.py"))
    assert uploaded.read_bytes() == (REPO / "kimi_eagle_host" / "ops" / "probe.py").read_bytes()
    r = subprocess.run([str(venv / "bin" / "python"), "-m", "kimi_eagle", "--version"], cwd=elsewhere, env=env,
                       capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("kimi-eagle "), (r.stdout, r.stderr)
