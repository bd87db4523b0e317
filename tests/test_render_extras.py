"""`render` writes what `run` would, flags after `--` included."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from conftest import make_env, write_fake_export


def _job_script(tmp_path, step, *extra):
    e = make_env(tmp_path, None, extra="pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n")
    out = tmp_path / "r"
    r = e.cli("render", "job", step, "--host", "local", "--out", str(out), "--", *extra)
    assert r.code == 0, (r.stdout, r.stderr)
    (script,) = out.rglob("job.sh")
    return script.read_text()


def test_render_job_exec_with_a_command(tmp_path):
    text = _job_script(tmp_path, "exec", "python3", "-c", "print('hi there')", "--flag")
    assert "python3 -c 'print('\"'\"'hi there'\"'\"')' --flag" in text, text
    subprocess.run(["bash", "-n"], input=text, text=True, check=True)


def test_render_a_step_with_extra_flags(tmp_path):
    text = _job_script(tmp_path, "extract", "--validate", "--batch-size", "3")
    line = next(ln for ln in text.splitlines() if "kimi_eagle_host.pipeline.extract" in ln)
    assert line.rstrip().endswith("--validate --batch-size 3"), line


def test_render_refuses_flags_a_thing_does_not_take(tmp_path):
    r = make_env(tmp_path, None).cli("render", "patch", "--host", "local", "--out", str(tmp_path / "r"), "--", "--x")
    assert r.code == 2 and "takes no" in r.stderr and "--x" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_finished_training_ends_with_where_what_and_next(tmp_path, sshd):
    """The last lines of `run train|all`: the absolute export path, what it holds, and the command to use it."""
    e = make_env(tmp_path, sshd, extra="pipeline:\n  model: /models/tiny-kimi\n  dataset: /data/d.jsonl\n")
    export = write_fake_export(e, "/models/tiny-kimi", size=4096)
    # A real `train` job that exits at once (--help), so the ending is what the user sees after training.
    r = e.cli("run", "train", "--host", "gpu", "--no-preflight", "--", "--help")
    assert r.code == 0, (r.stdout, r.stderr)
    last = r.stdout.strip().splitlines()[-3:]
    assert last[0] == f"[gpu] draft exported to {export}", last
    assert "config.json + model.safetensors" in last[1] and "draft vocabulary 256" in last[1], last
    assert "vllm serve /models/tiny-kimi --speculative-config" in last[2] and str(export) in last[2] and "eagle3" in last[2]


# ----------------------------------------------------------------------------------------------------
# The host's GPUs: what the rendered job's launch (kimi_eagle_host.pipeline.launch --print) decides on the host

def _gpu_host(tmp_path, gpus: int, visible: str | None = None, per_replica: int = 1) -> str:
    """An inventory host `h` with `gpus:` and, when given, an env reserving GPUs by CUDA_VISIBLE_DEVICES."""
    env = f"\n    env: {{CUDA_VISIBLE_DEVICES: {json.dumps(visible)}}}" if visible is not None else ""
    return (f"  h:\n    transport: local\n    python: {sys.executable}\n    workdir: {tmp_path / 'hwork'}\n"
            f"    gpus: {gpus}{env}\n"
            f"pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n  gpus_per_replica: {per_replica}\n")


def _launches(job: str, cwd, host_env: dict, gpus_env: dict) -> list[tuple[dict | None, str]]:
    """Each command line of the job's step that picks GPUs, run as on the host: (launch's decision or None for an
    exec shard, the CUDA_VISIBLE_DEVICES the step ends up with)."""
    out = []
    for line in job.splitlines():
        if "kimi_eagle_host.pipeline.launch" not in line and "SHOW_GPUS" not in line:
            continue
        words = shlex.split(line.strip().removesuffix("&"))
        given = {}
        while re.fullmatch(r"[A-Z_]+=.*", words[0]):     # a NAME=VALUE before the command: the branch's own env
            given.update([words.pop(0).split("=", 1)])
        env = {**os.environ, **gpus_env, **host_env, **given}
        words[0] = sys.executable
        if words[1:3] == ["-m", "kimi_eagle_host.pipeline.launch"]:
            p = subprocess.run([*words[:3], "--print", *words[3:]], capture_output=True, text=True, env=env, cwd=cwd)
            assert p.returncode == 0, (line, p.stderr)
            d = json.loads(p.stdout)
            out.append((d, d["env"].get("CUDA_VISIBLE_DEVICES", env.get("CUDA_VISIBLE_DEVICES"))))
        else:
            p = subprocess.run(words, capture_output=True, text=True, env=env, cwd=cwd)
            assert p.returncode == 0, (line, p.stderr)
            out.append((None, p.stdout.strip()))
    return out


@pytest.mark.parametrize("step", ["train", "extract"])
def test_the_hosts_gpus_setting_caps_the_workers_launch_starts(tmp_path, fake_gpus, step):
    """`gpus: 4` on a host of 8 GPUs: the job's launch starts 4 workers on GPUs 0-3 (it started 8), also when the
    host's env names its GPUs by UUID."""
    e = make_env(tmp_path, None, extra=_gpu_host(tmp_path, 4))
    out = tmp_path / "r"
    r = e.cli("render", "job", step, "--host", "h", "--out", str(out))
    assert r.code == 0, r.stderr
    (script,) = out.rglob("job.sh")
    job = script.read_text()
    eight = fake_gpus(*[81920] * 8)
    ((d, visible),) = _launches(job, out, {}, eight)
    assert (d["nproc_per_node"], visible) == (4, "0,1,2,3"), d
    assert job.count("--gpus 4 ") == 1, job
    uuids = ",".join(f"GPU-{i}a2b" for i in range(8))
    ((d, visible),) = _launches(job, out, {"CUDA_VISIBLE_DEVICES": uuids}, eight)
    assert (d["nproc_per_node"], visible) == (4, ",".join(uuids.split(",")[:4])), d


def _group_job(tmp_path, step: str, extra: list[str], host_text: str) -> tuple[str, dict]:
    """The job a `--shard-by gpus` group gives host `h` (written with its settings.json under tmp_path/g), and the
    host's env."""
    from kimi_eagle.config import inventory
    from kimi_eagle.hosts.session import HostSession
    from kimi_eagle.hosts.transport.offline import Offline
    from kimi_eagle.jobs import direct, layout

    tmp_path.mkdir(exist_ok=True)
    path = tmp_path / "inv.yaml"
    path.write_text("hosts:\n" + host_text)
    host = inventory.load(path).hosts["h"]
    (shape,) = layout.shard_shapes([host], "gpus")
    files = direct.job_files(HostSession(host, transport=Offline(host)), step, extra, "JOB", shape)
    for rel, text in files.items():
        (tmp_path / "g" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "g" / rel).write_text(text)
    return files["runs/JOB/job.sh"], host.env


RESERVED = {"4,5,6,7": ["4,5", "6,7"], "GPU-a1,GPU-b2,GPU-c3,GPU-d4": ["GPU-a1,GPU-b2", "GPU-c3,GPU-d4"],
            "MIG-GPU-a1/1/0,MIG-GPU-a1/2/0,MIG-GPU-b2/1/0,MIG-GPU-b2/2/0":
                ["MIG-GPU-a1/1/0,MIG-GPU-a1/2/0", "MIG-GPU-b2/1/0,MIG-GPU-b2/2/0"]}


@pytest.mark.parametrize("visible", list(RESERVED))
def test_shards_by_gpus_split_the_gpus_the_host_reserves(tmp_path, fake_gpus, visible):
    """A host whose env reserves GPUs 4-7 (or lists them by UUID or MIG name), `gpus: 4`, 2 GPUs a replica:
    `--shard-by gpus` runs its two extraction shards on 4,5 and 6,7 (they ran on 0,1 and 2,3), one worker each, and
    an exec shard's command sees the same slices."""
    eight = fake_gpus(*[81920] * 8)
    job, host_env = _group_job(tmp_path, "extract", [], _gpu_host(tmp_path, 4, visible, per_replica=2))
    got = _launches(job, tmp_path / "g", host_env, eight)
    assert [v for _, v in got] == RESERVED[visible], job
    assert [d["nproc_per_node"] for d, _ in got] == [1, 1]
    assert all(line.count("--gpus ") == 1 for line in job.splitlines() if "pipeline.launch" in line), job
    show = [sys.executable, "-c", "import os; print(os.environ['CUDA_VISIBLE_DEVICES'])  # SHOW_GPUS"]
    job, host_env = _group_job(tmp_path / "x", "exec", show, _gpu_host(tmp_path, 4, visible, per_replica=2))
    assert [v for _, v in _launches(job, tmp_path / "x" / "g", host_env, eight)] == RESERVED[visible], job


def test_a_host_of_one_shard_by_gpus_keeps_to_its_gpus_setting(tmp_path, fake_gpus):
    """`gpus: 2`, 2 GPUs a replica, on a machine of 8: its one shard's launch uses 2 GPUs, one worker (it took all 8,
    4 workers)."""
    job, host_env = _group_job(tmp_path, "extract", [], _gpu_host(tmp_path, 2, per_replica=2))
    ((d, visible),) = _launches(job, tmp_path / "g", host_env, fake_gpus(*[81920] * 8))
    assert (d["nproc_per_node"], visible) == (1, "0,1"), (d, job)
