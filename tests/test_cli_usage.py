"""Usage errors are one line and exit 2, whatever click the installed typer uses (typer >= 0.2x bundles its own);
`--version`; `--help` shows no `<bool>` placeholder and every option says what it does."""

from __future__ import annotations

import json

import pytest

from conftest import make_env

USAGE_ERRORS = {
    "unknown option": (["--bogus"], "--bogus"),
    "unknown option of a command": (["status", "--bogus"], "--bogus"),
    "missing argument": (["logs"], "JOB"),
    "negative grace": (["stop", "x", "--grace", "-1"], "--grace"),
    "missing upload path": (["upload", "/nonexistent", "--to", "x"], "/nonexistent"),
    "unknown command": (["frobnicate"], "frobnicate"),
    "not a number": (["logs", "j", "--tail", "many"], "--tail"),
}


@pytest.mark.parametrize("case", sorted(USAGE_ERRORS))
def test_usage_error_is_one_line_and_exit_2(tmp_path, case):
    argv, needle = USAGE_ERRORS[case]
    r = make_env(tmp_path, None).cli(*argv)
    assert r.code == 2, (r.stdout, r.stderr)
    assert "Traceback" not in r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], r.stderr
    assert r.stdout == ""


def test_version(tmp_path):
    from kimi_eagle import __version__

    r = make_env(tmp_path, None).cli("--version")
    assert r.code == 0 and r.stdout.strip() == f"kimi-eagle {__version__}", (r.stdout, r.stderr)


def _commands():
    from kimi_eagle.cli.app import command

    todo = [command()]
    while todo:
        c = todo.pop()
        yield c
        todo += list(getattr(c, "commands", {}).values())


def test_every_option_has_a_description_and_flags_show_no_placeholder(tmp_path):
    names = []
    for c in _commands():
        for p in c.params:
            if p.param_type_name == "option" and "--help" not in p.opts:
                assert (p.help or "").strip(), f"{c.name} {p.opts}: no description"
        names.append(c.name)
    assert {"run", "logs", "stop", "gpu-reset", "deploy-patch", "trust"} <= set(names)
    e = make_env(tmp_path, None)
    for argv in (["run", "--help"], ["gpu-reset", "--help"], ["deploy-patch", "--help"], ["--help"]):
        r = e.cli(*argv, env={"COLUMNS": "200"})
        assert r.code == 0, r.stderr
        assert "<bool>" not in r.stdout, r.stdout


def test_shell_completion_is_shown_and_completes_commands_and_options(tmp_path):
    e = make_env(tmp_path, None)
    # Typer finds the shell to show completion for among the command's ancestors (shellingham), as a user's shell
    # is: the CLI runs under a bash here, as it would at a prompt (a test runner's own ancestry may have none: a
    # suite started in the background under init failed here with "Shell  not supported").
    r = e.cli("--show-completion", "bash", under_bash=True)
    assert r.code == 0, r.stderr
    assert "_KIMI_EAGLE_COMPLETE=complete_bash" in r.stdout and "complete -o default -F _kimi_eagle_completion kimi-eagle" in r.stdout
    # What bash then asks for: the words so far, answered with the candidates.
    for words, cword, want in (("kimi-eagle pu", "1", "pull"), ("kimi-eagle clean --d", "2", "--dry-run"),
                               ("kimi-eagle run all --rec", "3", "--recipe")):
        r = e.cli(env={"_KIMI_EAGLE_COMPLETE": "complete_bash", "COMP_WORDS": words, "COMP_CWORD": cword})
        assert r.code == 0 and want in r.stdout.split(), (words, r.stdout, r.stderr)


def test_json_is_accepted_after_the_command_too(tmp_path):
    e = make_env(tmp_path, None)
    for argv in (["hosts", "--json"], ["status", "--host", "local", "--json"], ["hosts", "check", "local", "--json"]):
        r = e.cli(*argv)
        assert r.code == 0, (argv, r.stdout, r.stderr)
        assert r.stdout.lstrip()[0] in "[{" and r.json() is not None, (argv, r.stdout)
    # After `--` it is the command's own argument, not ours.
    r = e.cli("--json", "run", "exec", "--host", "local", "--no-gpu", "--", "echo", "--json")
    assert r.code == 0, r.stderr
    assert any(json.loads(ln).get("line") == "--json" for ln in r.stdout.splitlines()), r.stdout


@pytest.mark.parametrize("command", ["pull", "clean"])
def test_pull_or_clean_without_a_job_or_run_says_that_whatever_the_hosts(tmp_path, command):
    e = make_env(tmp_path, None)
    e.write_inventory(e.inventory.read_text() + f"""  other:
    transport: local
    workdir: {tmp_path / "otherwork"}
""")
    for argv in ([command], [command, "--host", "local"]):
        r = e.cli(*argv)
        lines = r.stderr.strip().splitlines()
        assert r.code == 2 and len(lines) == 1, (argv, r.stdout, r.stderr)
        assert "JOB" in lines[0] and "--run" in lines[0] and "--host" not in lines[0], lines[0]
    r = e.cli(command, "some-job", "--run", "out", "--host", "local")
    assert r.code == 2 and "not both" in r.stderr, r.stderr


def test_a_group_exec_without_a_mode_names_the_option_that_exists(tmp_path):
    e = make_env(tmp_path, None, extra="groups:\n  pair: [local]\n")
    for argv in (["run", "exec", "--group", "pair", "--", "true"],
                 ["run", "exec", "--group", "pair", "--mode", "both", "--", "true"]):
        r = e.cli(*argv)
        lines = r.stderr.strip().splitlines()
        assert r.code == 2 and len(lines) == 1, (r.stdout, r.stderr)
        assert "--mode shards" in lines[0] and "--mode torchrun" in lines[0], lines[0]
    help_text = e.cli("run", "--help").stdout
    assert "--mode" in help_text and "--shards " not in help_text and "--torchrun" not in help_text


def test_run_from_the_clone_the_demo_host_is_the_embedded_default(tmp_path):
    """The clone ships its example inventory under another name: a command run in the clone without
    --inventory reads the embedded default, whose only host is `local`, as it does anywhere else."""
    import os
    import subprocess
    import sys

    from conftest import REPO

    env = {**os.environ, "HOME": str(tmp_path), "NO_COLOR": "1", "PYTHONPATH": str(REPO)}
    env.pop("KIMI_EAGLE_INVENTORY", None)
    r = subprocess.run([sys.executable, "-m", "kimi_eagle", "hosts", "--json"], capture_output=True, text=True,
                       env=env, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    hosts = json.loads(r.stdout)["hosts"]
    assert [h["name"] for h in hosts] == ["local"], hosts
    assert hosts[0]["workdir"].endswith(".cache/kimi-eagle/local")
