"""Tracking: a real tiny training run writes tensorboard event files that tensorboard's own reader reads back
(loss and the acceptance signal per logged step, under the job's name); a tracker asked for by name and missing
is one line, exit 2, before any work."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from conftest import host_cmd
from test_train import make_pipeline

TRAIN = host_cmd("pipeline.train")


def _train(p, *extra, env=None):
    argv = [*TRAIN, "--model", str(p["target"]), "--output-dir", str(p["out"]), "--device", "cpu",
            "--batch-size", "4", "--epochs", "2", "--lr", "3e-3", "--log-every", "2", *extra]
    env = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}  # None: not set at all
    return subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="tensorboard is not installed")
def test_train_writes_tensorboard_events_read_back_by_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    p = make_pipeline(tmp_path)
    res = _train(p, "--report-to", "tensorboard", env={"KIMI_EAGLE_JOB_ID": "20260101-000000-train-abcd"})
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    run_dir = p["out"] / "tracking" / "20260101-000000-train-abcd"
    acc = EventAccumulator(str(run_dir))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    assert {"train/loss", "train/lr", "train/tokens_per_s", "train/acc_0", "train/acc_2"} <= set(tags), tags
    loss = acc.Scalars("train/loss")
    # One point per logged step, equal to the figures of the step's own result.
    assert [e.step for e in loss] == [h["step"] for h in result["history"]]
    assert [round(e.value, 4) for e in loss] == [round(h["loss"], 4) for h in result["history"]]
    assert [round(e.value, 4) for e in acc.Scalars("train/acc_0")] == [round(h["acc"][0], 4) for h in result["history"]]


def test_auto_is_tensorboard_when_installed_and_none_writes_nothing(tmp_path):
    p = make_pipeline(tmp_path)
    res = _train(p, "--report-to", "none", "--epochs", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    assert not (p["out"] / "tracking").exists()
    res = _train(p, "--epochs", "1")  # auto
    assert res.returncode == 0, res.stderr[-3000:]
    assert (p["out"] / "tracking").exists() == (importlib.util.find_spec("tensorboard") is not None)


@pytest.mark.parametrize("name", ["wandb", "mlflow", "trackio"])
def test_a_tracker_that_is_not_installed_is_bad_input_before_any_work(tmp_path, name):
    if importlib.util.find_spec(name) is not None:
        pytest.skip(f"{name} is installed here")
    p = make_pipeline(tmp_path)
    res = _train(p, "--report-to", name)
    assert res.returncode == 2, res.stderr[-2000:]
    assert res.stderr.strip().splitlines()[-1] == (f"train: --report-to {name}: the host's Python has no {name} "
                                                   f"(pip install {name}), or use report_to: none")
    assert not (p["out"] / "draft").exists()


# -- wandb, mlflow, trackio: each offline, read back by the library's own reader ---------------------------------
# Not CI dependencies (wandb ~60 MB, mlflow-skinny ~40 MB with opentelemetry and databricks-sdk, trackio ~11 MB with
# gradio-client, fastapi, uvicorn): these run where the library is installed and are skipped elsewhere.
JOB = "20260101-000000-train-abcd"


def _tracked_train(tmp_path, name, env=None):
    p = make_pipeline(tmp_path)
    res = _train(p, "--report-to", name, env={"KIMI_EAGLE_JOB_ID": JOB, **(env or {})})
    assert res.returncode == 0, res.stderr[-3000:]
    result = json.loads(res.stdout.strip().splitlines()[-1])
    return p["out"] / "tracking" / JOB, result, res.stderr


def _expected_loss(result):
    return [(h["step"], round(h["loss"], 4)) for h in result["history"]]


def _wandb_records(path):
    """The records of a .wandb run file (a LevelDB-style log of wandb's own protobuf Records)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block = path.read_bytes(), 32768
    assert data[:4] == b":W&B", data[:8]
    pos, part, records = 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = int.from_bytes(data[pos + 4:pos + 6], "little"), data[pos + 6]
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            r = pb.Record()
            r.ParseFromString(part)
            records.append(r)
            part = b""
    return records


def need(library: str):
    """The tracker library, or a skip where it is not installed; CI's tracker venv sets KIMI_EAGLE_NEED_TRACKERS=1,
    where a missing one is a failure (a skip there would hide that the test never ran)."""
    if os.environ.get("KIMI_EAGLE_NEED_TRACKERS") == "1":
        return importlib.import_module(library)
    return pytest.importorskip(library)


def test_train_logs_to_wandb_offline_without_an_api_key_read_back_from_its_run_file(tmp_path):
    need("wandb")
    run_dir, result, err = _tracked_train(tmp_path, "wandb", env={
        "WANDB_MODE": None, "WANDB_API_KEY": None, "NETRC": str(tmp_path / "no-netrc"), "WANDB_SILENT": "true"})
    assert "wandb: no API key on this host" in err and "logging offline" in err
    (run_file,) = (run_dir / "wandb").glob("offline-run-*/run-*.wandb")
    records = _wandb_records(run_file)
    run = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run and run[0].display_name == JOB and run[0].project == "kimi-eagle"
    rows = []
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in r.history.item}
            if "train/loss" in row:
                rows.append((row["_step"], round(row["train/loss"], 4)))
    assert rows == _expected_loss(result)


def test_train_logs_to_a_local_mlflow_file_store_read_back_by_mlflows_client(tmp_path, monkeypatch):
    need("mlflow")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir, result, err = _tracked_train(tmp_path, "mlflow", env={"MLFLOW_TRACKING_URI": None})
    uri = "file:" + str(run_dir / "mlruns")
    assert f"mlflow: {uri}" in err
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([client.get_experiment_by_name("kimi-eagle").experiment_id])
    assert run.info.run_name == JOB and run.data.params["report_to"] == "mlflow"
    history = client.get_metric_history(run.info.run_id, "train/loss")
    assert [(m.step, round(m.value, 4)) for m in history] == _expected_loss(result)
    assert "train/acc_0" in run.data.metrics


def test_train_logs_to_trackio_locally_read_back_by_trackios_storage(tmp_path):
    need("trackio")
    run_dir, result, err = _tracked_train(tmp_path, "trackio", env={"TRACKIO_DIR": None})
    assert f"trackio: {run_dir / 'trackio'}" in err
    code = ("import json, sys; from trackio.sqlite_storage import SQLiteStorage\n"
            "print(json.dumps(SQLiteStorage.get_logs('kimi-eagle', sys.argv[1]), default=str))")
    res = subprocess.run([sys.executable, "-c", code, JOB], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TRACKIO_DIR": str(run_dir / "trackio")})
    assert res.returncode == 0, res.stderr[-2000:]
    logs = json.loads(res.stdout.strip().splitlines()[-1])
    rows = [(row["step"], round(row["train/loss"], 4)) for row in logs if "train/loss" in row]
    assert rows == _expected_loss(result)
