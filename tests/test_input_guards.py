"""Input that must never reach the wrong place, over the real sshd: job ids, `render --out`, host fields.

Each case is one clear line and exit 2 with nothing done: a job of another workdir keeps running, no file
appears, no ssh option is smuggled in as an address.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from conftest import add_workdir_host, make_env, one_line_usage_error

PY = sys.executable


def two_workdirs(tmp_path, sshd):
    """Hosts `gpu` (workdir hostwork) and `gpu2` (workdir hostwork2) on the same machine."""
    return add_workdir_host(make_env(tmp_path, sshd), "gpu2", tmp_path / "hostwork2")


def test_job_ids_are_input_and_never_reach_another_workdirs_job(tmp_path, sshd):
    env = two_workdirs(tmp_path, sshd)
    r = env.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", PY, "-c", "import time; time.sleep(600)")
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    assert env.cli("run", "exec", "--host", "gpu2", "--no-gpu", "--", "true").code == 0  # gpu2 has a runs dir too
    relative = f"../../hostwork/runs/{job}"
    absolute = str(env.workdir / "runs" / job)
    for bad in (relative, absolute, "", "-x", "--grace=0", "a/b", ".", ".."):
        for cmd in (["stop", "--host", "gpu2", "--", bad], ["logs", "--host", "gpu2", "--", bad],
                    ["status", "--host", "gpu2", "--", bad], ["stop", "--host", "gpu", "--", bad], ["logs", "--", bad]):
            r = env.cli(*cmd)
            assert "not a job id" in one_line_usage_error(r), cmd
        # After each id's stops: the job still runs, so none of them reached it (a stopped job stays stopped).
        st = env.cli("--json", "status", job, "--host", "gpu")
        assert st.json()["jobs"][0]["state"] == "running", (bad, st.stdout)
    assert env.cli("stop", job, "--host", "gpu", "--grace", "1").code == 0


def test_jobctl_refuses_a_job_id_that_is_not_one(tmp_path):
    runs = tmp_path / "runs"
    (runs / "x").mkdir(parents=True)
    for argv in (["status", "--job=../x"], ["stop", "--job=-x"], ["status", "--job="]):
        p = subprocess.run([PY, "-m", "kimi_eagle_host.ops.jobs", "--runs-dir", str(runs), *argv],
                           capture_output=True, text=True)
        assert p.returncode == 2 and "not a job id" in json.loads(p.stdout)["error"], (argv, p.stdout, p.stderr)


@pytest.mark.parametrize("where", ["file", "under-a-file", "proc"])
def test_render_out_that_cannot_be_a_folder_is_one_line(tmp_path, where):
    env = make_env(tmp_path, None)
    target = {"file": tmp_path / "afile", "under-a-file": tmp_path / "afile" / "sub", "proc": "/proc/kimi-eagle-out"}[where]
    (tmp_path / "afile").write_text("keep me\n")
    line = one_line_usage_error(env.cli("render", "job", "exec", "--host", "local", "--out", str(target), "--", "true"))
    assert "--out" in line and str(target) in line
    assert (tmp_path / "afile").read_text() == "keep me\n"


@pytest.mark.parametrize("field, value", [
    ("rdzv_address", "head\nFAKE: all good"),
    ("rdzv_address", "head\x1b[2Jx"),
    ("rdzv_address", "-oProxyCommand=touch /tmp/x"),
    ("address", "-oProxyCommand=touch {marker}"),
    ("address", "host name"),
    ("address", "h\x1b]0;title\x07"),
])
def test_host_fields_refuse_control_characters_and_options(tmp_path, field, value):
    marker = tmp_path / "pwned"
    value = value.format(marker=marker)
    env = make_env(tmp_path, None)
    env.write_inventory(f"""hosts:
  h1:
    {field}: {json.dumps(value)}
    workdir: {tmp_path / 'w'}
""")
    for cmd in (["hosts", "check"], ["render", "job", "exec", "--host", "h1", "--out", str(tmp_path / "o"), "--", "true"]):
        line = one_line_usage_error(env.cli(*cmd))
        assert f"host 'h1', field {field}" in line and "\x1b" not in line, line
    assert not marker.exists()


def test_a_host_named_like_an_option_is_refused(tmp_path):
    env = make_env(tmp_path, None)
    env.write_inventory(f"""hosts:
  -oProxyCommand=true:
    workdir: {tmp_path / 'w'}
""")
    line = one_line_usage_error(env.cli("hosts", "check"))
    assert "field address" in line and "starts with '-'" in line


def test_openssh_gets_the_address_after_the_end_of_options(tmp_path):
    """Even an address that slipped past validation is a destination to ssh, never an option."""
    from kimi_eagle.config.inventory import Host, Pipeline
    from kimi_eagle.hosts.transport.ssh import SSHTransport

    marker = tmp_path / "pwned"
    host = Host(name="h", address=f"-oProxyCommand=touch {marker}", port=None, user=None, identity_file=None,
                python="python3", workdir="/tmp", env={}, transport="ssh", known_hosts=None, connect_timeout=3,
                pipeline=Pipeline())
    argv = SSHTransport(host).openssh_argv()
    subprocess.run(argv + ["true"], capture_output=True, timeout=30)
    time.sleep(0.2)
    assert not marker.exists()
    assert argv[-2:] == ["--", host.address]


@pytest.mark.parametrize("field, value, hint", [
    ("address", "root@gpu-01.example", "`user:`"),
    ("address", "gpu-01.example:2222", "`port:`"),
    ("rdzv_address", "head.example:29500", "`rdzv_port:`"),
])
def test_a_login_or_port_written_into_an_address_is_refused_naming_its_own_field(tmp_path, field, value, hint):
    """`address: host:port` or `user@host` passed, and half worked: fabric's small commands honoured them, OpenSSH (a
    model upload) read them as a host name it cannot resolve (exit 5 on a reachable host), and `user@host` with
    `user:` ended in a bare ValueError. They belong in their own fields: one line, exit 2, before any connection."""
    env = make_env(tmp_path, None)
    env.write_inventory(f"""hosts:
  h1:
    {field}: {json.dumps(value)}
    user: root
    workdir: {tmp_path / 'w'}
""")
    line = one_line_usage_error(env.cli("hosts", "check"))
    assert f"host 'h1', field {field}" in line and hint in line, line


def test_an_ipv6_address_is_still_an_address(tmp_path):
    env = make_env(tmp_path, None)
    env.write_inventory(f"""hosts:
  h1:
    address: "fe80::1"
    workdir: {tmp_path / 'w'}
""")
    r = env.cli("--json", "hosts")
    assert r.code == 0 and r.json()["hosts"][0]["address"] == "fe80::1", r.stdout + r.stderr
