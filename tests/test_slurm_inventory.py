"""Slurm and group settings in the inventory, and the sbatch script they render: no Slurm, no host needed."""

from __future__ import annotations

import subprocess

import pytest

from conftest import make_env

SLURM_HOST = "hosts:\n  login:\n    scheduler: slurm\n"

CASES = {
    "slurm without its section": (SLURM_HOST, ["inventory.yaml:3", "host 'login'", "field slurm", "required with scheduler: slurm"]),
    "section without scheduler": ("hosts:\n  b:\n    slurm: {partition: gpu}\n", ["inventory.yaml:3", "only used with scheduler: slurm"]),
    "unknown scheduler": ("hosts:\n  b:\n    scheduler: pbs\n", ["inventory.yaml:3", "field scheduler", "pbs"]),
    "missing partition": (SLURM_HOST + "    slurm: {account: x}\n", ["inventory.yaml:4", "field slurm.partition", "required"]),
    "bad time limit": (SLURM_HOST + "    slurm: {partition: gpu, time_limit: 2h}\n",
                       ["field slurm.time_limit", "Slurm time limit", "2h"]),
    "bad gres": (SLURM_HOST + "    slurm: {partition: gpu, gres: 'gpu 8'}\n", ["field slurm.gres", "gres list like gpu:8"]),
    "space in partition": (SLURM_HOST + "    slurm: {partition: 'gpu; rm -rf /'}\n", ["field slurm.partition", "a Slurm name"]),
    "sbatch flag with a space": (SLURM_HOST + "    slurm: {partition: gpu, sbatch_args: ['--comment=a b']}\n",
                                 ["field slurm.sbatch_args", "--name=value"]),
    "zero nodes": (SLURM_HOST + "    slurm: {partition: gpu, nodes: 0}\n", ["field slurm.nodes"]),
    "rendezvous port out of range": ("hosts:\n  b:\n    rdzv_port: 70000\n", ["inventory.yaml:3", "field rdzv_port"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slurm_and_group_settings_mistake_is_one_clear_line(tmp_path, case):
    text, needles = CASES[case]
    e = make_env(tmp_path, None)
    e.inventory.write_text(text)
    r = e.cli("hosts", "check")
    assert r.code == 2, (r.stdout, r.stderr)
    msg = r.stderr.strip()
    assert len(msg.splitlines()) == 1, msg
    for n in needles:
        assert n in msg, (n, msg)


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
