"""The eval report's chart is drawn by matplotlib; a host without it gets the same figures as text."""

from __future__ import annotations

import json
import subprocess
import sys


REP = {"num_speculative_tokens": 3, "acceptance_per_position": [0.5, 0.25, 0.125], "mean_acceptance_length": 1.875,
       "engine": "hf", "prompts": 4, "tokens_per_s": {"without_draft": 10.0, "with_draft": 15.0}, "speedup": 1.5,
       "identical_completions": 1.0}

RENDER = ("import json, sys\n{hide}from kimi_eagle_host.evaluation.report_plot import render_report\n"
          "files = render_report(json.loads(sys.argv[1]))\n"
          "open(sys.argv[2], 'w').write(json.dumps({{k: v.hex() for k, v in files.items()}}))\n")


def _render(tmp_path, hide_matplotlib: bool) -> dict:
    out = tmp_path / "files.json"
    hide = "sys.modules['matplotlib'] = None  # as on a host without it\n" if hide_matplotlib else ""
    subprocess.run([sys.executable, "-c", RENDER.format(hide=hide), json.dumps(REP), str(out)], check=True, timeout=120)
    return {k: bytes.fromhex(v) for k, v in json.loads(out.read_text()).items()}


def test_the_chart_is_a_matplotlib_png(tmp_path):
    import io

    from PIL import Image

    files = _render(tmp_path, False)
    png = Image.open(io.BytesIO(files["report.png"]))
    assert png.format == "PNG" and png.size == (900, 420)  # matplotlib's 9 x 4.2 in at 100 dpi
    assert b"matplotlib" in files["report.png"]  # its Software tag


def test_without_matplotlib_the_report_is_text_only(tmp_path):
    files = _render(tmp_path, True)
    assert set(files) == {"report.txt"}
    text = files["report.txt"].decode()
    assert "acceptance length 1.88 at k=3" in text and "pos 1  " + "#" * 20 + " " * 20 + "  50%" in text
    assert "draft     " + "#" * 40 + "  15.0" in text and "speedup 1.50x" in text
