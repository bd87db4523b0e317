"""hosts, hosts check, hosts trust: against a real sshd on 127.0.0.1."""

from __future__ import annotations

import os
import subprocess

from conftest import make_env


def test_hosts_lists_inventory(env):
    r = env.cli("--json", "hosts")
    assert r.code == 0, r.stderr
    names = {h["name"]: h for h in r.json()["hosts"]}
    assert names["gpu"]["transport"] == "ssh" and names["local"]["transport"] == "local"


def test_check_over_ssh_and_local_report_the_same_facts(env):
    r = env.cli("--json", "hosts", "check")
    assert r.code == 0, r.stderr
    by_host = {d["host"]: d for d in r.json()}
    assert by_host["gpu"]["ok"] and by_host["local"]["ok"]
    # Both run the same interpreter here, so both probes must agree.
    for key in ("python", "executable", "packages"):
        assert by_host["gpu"][key] == by_host["local"][key]
    assert by_host["gpu"]["packages"]["vllm"] is None  # missing is reported, not an error
    human = env.cli("hosts", "check", "gpu")
    assert human.code == 0 and "[gpu] reachable" in human.stdout and "vllm missing" in human.stdout


def test_check_lists_a_gpu_whose_memory_nvidia_smi_does_not_report(tmp_path, sshd):
    """A unified-memory GPU (GB10, Grace Hopper): nvidia-smi says [N/A] for its memory. The probe crashed on it; the
    GPU is listed, its memory unknown."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\necho '0, NVIDIA GB10, [N/A], [N/A], 580.95.05'\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    e = make_env(tmp_path, sshd, host_env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    r = e.cli("--json", "hosts", "check", "gpu")
    assert r.code == 0, r.stdout + r.stderr
    (gpu,) = r.json()[0]["gpus"]
    assert gpu == {"index": 0, "name": "NVIDIA GB10", "memory_used_mib": None, "memory_total_mib": None,
                   "driver": "580.95.05"}
    human = e.cli("hosts", "check", "gpu")
    assert human.code == 0 and "[gpu] GPU 0: NVIDIA GB10  memory unknown" in human.stdout, human.stdout


def test_unknown_host_key_is_refused_with_fingerprint_and_trust_command(tmp_path, sshd):
    e = make_env(tmp_path, sshd, trusted=False)
    r = e.cli("hosts", "check", "gpu")
    assert r.code == 1
    fp = subprocess.run(["ssh-keygen", "-lf", str(sshd.host_key) + ".pub"], capture_output=True, text=True).stdout.split()[1]
    assert "unknown host key" in r.stdout + r.stderr
    assert fp in r.stdout + r.stderr  # the same SHA256 fingerprint OpenSSH shows
    assert "kimi-eagle hosts trust gpu" in r.stdout + r.stderr
    # Nothing was added silently.
    assert (tmp_path / "known_hosts").read_text() == ""
    assert not (e.home / ".ssh" / "known_hosts").exists()

    # Non-interactive trust without --yes is refused; with the wrong fingerprint too.
    assert e.cli("hosts", "trust", "gpu").code == 2
    bad = e.cli("hosts", "trust", "gpu", "--fingerprint", "SHA256:AAAA")
    assert bad.code == 1 and (tmp_path / "known_hosts").read_text() == ""
    ok = e.cli("hosts", "trust", "gpu", "--fingerprint", fp)
    assert ok.code == 0, ok.stderr
    assert fp in ok.stdout
    assert e.cli("hosts", "check", "gpu").code == 0


def test_changed_host_key_is_always_refused(tmp_path, sshd):
    e = make_env(tmp_path, sshd, trusted=False)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    kind, b64 = (tmp_path / "other.pub").read_text().split()[:2]
    (tmp_path / "known_hosts").write_text(f"[127.0.0.1]:{sshd.port} {kind} {b64}\n")
    r = e.cli("hosts", "check", "gpu")
    assert r.code == 1
    assert "HOST KEY CHANGED" in r.stdout + r.stderr
    # trust does not paper over a changed key either: check still refuses after a trust attempt without --yes
    assert e.cli("hosts", "check", "gpu").code == 1


def test_ssh_config_alias_is_honoured(tmp_path, sshd):
    e = make_env(tmp_path, sshd)
    (e.home / ".ssh" / "config").write_text(
        f"Host gpu-alias\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n  IdentityFile {sshd.client_key}\n"
    )
    e.write_inventory(
        f"""hosts:
  box:
    address: gpu-alias
    known_hosts: {tmp_path / 'known_hosts'}
    python: {__import__('sys').executable}
    workdir: {tmp_path / 'w'}
"""
    )
    r = e.cli("--json", "hosts", "check", "box")
    assert r.code == 0, r.stderr
    assert r.json()[0]["ok"]


def test_unreachable_host_is_reported_per_host(tmp_path, sshd):
    e = make_env(tmp_path, sshd)
    from sshd import free_port

    text = e.inventory.read_text().replace(f"port: {sshd.port}", f"port: {free_port()}")
    e.inventory.write_text(text)
    r = e.cli("--json", "hosts", "check")
    assert r.code == 5  # the only failure is the connection
    by_host = {d["host"]: d for d in r.json()}
    assert by_host["local"]["ok"] and not by_host["gpu"]["ok"]
    assert "cannot reach" in by_host["gpu"]["error"]


def test_proxyjump_hops_are_verified_too(tmp_path, sshd):
    """ProxyJump from ~/.ssh/config works, and the jump host's key is checked like the target's."""
    import sys

    e = make_env(tmp_path, sshd)
    (e.home / ".ssh" / "config").write_text(
        f"Host jump\n  HostName localhost\n  Port {sshd.port}\n  User root\n  IdentityFile {sshd.client_key}\n"
        f"Host box\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n  IdentityFile {sshd.client_key}\n  ProxyJump jump\n"
    )
    known = tmp_path / "known_hosts"  # trusts [127.0.0.1]:port only, not the jump host's name
    e.write_inventory(f"hosts:\n  box:\n    address: box\n    known_hosts: {known}\n    python: {sys.executable}\n"
                      f"    workdir: {tmp_path / 'w'}\n")
    r = e.cli("hosts", "check", "box")
    assert r.code == 1 and "unknown host key" in r.stdout + r.stderr and "localhost" in r.stdout + r.stderr
    assert known.read_text() == sshd.host_key_line()  # nothing was added
    known.write_text(sshd.host_key_line() + sshd.host_key_line().replace("[127.0.0.1]", "[localhost]"))
    r = e.cli("--json", "hosts", "check", "box")
    assert r.code == 0, r.stdout + r.stderr


def _other_key(tmp_path):
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "other")], check=True)
    kind, b64 = (tmp_path / "other.pub").read_text().split()[:2]
    fp = subprocess.run(["ssh-keygen", "-lf", str(tmp_path / "other.pub")], capture_output=True, text=True).stdout.split()[1]
    return kind, b64, fp


def _fp(sshd):
    return subprocess.run(["ssh-keygen", "-lf", str(sshd.host_key) + ".pub"], capture_output=True, text=True).stdout.split()[1]


def test_trust_yes_on_a_changed_key_refuses_and_records_nothing(tmp_path, sshd):
    """It used to append a second, conflicting line and exit 0 (OpenSSH then accepts either key)."""
    e = make_env(tmp_path, sshd, trusted=False)
    kind, b64, old_fp = _other_key(tmp_path)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {kind} {b64}\n")
    before = known.read_text()
    r = e.cli("hosts", "trust", "gpu", "--yes")
    out = r.stdout + r.stderr
    assert r.code == 1, out
    assert "HOST KEY CHANGED" in out and old_fp in out and _fp(sshd) in out
    assert f"--replace {old_fp} --fingerprint {_fp(sshd)}" in out
    assert known.read_text() == before
    # The same with --fingerprint naming the new key: still a changed key, still refused.
    r = e.cli("hosts", "trust", "gpu", "--fingerprint", _fp(sshd))
    assert r.code == 1 and known.read_text() == before


def test_changed_key_hint_removes_the_right_line_for_a_non_22_port(tmp_path, sshd):
    """The suggested ssh-keygen command names [host]:port and the inventory's known_hosts file, and works."""
    import re
    import shlex

    e = make_env(tmp_path, sshd, trusted=False)
    kind, b64, old_fp = _other_key(tmp_path)
    known = tmp_path / "known_hosts"
    known.write_text(f"[127.0.0.1]:{sshd.port} {kind} {b64}\n")
    r = e.cli("hosts", "check", "gpu")
    out = r.stdout + r.stderr
    assert r.code == 1 and "HOST KEY CHANGED" in out
    m = re.search(r"(ssh-keygen -R .*? -f \S+)\)", out)
    assert m, out
    argv = shlex.split(m.group(1))
    assert argv[2] == f"[127.0.0.1]:{sshd.port}" and argv[4] == str(known)
    subprocess.run(argv, check=True, capture_output=True)
    r = e.cli("hosts", "check", "gpu")
    assert r.code == 1 and "unknown host key" in r.stdout + r.stderr  # the old key is gone; the new one not yet trusted


def test_trusting_the_same_key_twice_adds_no_duplicate_line(tmp_path, sshd):
    e = make_env(tmp_path, sshd, trusted=False)
    known = tmp_path / "known_hosts"
    for _ in range(2):
        r = e.cli("hosts", "trust", "gpu", "--yes")
        assert r.code == 0, r.stderr
    assert known.read_text() == sshd.host_key_line()
    assert "already recorded" in r.stdout
    # A key only ~/.ssh/known_hosts holds is recorded in the inventory's file all the same: teammates read that one.
    known.write_text("")
    (e.home / ".ssh" / "known_hosts").write_text(sshd.host_key_line())
    r = e.cli("hosts", "trust", "gpu", "--yes")
    assert r.code == 0 and f"recorded in {known}" in r.stdout and known.read_text() == sshd.host_key_line()


def test_a_changed_key_is_replaced_only_by_naming_old_and_new_fingerprints(tmp_path, sshd):
    e = make_env(tmp_path, sshd, trusted=False)
    kind, b64, old_fp = _other_key(tmp_path)
    known = tmp_path / "known_hosts"
    known.write_text(f"# ours\n[127.0.0.1]:{sshd.port} {kind} {b64}\nother.example {kind} {b64}\n")
    new_fp = _fp(sshd)
    # --replace alone, or naming the wrong old key, changes nothing.
    assert e.cli("hosts", "trust", "gpu", "--replace", old_fp, "--yes").code == 2
    wrong = e.cli("hosts", "trust", "gpu", "--replace", new_fp, "--fingerprint", new_fp)
    assert wrong.code == 1 and "not the recorded key" in wrong.stdout + wrong.stderr
    assert old_fp in known.read_text() or b64 in known.read_text()
    ok = e.cli("hosts", "trust", "gpu", "--replace", old_fp, "--fingerprint", new_fp)
    assert ok.code == 0, ok.stdout + ok.stderr
    assert f"removed the old key ssh-ed25519 {old_fp}" in ok.stdout
    # Only that host's old line went; the comment and the other host's line stay; the new key is there once.
    assert known.read_text() == f"# ours\nother.example {kind} {b64}\n" + sshd.host_key_line()
    assert e.cli("hosts", "check", "gpu").code == 0
    # The OpenSSH client (the large-upload path, the user's own ssh) accepts the host with this file alone.
    r = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes", "-o", f"UserKnownHostsFile={known}",
                        "-i", str(sshd.client_key), "-p", str(sshd.port), "root@127.0.0.1", "true"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_unreachable_is_said_only_when_no_connection_was_made(tmp_path, sshd):
    from sshd import free_port

    e = make_env(tmp_path, sshd, trusted=False)
    r = e.cli("hosts", "check", "gpu")  # reached, but its key is unknown: refused, not unreachable
    assert r.code == 1 and "[gpu] failed:" in r.stdout and "unreachable" not in r.stdout, r.stdout
    e = make_env(tmp_path / "b", sshd)
    e.inventory.write_text(e.inventory.read_text().replace(f"python: {__import__('sys').executable}", "python: /no/such/python3", 1))
    r = e.cli("hosts", "check", "gpu")  # reached and logged in; the inventory's python is not there: its fix, exit 2
    assert r.code == 2 and "[gpu] failed:" in r.stdout and "unreachable" not in r.stdout, r.stdout
    assert "set `python:` in the inventory" in r.stdout, r.stdout
    e.inventory.write_text(e.inventory.read_text().replace(f"port: {sshd.port}", f"port: {free_port()}"))
    r = e.cli("hosts", "check", "gpu")
    assert r.code == 5 and "[gpu] unreachable:" in r.stdout, r.stdout  # the network, not the host: its own code


def _key_line(name: str, pub) -> str:
    kind, b64 = pub.read_text().split()[:2]
    return f"{name} {kind} {b64}\n"


def test_certificate_authorities_revoked_keys_and_damaged_lines_leave_the_other_hosts_reachable(tmp_path, sshd):
    """An `@cert-authority` line (SSH certificates, common on clusters), an `@revoked` line or one damaged line, even
    about other machines, made every host unreachable: paramiko's loader raised on them. They are read as OpenSSH
    reads them: a CA line is skipped, a damaged line too (one warning naming the file and line), a revoked key is
    never accepted."""
    e = make_env(tmp_path, sshd)
    _other_key(tmp_path)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "ca")], check=True)
    ca_line = _key_line("@cert-authority *.example.org", tmp_path / "ca.pub")
    revoked_other = _key_line("@revoked *", tmp_path / "other.pub")
    damaged = "old.example.org ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIE\n"   # a paste cut short
    user_file = e.home / ".ssh" / "known_hosts"
    user_file.write_text(ca_line + revoked_other + damaged)
    r = e.cli("hosts", "check", "gpu")
    assert r.code == 0, r.stdout + r.stderr
    assert f"{user_file}:3:" in r.stderr and r.stderr.count("warning") == 1, r.stderr
    # OpenSSH reads the same files the same way
    ssh = subprocess.run(["ssh", "-o", "BatchMode=yes", "-o", "StrictHostKeyChecking=yes",
                          "-o", f"UserKnownHostsFile={user_file} {tmp_path / 'known_hosts'}", "-i", str(sshd.client_key),
                          "-p", str(sshd.port), "root@127.0.0.1", "true"], capture_output=True, text=True)
    assert ssh.returncode == 0, ssh.stderr
    # The host's own key marked revoked: refused, though the inventory's file trusts it; and never recorded again.
    user_file.write_text(ca_line + _key_line("@revoked *", sshd.host_key.with_suffix(".pub")))
    r = e.cli("hosts", "check", "gpu")
    assert r.code == 1 and "@revoked" in r.stdout and f"{user_file}:2" in r.stdout, r.stdout + r.stderr
    (tmp_path / "known_hosts").write_text("")
    r = e.cli("hosts", "trust", "gpu", "--yes")
    assert r.code == 1 and "@revoked" in r.stdout + r.stderr and (tmp_path / "known_hosts").read_text() == ""


def test_trust_compares_keys_of_the_same_type_and_records_into_the_inventorys_file(tmp_path):
    """OpenSSH records every key a host has (ed25519, ecdsa, rsa); paramiko is offered the ed25519 one. `hosts trust`
    took the others for a changed key (a false man-in-the-middle alarm whose advice removed valid keys), and called a
    key "already recorded" in the inventory's file when only ~/.ssh/known_hosts held it (teammates sharing the
    inventory's file kept meeting an unknown key)."""
    from sshd import Sshd, keygen

    server = Sshd(tmp_path / "sshd")
    extra = {k: keygen(server.root / f"ssh_host_{k}_key", k) for k in ("ecdsa", "rsa")}
    server.write_config("\n".join(f"HostKey {k}" for k in extra.values()))
    server.start()
    try:
        e = make_env(tmp_path, server, trusted=False)
        name = f"[127.0.0.1]:{server.port}"
        lines = {"ed25519": server.host_key_line(), **{k: _key_line(name, v.with_suffix(".pub")) for k, v in extra.items()}}
        user_file, team = e.home / ".ssh" / "known_hosts", tmp_path / "known_hosts"
        user_file.write_text(lines["ed25519"] + lines["ecdsa"] + lines["rsa"])
        r = e.cli("hosts", "trust", "gpu", "--yes")
        assert r.code == 0 and "HOST KEY CHANGED" not in r.stdout + r.stderr, r.stdout + r.stderr
        assert team.read_text() == lines["ed25519"]            # into the inventory's file, which teammates read
        assert user_file.read_text() == lines["ed25519"] + lines["ecdsa"] + lines["rsa"]   # nothing removed
        r = e.cli("hosts", "trust", "gpu", "--yes")
        assert r.code == 0 and f"already recorded in {team}" in r.stdout and team.read_text() == lines["ed25519"]
        # Only another type known (an older ssh recorded ecdsa): not a change either, and nothing of it is touched.
        user_file.write_text(lines["ecdsa"])
        team.write_text("")
        r = e.cli("hosts", "trust", "gpu", "--yes")
        assert r.code == 0, r.stdout + r.stderr
        assert team.read_text() == lines["ed25519"] and user_file.read_text() == lines["ecdsa"]
        assert e.cli("hosts", "check", "gpu").code == 0
    finally:
        server.stop()


def _run_advice(out: str) -> None:
    """Runs the command an error line tells the user to run (`…record it: echo '…' >> FILE`), as a user would."""
    command = out.split("record it: ", 1)[1].splitlines()[0].strip()
    subprocess.run(["bash", "-c", command], check=True)


def test_first_contact_through_proxyjump_gives_advice_that_works(tmp_path, sshd):
    """An unknown key on a ProxyJump host or on its jump host said `run: kimi-eagle hosts trust box`, which refuses
    every ProxyJump host. Now it names whose key it is and the exact known_hosts line, as a command to run."""
    import sys

    e = make_env(tmp_path, sshd)
    (e.home / ".ssh" / "config").write_text(
        f"Host jump\n  HostName localhost\n  Port {sshd.port}\n  User root\n  IdentityFile {sshd.client_key}\n"
        f"Host box\n  HostName 127.0.0.1\n  Port {sshd.port}\n  User root\n  IdentityFile {sshd.client_key}\n  ProxyJump jump\n"
    )
    known = tmp_path / "known_hosts"
    known.write_text("")
    e.write_inventory(f"hosts:\n  box:\n    address: box\n    known_hosts: {known}\n    python: {sys.executable}\n"
                      f"    workdir: {tmp_path / 'w'}\n")
    r = e.cli("hosts", "check", "box")
    assert r.code == 1 and "a jump host on the way to box" in r.stdout and f"[localhost]:{sshd.port}" in r.stdout, r.stdout
    _run_advice(r.stdout)
    r = e.cli("hosts", "check", "box")
    assert r.code == 1 and "box itself, reached through ProxyJump" in r.stdout, r.stdout
    assert f"[127.0.0.1]:{sshd.port}" in r.stdout and _fp(sshd) in r.stdout
    _run_advice(r.stdout)
    r = e.cli("--json", "hosts", "check", "box")
    assert r.code == 0, r.stdout + r.stderr
    assert sorted(known.read_text().splitlines()) == sorted(
        [sshd.host_key_line().strip(), sshd.host_key_line().replace("[127.0.0.1]", "[localhost]").strip()])
    # `hosts trust` says what to do instead of a dead end
    r = e.cli("hosts", "trust", "box", "--yes")
    assert r.code == 2 and "kimi-eagle hosts check box" in r.stderr, r.stderr
