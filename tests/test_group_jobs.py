"""Group jobs over several real sshd "hosts" on 127.0.0.1 (separate workdirs): sharded extraction, a failing
and an unreachable host, resume of the missing shards only, stop of all, and 2-node torchrun training (gloo on
CPU) through the c10d rendezvous on the first host.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, TINY_PIPELINE, Env
from sshd import Sshd, ephemeral_low, free_port

PY = sys.executable
DDP = str(REPO / "tests" / "ddp_tiny.py")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    started = [Sshd(tmp_path_factory.mktemp(f"sshd-{name}")).start() for name in "ab"]
    yield dict(zip("ab", started))
    for s in started:
        s.stop()


def group_env(tmp_path: Path, servers: dict, host_extra: dict | None = None, pipeline: str = "") -> Env:
    home = tmp_path / "home"
    (home / ".ssh").mkdir(parents=True)
    known = tmp_path / "known_hosts"
    known.write_text("".join(s.host_key_line() for s in servers.values()))
    env = Env(tmp_path, home, tmp_path / "inventory.yaml", tmp_path / "work-a")
    hosts = ""
    for name, s in servers.items():
        fields = dict((host_extra or {}).get(name, {}))
        host_env = {"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
                    "TOKENIZERS_PARALLELISM": "false", **fields.pop("env", {})}
        extra = "".join(f"\n    {k}: {json.dumps(v)}" for k, v in fields.items())
        hosts += f"""
  {name}:
    address: 127.0.0.1
    port: {s.port}
    user: root
    identity_file: {s.client_key}
    python: {PY}
    workdir: {tmp_path / f"work-{name}"}
    known_hosts: {known}
    env: {{{", ".join(f"{k}: {json.dumps(v)}" for k, v in host_env.items())}}}{extra}"""
    env.inventory.write_text(f"hosts:{hosts}\ngroups:\n  pair: [{', '.join(servers)}]\n{pipeline}")
    return env


def gid_of(text: str) -> str:
    return re.search(r"g-\d{8}-\d{6}-[a-z]+-[0-9a-f]{8}", text).group(0)


def wait_group(env, gid, states=("succeeded", "failed", "stopped"), timeout=180):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r = env.cli("--json", "status", gid)
        data = r.json()
        if data["state"] in states:
            return data
        time.sleep(0.5)
    raise AssertionError(f"group job {gid} never reached {states}: {data}")


SHARD = """
import os, sys, time
rank = int(sys.argv[sys.argv.index("--rank") + 1]); world = int(sys.argv[sys.argv.index("--world-size") + 1])
out = sys.argv[1]
os.makedirs(out, exist_ok=True)
print(f"shard {{rank}} of {{world}} on {{os.path.basename(os.getcwd())}}", flush=True)
if os.path.exists(os.path.join(out, f"fail-{{rank}}")):
    print(f"shard {{rank}} fails", flush=True); sys.exit(5)
time.sleep({sleep})
open(os.path.join(out, f"done-{{rank}}-{{time.time_ns()}}"), "w").close()
"""


def shard_script(tmp_path, sleep=0.0) -> str:
    p = tmp_path / "shard.py"
    p.write_text(SHARD.format(sleep=sleep))
    return str(p)


def done_ranks(out: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("done-*"))


def test_sharded_extraction_across_two_hosts_weighted_by_gpus_and_resumed(tmp_path, servers):
    # Each host's env names the GPUs it may use (by UUID here: on a machine with GPUs, no test GPU is taken); b's
    # shards get their own one each among b's, a's one shard its `gpus: 1` of a's two.
    env = group_env(tmp_path, servers, {"a": {"gpus": 1, "env": {"CUDA_VISIBLE_DEVICES": "GPU-a0,GPU-a1"}},
                                        "b": {"gpus": 2, "env": {"CUDA_VISIBLE_DEVICES": "GPU-b5,GPU-b7,GPU-b9"}}},
                    pipeline=TINY_PIPELINE)
    r = env.cli("run", "prepare", "--host", "a", "--no-preflight")
    assert r.code == 0, r.stderr
    # b gets the same tiny model and prepared samples by a local copy (both "hosts" live on this machine): the
    # test is about sharding the extraction, and a second prepare would only double its time.
    for sub in ("models", "out/prepared"):
        shutil.copytree(tmp_path / "work-a" / sub, tmp_path / "work-b" / sub)
    r = env.cli("run", "extract", "--group", "pair", "--shard-by", "gpus", "--no-preflight", "--no-gpu", timeout=600)
    assert r.code == 0, (r.stdout[-3000:], r.stderr[-3000:])
    # One view: both hosts' lines, prefixed by host; b runs its two ranks at once.
    assert "[a] [extract] rank 0/3" in r.stdout
    assert "[b] [extract] rank 1/3" in r.stdout and "[b] [extract] rank 2/3" in r.stdout
    # Where each shard ran, as launch says it in the log: among the GPUs each host's env lets it see.
    ran_on = sorted(re.findall(r"^\[([ab])\] ==> kimi-eagle: single: .*CUDA_VISIBLE_DEVICES=(\S+)", r.stdout, re.M))
    assert ran_on == [("a", "GPU-a0"), ("b", "GPU-b5"), ("b", "GPU-b7")], r.stdout[-3000:]
    gid = gid_of(r.stderr)
    # Every prepared sample was extracted exactly once across the hosts, by contiguous ranges.
    n = json.loads((tmp_path / "work-a" / "out" / "prepared" / "manifest.json").read_text())["count"]
    got = {h: sorted(int(p.stem.split("_")[1]) for p in (tmp_path / f"work-{h}" / "out" / "hidden_states").glob("hs_*.safetensors"))
           for h in "ab"}
    assert got["a"] == list(range(0, n // 3)) and got["b"] == list(range(n // 3, n))
    # status of the group job: one row per host with its ranks.
    st = env.cli("--json", "status", gid).json()
    assert st["state"] == "succeeded" and [m["shape"] for m in st["members"]] == ["ranks 0 of 3", "ranks 1-2 of 3"]
    # The same command again: nothing is missing, nothing starts.
    again = env.cli("run", "extract", "--group", "pair", "--shard-by", "gpus", "--no-preflight", "--no-gpu", "--detach")
    assert again.code == 0, again.stderr
    assert gid in again.stdout + again.stderr and again.stderr.count("succeeded before") == 2


def test_failing_host_is_reported_others_finish_and_rerun_resumes_only_it(tmp_path, servers):
    env = group_env(tmp_path, servers)
    out = tmp_path / "shards"
    out.mkdir()
    (out / "fail-1").touch()
    cmd = ["run", "exec", "--group", "pair", "--mode", "shards", "--", PY, shard_script(tmp_path), str(out)]
    r = env.cli(*cmd)
    assert r.code == 1, r.stderr
    assert "[a] shard 0 of 2" in r.stdout and "[b] shard 1 fails" in r.stdout
    gid = gid_of(r.stderr)
    st = env.cli("--json", "status", gid)
    assert st.code == 1, st.stderr
    st = st.json()
    assert st["state"] == "failed"
    assert [(m["host"], m["state"], m["job"]["exit_code"]) for m in st["members"]] == [("a", "succeeded", 0), ("b", "failed", 5)]
    assert done_ranks(out) == [0]
    first_a = st["members"][0]["job"]["id"]
    # Fix the cause and run the same command: only b's shard runs again, under the same group job.
    (out / "fail-1").unlink()
    r = env.cli(*cmd)
    assert r.code == 0, r.stderr
    assert "[a] shard" not in r.stdout and "[b] shard 1 of 2" in r.stdout
    st = env.cli("--json", "status", gid).json()
    assert st["state"] == "succeeded" and st["members"][0]["job"]["id"] == first_a
    assert done_ranks(out) == [0, 1]


def test_unreachable_host_is_reported_and_started_later(tmp_path, servers):
    env = group_env(tmp_path, servers)
    out = tmp_path / "shards"
    cmd = ["run", "exec", "--group", "pair", "--mode", "shards", "--detach", "--", PY, shard_script(tmp_path), str(out)]
    servers["b"].stop()
    try:
        r = env.cli(*cmd)
        # The network, not a job: exit 5 (the README's table), for the start and for the group's status after.
        assert r.code == 5, (r.stdout, r.stderr)
        assert "[b]" in r.stderr and "failed" in r.stderr and "[a] started" in r.stderr
        gid = gid_of(r.stderr)
        data = wait_group(env, gid)
        assert data["members"][0]["state"] == "succeeded" and data["members"][1]["state"] == "unreachable", data
        assert env.cli("status", gid).code == 5
        assert env.cli("logs", gid).code == 5
        # Followed (no --detach): the reached host's part succeeds, the run still says the connection failed.
        followed = env.cli(*[a for a in cmd if a != "--detach"])
        assert followed.code == 5 and "succeeded before" in followed.stderr, (followed.stdout, followed.stderr)
        # A host's own failure is the job's (1), even next to an unreachable one.
        failing = tmp_path / "failing"
        failing.mkdir()
        (failing / "fail-0").touch()
        other = env.cli(*[a for a in cmd if a != "--detach"][:-1], str(failing))
        assert other.code == 1, (other.stdout, other.stderr)
        # torchrun: a node that cannot be reached starts nothing anywhere, and says it is the connection.
        t = env.cli("run", "exec", "--group", "pair", "--mode", "torchrun", "--", DDP)
        assert t.code == 5 and "b: cannot reach 127.0.0.1" in t.stderr, (t.stdout, t.stderr)
        assert not list((tmp_path / "work-a").glob("runs/*/job.sh")) or "torchrun" not in t.stdout
    finally:
        servers["b"].start()
    r = env.cli(*cmd)
    assert r.code == 0, r.stderr
    assert "[a]" in r.stderr and "succeeded before" in r.stderr and "[b] started" in r.stderr
    data = wait_group(env, gid)
    assert data["state"] == "succeeded", data
    assert done_ranks(out) == [0, 1]


def test_logs_follow_and_stop_cover_every_host(tmp_path, servers):
    env = group_env(tmp_path, servers)
    out = tmp_path / "shards"
    r = env.cli("--json", "run", "exec", "--group", "pair", "--mode", "shards", "--detach", "--",
                PY, shard_script(tmp_path, sleep=300), str(out))
    assert r.code == 0, r.stderr
    gid = r.json()["id"]
    deadline = time.monotonic() + 60
    while True:
        logs = env.cli("logs", gid)
        if "[a] shard 0 of 2" in logs.stdout and "[b] shard 1 of 2" in logs.stdout:
            break
        assert time.monotonic() < deadline, logs.stdout
        time.sleep(0.5)
    assert logs.code == 3  # still running
    stop = env.cli("stop", gid, "--grace", "1")
    assert stop.code == 0, stop.stderr
    assert "[a]" in stop.stdout and "[b]" in stop.stdout
    data = env.cli("--json", "status", gid).json()
    assert data["state"] == "stopped" and {m["state"] for m in data["members"]} == {"stopped"}
    assert done_ranks(out) == []


def test_stop_and_logs_name_a_member_whose_host_this_inventory_lacks(tmp_path, servers):
    """A group job stopped (or read) through an inventory without one of its hosts: that member's job is named, with
    its host, as not stopped (not read), and the exit is not 0; the others are stopped. It was left out silently:
    `stop` exited 0 while b's job ran on."""
    env = group_env(tmp_path, servers)
    r = env.cli("--json", "run", "exec", "--group", "pair", "--mode", "shards", "--detach", "--",
                PY, shard_script(tmp_path, sleep=300), str(tmp_path / "shards"))
    assert r.code == 0, r.stderr
    gid = r.json()["id"]
    members = {o["host"]: o["job_id"] for o in r.json()["outcomes"]}
    text = env.inventory.read_text()
    only_a = Env(tmp_path, env.home, tmp_path / "only-a.yaml", env.workdir)
    only_a.inventory.write_text(text[:text.index("\n  b:\n")] + text[text.index("\ngroups:"):].replace("[a, b]", "[a]"))
    try:
        stop = only_a.cli("stop", gid, "--grace", "1")
        said = stop.stdout + stop.stderr
        assert stop.code == 1, (stop.code, said)
        assert f"[a] job {members['a']} stopped" in said, said
        assert f"[b] b: not in this inventory" in said and f"its job {members['b']} was not stopped" in said, said
        data = env.cli("--json", "status", gid).json()
        assert [m["state"] for m in data["members"]] == ["stopped", "running"], data
        logs = only_a.cli("logs", gid)
        assert logs.code != 0 and f"its job {members['b']} was not read" in logs.stdout + logs.stderr, (logs.stdout, logs.stderr)
    finally:
        assert env.cli("stop", gid, "--grace", "1").code == 0


def test_a_member_job_is_found_through_another_inventory_that_names_its_machine_otherwise(tmp_path, servers):
    """`status MEMBER` (no --host) through another inventory file, where a's machine is called node-a and the name a
    is another machine (b's): the member is found where it runs, by its recorded machine, as a --host job is.
    The group's start recorded the member by name alone, so the other machine was asked ("no job ...", exit 2)."""
    env = group_env(tmp_path, servers)
    r = env.cli("--json", "run", "exec", "--group", "pair", "--mode", "shards", "--detach", "--",
                PY, shard_script(tmp_path), str(tmp_path / "shards"))
    assert r.code == 0, r.stderr
    members = {o["host"]: o["job_id"] for o in r.json()["outcomes"]}
    wait_group(env, r.json()["id"])
    renamed = Env(tmp_path, env.home, tmp_path / "renamed.yaml", env.workdir)
    renamed.inventory.write_text(env.inventory.read_text().replace("\n  a:\n", "\n  node-a:\n")
                                 .replace("\n  b:\n", "\n  a:\n").replace("[a, b]", "[node-a, a]"))
    for host, job in members.items():
        st = renamed.cli("--json", "status", job)
        assert st.code == 0, (host, st.stdout, st.stderr)
        assert st.json()["jobs"][0]["host"] == {"a": "node-a", "b": "a"}[host], st.stdout


def test_a_member_whose_start_lost_its_answer_is_kept_and_not_started_twice(tmp_path, servers):
    """b's connection drops (really) after its host started b's shard, before the answer came back: the group job
    keeps that job as b's, so `status` shows it running and the same command again leaves it alone. b's part was
    "not started", and the command again started a second shard on b beside the first."""
    from test_jobs import cutting_python

    env = group_env(tmp_path, servers)
    text = env.inventory.read_text()
    at = text.index("\n  b:\n")
    wrapper = cutting_python(tmp_path, servers["b"], "after")
    env.inventory.write_text(text[:at] + text[at:].replace(f"python: {PY}", f"python: {wrapper}", 1))
    cmd = ["run", "exec", "--group", "pair", "--mode", "shards", "--detach", "--",
           PY, shard_script(tmp_path, sleep=300), str(tmp_path / "shards")]
    r = env.cli(*cmd)
    assert r.code == 5, (r.stdout, r.stderr)
    gid = gid_of(r.stderr)
    try:
        (job_b,) = [p.name for p in (tmp_path / "work-b" / "runs").iterdir() if p.is_dir()]
        assert f"job {job_b} may have started on b" in r.stderr, r.stderr
        members = env.cli("--json", "status", gid).json()["members"]
        assert [(m["host"], m["state"], (m["job"] or {}).get("id")) for m in members][1] == ("b", "running", job_b), members
        again = env.cli(*cmd)
        assert again.code == 0 and again.stderr.count("still running; not started again") == 2, again.stderr
        assert len([p for p in (tmp_path / "work-b" / "runs").iterdir() if p.is_dir()]) == 1
    finally:
        assert env.cli("stop", gid, "--grace", "1").code == 0


def test_the_ports_tests_listen_on_are_never_ones_the_kernel_lends_to_outgoing_connections():
    """A rendezvous (or sshd) port picked early and bound later must not be taken in between as the local end of
    one of the suite's outgoing connections: picked below the ephemeral range, each one once."""
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == 50 and all(1024 < p < ephemeral_low() for p in ports), ports


def test_two_node_training_through_c10d_rendezvous_on_the_first_host(tmp_path, servers):
    port = free_port()
    env = group_env(tmp_path, servers, {h: {"rdzv_port": port} for h in "ab"})
    out = tmp_path / "ddp"
    r = env.cli("run", "exec", "--group", "pair", "--mode", "torchrun", "--", DDP, "--out", str(out), timeout=300)
    assert r.code == 0, (r.stdout[-3000:], r.stderr[-3000:])
    ranks = [json.loads((out / f"ddp-rank{i}.json").read_text()) for i in range(2)]
    assert {x["world"] for x in ranks} == {2}
    assert ranks[0]["checksum"] == ranks[1]["checksum"]  # DDP kept the two nodes' weights identical
    assert "[a] ddp rank" in r.stdout and "[b] ddp rank" in r.stdout
    assert f"rendezvous 127.0.0.1:{port}" in r.stderr


def test_rendezvous_problems_refuse_the_start_naming_the_host(tmp_path, servers):
    port = free_port()
    busy = socket.socket()
    busy.bind(("127.0.0.1", port))
    busy.listen()
    try:
        env = group_env(tmp_path, servers, {h: {"rdzv_port": port} for h in "ab"})
        r = env.cli("run", "exec", "--group", "pair", "--mode", "torchrun", "--", DDP)
    finally:
        busy.close()
    assert r.code == 1
    assert f"a: cannot serve the rendezvous at 127.0.0.1:{port}: port {port} is in use" in r.stderr
    # An address that is not the first host's (a wrong rdzv_address in the inventory): refused, nothing started.
    env = group_env(tmp_path / "2", servers, {"a": {"rdzv_address": "10.255.255.1", "rdzv_port": free_port()}})
    r = env.cli("run", "exec", "--group", "pair", "--mode", "torchrun", "--", DDP)
    assert r.code == 1 and "10.255.255.1 is not an address of this host" in r.stderr
    assert not list((tmp_path / "2" / "work-b").glob("runs/*/job.sh"))


@pytest.mark.parametrize("hidden_states", ["offline", "online"])
def test_train_over_two_hosts_is_one_torchrun_job(tmp_path, servers, hidden_states):
    """The real train step across the group: kimi_eagle_host.pipeline.launch on each host joins the c10d rendezvous
    on a. Online, each host's first rank runs an engine of its own for its ranks' rows: no hidden-state files on
    either host."""
    port = free_port()
    env = group_env(tmp_path, servers, {h: {"rdzv_port": port} for h in "ab"},
                    pipeline=TINY_PIPELINE + "  epochs: 1\n  draft_vocab_size: 128\n")
    online = hidden_states == "online"
    for step in ("prepare", "vocab") if online else ("prepare", "extract", "vocab"):
        r = env.cli("run", step, "--host", "a", "--no-preflight", "--no-gpu", timeout=600)
        assert r.code == 0, (step, r.stderr[-2000:])
    shutil.copytree(tmp_path / "work-a" / "models", tmp_path / "work-b" / "models")
    shutil.copytree(tmp_path / "work-a" / "out", tmp_path / "work-b" / "out")  # each node reads its own copy
    r = env.cli("run", "train", "--group", "pair", "--no-preflight", "--no-gpu", f"hidden_states={hidden_states}",
                timeout=900)
    assert r.code == 0, (r.stdout[-3000:], r.stderr[-3000:])
    engines = sorted(re.findall(r"^\[([ab])\].*online: engine hf started", r.stdout, re.M))
    assert engines == (["a", "b"] if online else []), r.stdout
    for h in "ab":
        assert (tmp_path / f"work-{h}" / "out" / "hidden_states").exists() is not online
    assert "torchrun-multinode: 1 process(es) per node x 2 node(s)" in r.stdout
    answers = {line[1]: json.loads(line.split("] ", 1)[1]) for line in r.stdout.splitlines()
               if re.match(r'^\[[ab]\] \{"ok"', line)}
    assert len(answers) == 1  # rank 0 answers for both nodes (c10d picks which host it is)
    (host, answer), = answers.items()
    assert answer["ok"] and answer["finished"] and answer["world_size"] == 2 and answer["parallel"] == "ddp"
    assert (tmp_path / f"work-{host}" / "out" / "draft" / "export" / "config.json").exists()
    assert "[rank 1] result:" in r.stdout  # the other node's rank ran the same steps
