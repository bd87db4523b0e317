"""bench/gpu/gpu_scaling.py's stop phase renders the job `kimi-eagle run train` starts, from settings given as plain
attributes (pydantic is not on the GPU machine). On the H200 it died there with "'SimpleNamespace' object has no
attribute 'model_source'" once the inventory had grown a setting the bench did not list."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_stop_phase_renders_the_train_job(tmp_path, monkeypatch):
    monkeypatch.setenv("WORK", str(tmp_path / "work"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    spec = importlib.util.spec_from_file_location("gpu_scaling_bench", REPO / "bench" / "gpu" / "gpu_scaling.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    host, rel, text = mod.render_train_job(tmp_path / "host", tmp_path / "pipe", "train-20260101-000000-abcd")
    assert "-m kimi_eagle_host.pipeline.launch" in text and "--max-steps" in text
    assert "-m kimi_eagle_host.pipeline.train" in text
    assert str(tmp_path / "pipe") in text and host.name == "gpu-scaling"
    sys.modules.pop("gpu_scaling_bench", None)
