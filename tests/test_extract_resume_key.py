"""An extraction resumes only into samples written by the same code format and settings: otherwise
it starts clean and says what differs (never "N done already" for samples another format wrote). Real prepare + extract on the tiny
Kimi-style model through the local transport."""

from __future__ import annotations

import json

from conftest import TINY_PIPELINE, make_env


def test_extract_starts_clean_over_samples_of_another_format(tmp_path):
    env = make_env(tmp_path, None, extra=TINY_PIPELINE)
    for step in ("prepare", "extract"):
        r = env.cli("run", step, "--host", "local", "--no-preflight", "--no-gpu", timeout=600)
        assert r.code == 0, (step, r.stdout[-2000:], r.stderr[-2000:])
    cfg_path = tmp_path / "localwork" / "out" / "hidden_states" / "data_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["format"] = "kimi-eagle-hidden-states/0"   # what an older release would have recorded
    cfg_path.write_text(json.dumps(cfg))
    r = env.cli("run", "extract", "--host", "local", "--no-preflight", "--no-gpu", timeout=600)
    assert r.code == 0, (r.stdout[-2000:], r.stderr[-2000:])
    assert "starting clean in" in r.stdout and "format 'kimi-eagle-hidden-states/0' ->" in r.stdout, r.stdout[-2000:]
    assert " 0 done already" in r.stdout, r.stdout[-2000:]
