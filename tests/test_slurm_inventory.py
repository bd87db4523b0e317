"""The sbatch script a Slurm host's settings render: no Slurm, no host needed (the settings' mistakes are in
tests/test_inventory.py)."""

from __future__ import annotations

import subprocess

from conftest import make_env


def test_render_job_for_a_slurm_host_is_an_array_with_every_setting(tmp_path):
    e = make_env(tmp_path, None)
    e.inventory.write_text(f"""hosts:
  login:
    address: login.cluster.example
    workdir: /scratch/me/eagle
    scheduler: slurm
    slurm: {{partition: gpu, account: proj-1, gres: "gpu:h200:8", time_limit: "1-12:00:00", shards: 3,
            array_parallelism: 2, sbatch_args: ["--exclusive", "--comment=kimi"]}}
pipeline: {{model: /models/Kimi-K2.5, backend: hf}}
""")
    r = e.cli("render", "job", "extract", "--host", "login", "--out", str(tmp_path / "out"))
    assert r.code == 0, r.stderr
    script = next((tmp_path / "out").rglob("job.sbatch")).read_text()
    for line in ("#SBATCH --partition=gpu", "#SBATCH --account=proj-1", "#SBATCH --gres=gpu:h200:8",
                 "#SBATCH --time=1-12:00:00", "#SBATCH --array=0-2%2", "#SBATCH --exclusive", "#SBATCH --comment=kimi"):
        assert line in script.splitlines(), line
    for rank in range(3):  # each array task runs the extraction with its own rank of 3
        assert f"--rank {rank} --world-size 3" in script
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0  # valid shell


def test_an_array_task_runs_a_multi_line_argument_as_given(tmp_path):
    """Each array task's steps sit inside a `case` branch; an argument holding newlines (a `python -c` program, the
    settings a record step writes) must reach the task unchanged, not with every line after the first indented."""
    import shlex

    e = make_env(tmp_path, None)
    e.inventory.write_text("""hosts:
  login:
    address: login.cluster.example
    workdir: /scratch/me/eagle
    scheduler: slurm
    slurm: {partition: gpu, shards: 2}
pipeline: {model: /models/Kimi-K2.5, backend: hf}
""")
    program = "import os\nif True:\n    print(os.getpid())\n"
    r = e.cli("render", "job", "exec", "--host", "login", "--out", str(tmp_path / "out"), "--", "python3", "-c", program)
    assert r.code == 0, r.stderr
    script = next((tmp_path / "out").rglob("job.sbatch")).read_text()
    assert script.count(shlex.quote(program)) == 2, script   # once in each task's branch, byte for byte
    assert subprocess.run(["bash", "-n"], input=script, text=True).returncode == 0


def test_a_multi_node_job_picks_its_rendezvous_port_on_its_first_node_unless_the_inventory_sets_one(tmp_path):
    """Unset, the port is found free when the job starts (two jobs may share a first node); set, it is used as is."""
    scripts = {}
    for port in (None, 29611):
        e = make_env(tmp_path / str(port), None)
        e.inventory.write_text(f"""hosts:
  login:
    address: login.cluster.example
    workdir: /scratch/me/eagle
    scheduler: slurm
    slurm: {{partition: gpu, nodes: 2}}
{f"    rdzv_port: {port}" if port else ""}
pipeline: {{model: /models/Kimi-K2.5}}
""")
        out = tmp_path / str(port) / "out"
        r = e.cli("render", "job", "exec", "--host", "login", "--out", str(out), "--", "train.py")
        assert r.code == 0, r.stderr
        scripts[port] = next(out.rglob("job.sbatch")).read_text()
        assert subprocess.run(["bash", "-n"], input=scripts[port], text=True).returncode == 0
    assert "s.bind((\"\", 0))" in scripts[None] and "29500" not in scripts[None]
    assert "rdzv_port=29611\n" in scripts[29611] and "s.bind" not in scripts[29611]
    endpoint = 'export KIMI_EAGLE_RDZV_ENDPOINT="${head_addr:-$head}:$rdzv_port"'
    assert endpoint in scripts[None] and endpoint in scripts[29611]
