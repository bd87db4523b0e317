"""Inventory mistakes: one clear line naming file, line, host and field; exit 2; no host contacted."""

from __future__ import annotations

import sys

import pytest

from conftest import make_env, one_line_usage_error

GOOD_HOST = """hosts:
  blackwell-01:
    address: blackwell-01.example
    port: 22
    workdir: /root/eagle3-train
"""

SLURM_HOST = "hosts:\n  login:\n    scheduler: slurm\n"

CASES = {
    "unknown key": (
        "hosts:\n  blackwell-01:\n    address: blackwell-01.example\n    prot: 22\n",
        ["inventory.yaml:4", "host 'blackwell-01'", "field prot", "unknown key"],
    ),
    "wrong type": (
        "hosts:\n  blackwell-01:\n    address: blackwell-01.example\n    port: twenty-two\n",
        ["inventory.yaml:4", "host 'blackwell-01'", "field port", "twenty-two"],
    ),
    "out of range": (
        "hosts:\n  blackwell-01:\n    port: 70000\n",
        ["inventory.yaml:3", "field port", "70000"],
    ),
    "bad transport": (
        "hosts:\n  b:\n    transport: telnet\n",
        ["inventory.yaml:3", "host 'b'", "field transport", "telnet"],
    ),
    "yaml syntax": (
        "hosts:\n  b:\n    address: [unclosed\n  c: {}\n",
        ["inventory.yaml:", "YAML syntax error"],
    ),
    "missing hosts": ("groups: {}\n", ["field hosts", "required field is missing"]),
    "unknown group member": (
        GOOD_HOST + "groups:\n  gpus: [blackwell-01, blackwell-02]\n",
        ["inventory.yaml:7", "group 'gpus'", "blackwell-02"],
    ),
    "bad pipeline value": (
        GOOD_HOST + "pipeline:\n  backend: tensorrt\n",
        ["inventory.yaml:7", "field pipeline.backend", "tensorrt"],
    ),
    "bad env name": (
        "hosts:\n  b:\n    env:\n      'BAD-NAME': x\n",
        ["inventory.yaml:3", "host 'b'", "field env", "BAD-NAME"],
    ),
    "bad per-host pipeline": (
        "hosts:\n  b:\n    pipeline:\n      seq_len: -4\n",
        ["inventory.yaml:4", "host 'b'", "field pipeline.seq_len"],
    ),
    # A second host of the same name used to replace the first silently.
    "duplicate host": (
        GOOD_HOST + "  blackwell-01:\n    address: other.example\n",
        ["inventory.yaml:6", "host 'blackwell-01' is defined twice", "first at line 2"],
    ),
    "duplicate field": (
        "hosts:\n  b:\n    port: 22\n    port: 2222\n",
        ["inventory.yaml:4", "key 'port' in hosts.b is defined twice"],
    ),
    # YAML's `true` used to pass as port 1.
    "boolean port": (
        "hosts:\n  b:\n    port: true\n",
        ["inventory.yaml:3", "host 'b'", "field port", "not a boolean"],
    ),
    "boolean pipeline number": (
        GOOD_HOST + "pipeline:\n  epochs: yes\n",
        ["inventory.yaml:7", "field pipeline.epochs", "not a boolean"],
    ),
    # `^...$` took a name ending in a newline: `export FOO` and `='bar'` on two lines, the job dead at exit 127.
    "env name ending in a newline": (
        'hosts:\n  b:\n    env:\n      "FOO\\n": bar\n',
        ["inventory.yaml:3", "host 'b'", "field env", "FOO"],
    ),
    "NUL in an env value": (
        'hosts:\n  b:\n    env:\n      HF_HOME: "/data\\0/hf"\n',
        ["inventory.yaml:3", "host 'b'", "field env", "HF_HOME", "NUL"],
    ),
    "newline in the workdir": (
        'hosts:\n  b:\n    workdir: "/root/x\\ntouch /tmp/p"\n',
        ["inventory.yaml:3", "host 'b'", "field workdir", "control character"],
    ),
    # A relative workdir started the job and then lost it (`cd: relwd: No such file or directory`, exit 4).
    "relative workdir": (
        "hosts:\n  b:\n    transport: local\n    workdir: relwd\n",
        ["inventory.yaml:4", "host 'b'", "field workdir", "absolute path", "'relwd'"],
    ),
    "workdir in another user's home": (
        "hosts:\n  b:\n    transport: local\n    workdir: ~alice/w\n",
        ["inventory.yaml:4", "host 'b'", "field workdir", "start with ~/"],
    ),
    "relative workdir in defaults": (
        "defaults:\n  workdir: w\nhosts:\n  b:\n    transport: local\n",
        ["inventory.yaml:2", "field defaults.workdir", "absolute path"],
    ),
    **{f"empty {field}": (
        f"hosts:\n  b:\n    transport: local\n    {field}: ''\n",
        ["inventory.yaml:4", "host 'b'", f"field {field}", "is empty"],
    ) for field in ("workdir", "python", "identity_file", "known_hosts", "user")},
    "control character in a group name": (
        GOOD_HOST + 'groups:\n  "g\\x1b[2J": [blackwell-01]\n',
        ["inventory.yaml:7", "group name", "control character"],
    ),
    # Slurm and group settings
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
    # Passed validation, then failed at the first connection with exit 1 (OverflowError, UnicodeError from IDNA).
    **{f"connect_timeout {v}": (f"hosts:\n  b:\n    connect_timeout: {v}\n",
                                ["inventory.yaml:3", "host 'b'", "field connect_timeout", shown])
       for v, shown in ((".inf", "(got inf)"), (".nan", "(got nan)"), ("1.0e+300", "3600"), ("0", "greater than 0"))},
    "connect_timeout in defaults": ("defaults:\n  connect_timeout: .inf\nhosts:\n  b: {}\n",
                                    ["inventory.yaml:2", "field defaults.connect_timeout"]),
    "empty label in an address": ("hosts:\n  b:\n    address: a..b\n",
                                  ["inventory.yaml:3", "host 'b'", "field address", "is not a host name", "'a..b'"]),
    "label over 63 characters": (f"hosts:\n  b:\n    address: {'a' * 64}.example\n",
                                 ["inventory.yaml:3", "host 'b'", "field address", "1 to 63 characters"]),
    "a host name standing in for its address": ("hosts:\n  x..y: {}\n",
                                                ["host 'x..y'", "field address", "is not a host name"]),
    "empty label in a rendezvous address": ("hosts:\n  b:\n    rdzv_address: .b\n",
                                            ["inventory.yaml:3", "host 'b'", "field rdzv_address", "not a host name"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_inventory_mistake_is_one_clear_line(tmp_path, case):
    text, needles = CASES[case]
    e = make_env(tmp_path, None)
    e.inventory.write_text(text)
    r = e.cli("hosts", "check")
    assert r.code == 2, (r.stdout, r.stderr)
    msg = r.stderr.strip()
    assert len(msg.splitlines()) == 1, msg
    for n in needles:
        assert n in msg, (n, msg)
    assert r.stdout == ""  # nothing ran


@pytest.mark.parametrize("workdir", ["relwd", "''"])
def test_a_workdir_that_is_no_absolute_folder_is_refused_before_anything_runs(tmp_path, workdir):
    """Before: the command ran (in the empty workdir's case to exit 0), and the job was reported `lost`."""
    e = make_env(tmp_path, None)
    e.write_inventory(f"hosts:\n  h1:\n    transport: local\n    python: {sys.executable}\n    workdir: {workdir}\n")
    marker = tmp_path / "ran"
    line = one_line_usage_error(e.cli("run", "exec", "--host", "h1", "--no-gpu", "--", "touch", str(marker)))
    assert "inventory.yaml:5: host 'h1', field workdir: " in line, line
    assert not marker.exists()


def test_missing_inventory_file(tmp_path):
    e = make_env(tmp_path, None)
    r = e.cli("--inventory", str(tmp_path / "nope.yaml"), "hosts")
    assert r.code == 2 and "nope.yaml: inventory file not found" in r.stderr


def test_unknown_host_name(tmp_path):
    e = make_env(tmp_path, None)
    r = e.cli("hosts", "check", "blackwell-99")
    assert r.code == 2 and "no host or group named 'blackwell-99'" in r.stderr


def test_example_inventory_is_valid():
    from pathlib import Path

    from kimi_eagle.config import inventory

    inv = inventory.load(Path(__file__).resolve().parents[1] / "inventory.example.yaml")
    assert {"blackwell-01", "local"} <= set(inv.hosts)
    assert inv.hosts["blackwell-01"].pipeline.tp_size == 8
    assert inv.hosts["local"].transport == "local"


def test_embedded_default_has_a_local_host(tmp_path, monkeypatch):
    from kimi_eagle.config import inventory

    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("KIMI_EAGLE_INVENTORY", raising=False)
    inv = inventory.load(None)
    assert inv.path == inventory.EMBEDDED and list(inv.hosts) == ["local"]
