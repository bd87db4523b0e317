"""pull and clean over the real sshd: a job's results come back verified and only what changed travels; the
bulky intermediates go only after their size was shown and never while a job using them runs."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time

import pytest

from conftest import REPO, make_env, one_line_usage_error
from kimi_eagle.hosts.session import payload_set

PY = sys.executable
PIPELINE = "pipeline:\n  model: /models/m\n  dataset: /data/d.jsonl\n"


def _sha(p):
    return hashlib.sha256(p.read_bytes()).hexdigest()


def _a_finished_run(e):
    """A real pipeline job (its record step runs, then vocab prints its help), then the files a training and an
    eval leave in its output folder."""
    r = e.cli("--json", "run", "vocab", "--host", "gpu", "--detach", "--no-preflight", "--", "--help")
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    assert e.cli("logs", job, "--follow").code == 0
    out = e.workdir / "out"
    (out / "draft" / "export").mkdir(parents=True)
    (out / "draft" / "export" / "config.json").write_text(json.dumps({"architectures": ["Eagle3DraftModel"]}))
    (out / "draft" / "export" / "model.safetensors").write_bytes(bytes(range(256)) * 4096)
    (out / "draft" / "export" / "training_info.json").write_text(json.dumps({"job_id": job}))  # train names its job
    (out / "draft" / "checkpoints").mkdir()
    (out / "draft" / "checkpoints" / "step_00000010.pt").write_bytes(b"\1" * 300_000)
    (out / "eval").mkdir()
    (out / "eval" / "report.json").write_text(json.dumps({"mean_acceptance_length": 1.5, "job_id": job}))
    (out / "hidden_states").mkdir()
    for i in range(3):
        (out / "hidden_states" / f"hs_{i}.safetensors").write_bytes(b"\2" * 1_000_000)
    return job, out


def test_pull_copies_the_results_verified_and_then_only_what_changed(tmp_path, sshd):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    (out / "choose").mkdir()   # the choose step's report: which checkpoint became the export, and why
    (out / "choose" / "report.json").write_text(json.dumps({"chosen": {"step": 10}, "job_id": job}))
    dest = tmp_path / "here"
    r = e.cli("pull", job, "--to", str(dest))
    assert r.code == 0, (r.stdout, r.stderr)
    for rel in ("draft/export/config.json", "draft/export/model.safetensors", "eval/report.json", "choose/report.json",
                f"runs/{job}/recipe.yaml", f"runs/{job}/versions.json"):
        assert _sha(dest / rel) == _sha(out / rel), rel
    assert (dest / "logs" / job / "log").read_text() == (e.workdir / "runs" / job / "log").read_text()
    assert not (dest / "hidden_states").exists() and not (dest / "draft" / "checkpoints").exists()
    assert f"pulled {out} into {dest}" in r.stdout

    again = e.cli("--json", "pull", job, "--to", str(dest))
    assert again.code == 0 and again.json()["changed"] == [] and again.json()["bytes_received"] == 0
    # One file changed on the host, one damaged here (same size): those two travel, nothing else.
    (out / "eval" / "report.json").write_text(json.dumps({"mean_acceptance_length": 1.7, "job_id": job}))
    damaged = dest / "draft" / "export" / "model.safetensors"
    damaged.write_bytes(b"\0" * damaged.stat().st_size)
    third = e.cli("--json", "pull", job, "--to", str(dest)).json()
    assert sorted(third["changed"]) == ["draft/export/model.safetensors", "eval/report.json"], third
    assert _sha(damaged) == _sha(out / "draft" / "export" / "model.safetensors")
    assert not list(dest.rglob("*.part")), "a temporary file was left behind"

    # The same folder named directly, with every job that wrote there.
    by_dir = e.cli("--json", "pull", "--host", "gpu", "--run", "out", "--to", str(tmp_path / "byd"))
    assert by_dir.code == 0, by_dir.stderr
    assert f"logs/{job}/log" in by_dir.json()["changed"] and "eval/report.json" in by_dir.json()["changed"]


def start_writer(tmp_path, sshd, name: str, body: str):
    """A detached job of Python `body` that writes into its output folder's tracking/<job id>/ (the folder `d`) while
    it runs, as a tracker does: (env, that output folder, job id)."""
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    out = e.workdir / "out"
    script = tmp_path / name
    script.write_text("import json, os, sys, time\nout = sys.argv[1]\n"
                      "open(os.path.join(os.environ['KIMI_EAGLE_RUN_DIR'], 'output_dir'), 'w').write(out)\n"
                      "d = os.path.join(out, 'tracking', os.environ['KIMI_EAGLE_JOB_ID'])\n" + body)
    r = e.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", PY, str(script), str(out))
    assert r.code == 0, r.stderr
    return e, out, r.json()["id"]


def wait_written(path, what: str) -> None:
    """Until the writer job has put more than a KB in `path` (30 s at most)."""
    deadline = time.monotonic() + 30
    while not (path.exists() and path.stat().st_size > 1000):
        assert time.monotonic() < deadline, f"the job never wrote its {what}"
        time.sleep(0.1)


def test_pull_of_a_running_job_copies_its_growing_log_and_events_as_they_were_listed(tmp_path, sshd):
    """A job that writes its log and a tensorboard event file all the time: `pull JOB` while it runs copies both as
    the first bytes they had when listed (checked against those bytes' digest) and says they are still being
    written; a file that does not change is copied whole and verified as ever. Each pull failed ("changed or
    vanished while being read; run the command again", or a sha256 mismatch), however often it was run."""
    e, out, job = start_writer(tmp_path, sshd, "writes.py",
                               "os.makedirs(d, exist_ok=True)\n"
                               "with open(os.path.join(d, 'events.out.tfevents.1'), 'ab', buffering=0) as ev:\n"
                               "    for i in range(60000):\n"
                               "        print('line', i, flush=True)\n        ev.write(b'event %d\\n' % i)\n"
                               "        time.sleep(0.005)\n")
    log, events = e.workdir / "runs" / job / "log", out / "tracking" / job / "events.out.tfevents.1"
    try:
        wait_written(events, "events")
        (out / "eval").mkdir()
        (out / "eval" / "report.json").write_text(json.dumps({"mean_acceptance_length": 1.5, "job_id": job}))
        dest = tmp_path / "here"
        for _ in range(3):
            r = e.cli("--json", "pull", job, "--to", str(dest))
            assert r.code == 0, (r.stdout, r.stderr)
            assert {f"logs/{job}/log", f"tracking/{job}/events.out.tfevents.1"} <= set(r.json()["growing"]), r.stdout
            for here, there in ((dest / "logs" / job / "log", log), (dest / "tracking" / job / "events.out.tfevents.1", events)):
                copied = here.read_bytes()
                assert copied and there.read_bytes()[:len(copied)] == copied  # a snapshot: what the file began with
        assert _sha(dest / "eval" / "report.json") == _sha(out / "eval" / "report.json")
        assert "eval/report.json" not in r.json()["growing"]
        said = e.cli("pull", job, "--to", str(dest))
        assert said.code == 0 and "still being written on the host" in said.stdout and f"logs/{job}/log" in said.stdout
    finally:
        assert e.cli("stop", job, "--grace", "1").code == 0


def test_pull_of_a_running_job_never_takes_a_prefix_of_a_file_rewritten_in_place(tmp_path, sshd):
    """A tracker's summary (wandb's wandb-summary.json, mlflow's meta.yaml) is rewritten in place, larger each time,
    while the job runs: `pull` copies it whole, verified unchanged across the copy, or says it changed throughout
    and leaves it as it was here. It was copied as the first bytes of the listed size, of a newer content: a cut
    JSON, reported as `growing` as if a later pull would complete it."""
    e, out, job = start_writer(tmp_path, sshd, "rewrites.py",
                               "d = os.path.join(d, 'wandb', 'files')\n"
                               "os.makedirs(d, exist_ok=True)\ni = 0\n"
                               "while True:\n"
                               "    end = time.monotonic() + 0.3\n"
                               "    while time.monotonic() < end:  # a burst of rewrites, then a pause\n"
                               "        i += 1\n"
                               "        print('step', i, flush=True)\n"
                               "        with open(os.path.join(d, 'wandb-summary.json'), 'w') as f:\n"
                               "            f.write(json.dumps({'step': i, 'loss': [1.0 / (k + 1) for k in range(i % 400)]}))\n"
                               "        time.sleep(0.002)\n"
                               "    time.sleep(2.0)\n")
    summary = out / "tracking" / job / "wandb" / "files" / "wandb-summary.json"
    rel = f"tracking/{job}/wandb/files/wandb-summary.json"
    dest = tmp_path / "here"
    whole = 0
    try:
        wait_written(summary, "summary")
        for _ in range(6):
            r = e.cli("--json", "pull", job, "--to", str(dest))
            assert r.code == 0, (r.stdout, r.stderr)
            doc = r.json()
            assert rel not in doc["growing"], doc
            if rel in doc["changing"]:
                assert rel not in doc["changed"], doc
            if (dest / rel).exists():   # whatever lies here is one whole version the job wrote
                got = json.loads((dest / rel).read_text())
                assert len(got["loss"]) == got["step"] % 400, got
            whole += rel in doc["changed"] + doc["unchanged"]
            assert f"logs/{job}/log" not in doc["changing"], doc   # the log still comes as a prefix
    finally:
        assert e.cli("stop", job, "--grace", "1").code == 0
    assert whole, "never copied whole, even between the job's bursts"
    said = e.cli("pull", job, "--to", str(dest))
    assert said.code == 0 and _sha(dest / rel) == _sha(summary), said.stdout


def test_pull_of_a_job_takes_no_export_or_report_a_later_job_wrote_in_its_folder(tmp_path, sshd):
    """A job's folder later holds another job's export and report (the first died before training): pulling the
    first job brings its own record and logs, and says that the export and report are the later job's."""
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    first, out = _a_finished_run(e)
    r = e.cli("--json", "run", "vocab", "--host", "gpu", "--detach", "--no-preflight", "--", "--help")
    later = r.json()["id"]
    assert e.cli("logs", later, "--follow").code == 0
    (out / "draft" / "export" / "training_info.json").write_text(json.dumps({"job_id": later}))
    (out / "eval" / "report.json").write_text(json.dumps({"mean_acceptance_length": 1.9, "job_id": later}))
    (out / "choose").mkdir()
    (out / "choose" / "report.json").write_text(json.dumps({"chosen": {"step": 10}, "job_id": later}))
    r = e.cli("--json", "pull", first, "--to", str(tmp_path / "first"))
    assert r.code == 0, r.stderr
    assert not (tmp_path / "first" / "draft").exists() and not (tmp_path / "first" / "eval").exists()
    assert not (tmp_path / "first" / "choose").exists()
    assert {s["folder"]: s["written_by"] for s in r.json()["skipped"]} == {"draft/export": later, "eval": later,
                                                                           "choose": later}
    assert (tmp_path / "first" / "logs" / first / "log").is_file()
    r = e.cli("pull", first, "--to", str(tmp_path / "first-text"))
    assert f"draft/export: written by job {later}, not by {first}" in r.stdout, r.stdout
    r = e.cli("--json", "pull", later, "--to", str(tmp_path / "later"))
    assert r.code == 0 and "draft/export/model.safetensors" in r.json()["changed"], r.stdout


def test_pull_of_a_run_without_held_out_prompts_takes_its_smoke_test(tmp_path, sshd):
    """`run all` without eval_prompts ends with eval's served smoke test alone: eval/ holds smoke.json and no report.
    `pull JOB` brings it back (it names its job), and not another job's."""
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    (out / "eval" / "report.json").unlink()
    (out / "eval" / "smoke.json").write_text(json.dumps({"served_smoke": "ok", "job_id": job}))
    r = e.cli("--json", "pull", job, "--to", str(tmp_path / "mine"))
    assert r.code == 0 and "eval/smoke.json" in r.json()["changed"] and r.json()["skipped"] == [], r.stdout
    other = e.cli("--json", "run", "vocab", "--host", "gpu", "--detach", "--no-preflight", "--", "--help").json()["id"]
    assert e.cli("logs", other, "--follow").code == 0
    r = e.cli("--json", "pull", other, "--to", str(tmp_path / "other"))
    assert r.code == 0 and not (tmp_path / "other" / "eval").exists(), r.stdout
    assert {s["folder"]: s["written_by"] for s in r.json()["skipped"]}["eval"] is None


def test_pull_of_a_job_without_a_record_or_a_missing_folder_is_one_line(tmp_path, sshd):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    r = e.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", "true")
    job = r.json()["id"]
    assert e.cli("logs", job, "--follow").code == 0
    r = e.cli("pull", job)
    assert r.code == 2 and "no record of its output folder" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = e.cli("pull", "--host", "gpu", "--run", "nope")
    assert r.code == 2 and "nope: no such folder" in r.stderr


def test_clean_shows_the_bytes_asks_and_removes_only_the_bulky_parts(tmp_path, sshd):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    dry = e.cli("clean", job, "--dry-run")
    assert dry.code == 0, dry.stderr
    assert "would remove" in dry.stdout and "hidden_states: 2.9 MiB in 3 files" in dry.stdout, dry.stdout
    assert "3.1 MiB would be freed; nothing was removed" in dry.stdout
    assert (out / "hidden_states").is_dir() and (out / "draft" / "checkpoints").is_dir()

    unconfirmed = e.cli("clean", job)  # not a terminal, no --yes: the sizes, then a refusal
    assert unconfirmed.code == 2 and "confirm with --yes (nothing was removed)" in unconfirmed.stderr
    assert "hidden_states: 2.9 MiB" in unconfirmed.stdout and (out / "hidden_states").is_dir()

    done = e.cli("clean", job, "--yes")
    assert done.code == 0, done.stderr
    assert "removed hidden_states, draft/checkpoints" in done.stdout and "3.1 MiB freed" in done.stdout
    assert not (out / "hidden_states").exists() and not (out / "draft" / "checkpoints").exists()
    assert (out / "draft" / "export" / "model.safetensors").is_file() and (out / "eval" / "report.json").is_file()
    assert not [p for p in out.rglob("*") if ".removing-" in p.name]
    assert "nothing to remove" in e.cli("clean", job, "--yes").stdout


def test_clean_of_a_linked_hidden_states_frees_the_space_where_it_points_and_keeps_the_link(tmp_path, sshd):
    """hidden_states on a big disk (a link): the space is freed there, the link stays (the next extract writes
    where the user chose), and a link an earlier version renamed aside (it failed on links) is found again."""
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    big = tmp_path / "bigdisk" / "hs"
    big.parent.mkdir()
    (out / "hidden_states").rename(big)
    (out / "hidden_states").symlink_to(big)
    dry = e.cli("clean", job, "--dry-run")
    assert dry.code == 0 and f"hidden_states (at {big}): 2.9 MiB in 3 files" in dry.stdout, (dry.stdout, dry.stderr)
    done = e.cli("clean", job, "--yes")
    assert done.code == 0 and "removed hidden_states, draft/checkpoints" in done.stdout, (done.stdout, done.stderr)
    assert "3.1 MiB freed" in done.stdout
    assert (out / "hidden_states").is_symlink() and big.is_dir() and not list(big.iterdir())
    assert not [p for p in [*out.rglob("*"), *big.parent.rglob("*")] if ".removing-" in p.name]
    assert "nothing to remove" in e.cli("clean", job, "--yes").stdout
    # What an earlier version left: the link renamed aside, the data behind it never freed.
    (big / "hs_0.safetensors").write_bytes(b"\2" * 1_000_000)
    (out / "hidden_states").rename(out / ".hidden_states.removing-0cb9afd791c9")
    done = e.cli("clean", job, "--yes")
    assert done.code == 0 and "removed hidden_states" in done.stdout, (done.stdout, done.stderr)
    assert (out / "hidden_states").is_symlink() and not list(big.iterdir())
    # A link to a folder that holds far more than hidden states (here the workdir, the run's folder in it): refused.
    (out / "hidden_states").unlink()
    (out / "hidden_states").symlink_to(e.workdir)
    line = one_line_usage_error(e.cli("clean", job, "--yes"))
    assert f"leads to {e.workdir}, which holds the run's folder" in line and "nothing was removed" in line, line
    assert (out / "draft" / "export" / "model.safetensors").is_file()


def test_a_clean_that_cannot_delete_everything_says_what_is_left_and_the_next_clean_finishes(tmp_path, sshd):
    """A folder that cannot go yet (a mount point inside the hidden states: busy) is named, the rest goes, and
    once the cause is gone the next clean (its dry run first) sees what was left aside and removes it."""
    import subprocess

    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    stuck = out / "hidden_states" / "mounted"
    stuck.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "none", str(stuck)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        (stuck / "f").write_bytes(b"\3" * 1000)
        r = e.cli("clean", job, "--yes")
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.code == 1 and len(lines) == 1 and "Traceback" not in r.stderr, (r.code, r.stdout, r.stderr)
        assert "could not remove all of hidden_states" in lines[0] and "removed draft/checkpoints" in lines[0]
        assert f"{out}/.hidden_states.removing-" in lines[0] and "clean again" in lines[0], lines[0]
        assert not (out / "draft" / "checkpoints").exists()
    finally:
        for aside in out.glob(".hidden_states.removing-*/mounted"):
            subprocess.run(["umount", "-l", str(aside)], check=False)
    dry = e.cli("clean", job, "--dry-run")
    assert dry.code == 0 and "would remove" in dry.stdout and "hidden_states" in dry.stdout, (dry.stdout, dry.stderr)
    done = e.cli("clean", job, "--yes")
    assert done.code == 0 and "removed hidden_states" in done.stdout, (done.stdout, done.stderr)
    assert not [p for p in out.rglob("*") if ".removing-" in p.name]


def test_a_job_start_on_the_machine_does_not_wait_while_a_clean_deletes(tmp_path, monkeypatch):
    """clean renames the folders aside under the machine's lock and deletes them after: a job start of another
    workdir returns while the deletion goes on (held still here with SIGSTOP, mid-deletion)."""
    import fcntl
    import signal
    import subprocess

    from conftest import STEP_ENV, host_cmd
    from kimi_eagle_host.ops import machine_claims

    env = {**STEP_ENV, "KIMI_EAGLE_MACHINE_DIR": str(tmp_path / "machine")}
    out = tmp_path / "out"
    for d in range(20):
        (out / "hidden_states" / f"d{d}").mkdir(parents=True)
        for f in range(250):
            (out / "hidden_states" / f"d{d}" / f"hs_{f}").touch()
    (tmp_path / "work2" / "runs" / "job-2").mkdir(parents=True)
    (tmp_path / "work2" / "runs" / "job-2" / "job.sh").write_text("true\n")
    monkeypatch.setenv("KIMI_EAGLE_MACHINE_DIR", env["KIMI_EAGLE_MACHINE_DIR"])
    lock_path = os.path.join(machine_claims.machine_dir(), ".lock")
    clean = subprocess.Popen(host_cmd("ops.clean", "--runs-dir", tmp_path / "runs", "--root", out, "hidden_states"),
                             env=env, stdout=subprocess.PIPE, text=True)
    deleting = False
    try:
        while clean.poll() is None and not deleting:
            if list(out.glob(".hidden_states.removing-*")):
                clean.send_signal(signal.SIGSTOP)
                with open(lock_path, "a+") as lock:
                    try:
                        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                        deleting = bool(list(out.glob(".hidden_states.removing-*")))
                    except BlockingIOError:
                        pass  # still renaming, under the lock
                if not deleting:
                    clean.send_signal(signal.SIGCONT)
            time.sleep(0.002)
        assert deleting, "the machine's lock was held for as long as the folder was there"
        r = subprocess.run(host_cmd("ops.jobs", "--runs-dir", tmp_path / "work2" / "runs", "start", "--job-id",
                                    "job-2", "--step", "exec", "--host", "h", "--workdir", tmp_path / "work2", "--gpu"),
                           env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and json.loads(r.stdout)["started"], (r.stdout, r.stderr)
    finally:
        clean.send_signal(signal.SIGCONT)
        doc = json.loads(clean.communicate(timeout=120)[0])
    assert doc["removed"] == ["hidden_states"] and not list(out.iterdir()), doc


def test_clean_refuses_while_a_job_using_the_folder_runs(tmp_path, sshd):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    # A running job that recorded this output folder, as every pipeline job does first (kimi_eagle_host.ops.provenance).
    record = [PY, "-m", "kimi_eagle_host.ops.provenance", "--output-dir", "out", "--product-version",
              "test", "--settings", "x: 1"]
    r = e.cli("--json", "run", "exec", "--host", "gpu", "--detach", "--no-gpu", "--", "bash", "-c",
              " ".join(f"'{a}'" for a in record) + " && sleep 60")
    busy = r.json()["id"]
    deadline = time.monotonic() + 30
    while not (e.workdir / "runs" / busy / "output_dir").exists():
        assert time.monotonic() < deadline
        time.sleep(0.2)
    try:
        r = e.cli("clean", job, "--yes")
        assert r.code == 1 and f"job {busy} (exec) is running on {out}; nothing was removed" in r.stderr, r.stderr
        assert (out / "hidden_states").is_dir()
    finally:
        assert e.cli("stop", busy, "--grace", "1").code == 0
    assert e.cli("clean", job, "--yes").code == 0 and not (out / "hidden_states").exists()


SLOW_PY = """#!/bin/bash
# The host's python, with a job that is slow to record its output folder and slow to finish: each job notes
# whether the hidden states were there when it started and still there when it ended.
case "$*" in
  *kimi_eagle_host.ops.provenance*)
    if [ -d {out}/hidden_states ]; then echo "start present" >> {marks}/$KIMI_EAGLE_JOB_ID; else echo "start absent" >> {marks}/$KIMI_EAGLE_JOB_ID; fi
    sleep 1.5 ;;
  *kimi_eagle_host.pipeline.vocab*)
    sleep 1.5
    if [ -d {out}/hidden_states ]; then echo "end present" >> {marks}/$KIMI_EAGLE_JOB_ID; else echo "end absent" >> {marks}/$KIMI_EAGLE_JOB_ID; fi ;;
esac
exec {py} "$@"
"""


def test_clean_never_removes_under_a_job_that_starts_at_the_same_time_over_many_rounds(tmp_path, sshd):
    """Real concurrent processes against the real sshd host: `run` starting a pipeline job on the folder, and two
    `clean --yes` of it, at staggered moments. Whatever the interleaving, a job that found the hidden states when it
    started still has them when it ends, each clean either removed them or refused, and none fails otherwise."""
    import subprocess

    e = make_env(tmp_path, sshd, extra=PIPELINE)
    out, marks = e.workdir / "out", tmp_path / "marks"
    marks.mkdir()
    slow = tmp_path / "slowpy"
    slow.write_text(SLOW_PY.format(out=out, marks=marks, py=PY))
    slow.chmod(0o755)
    e.write_inventory(e.inventory.read_text().replace(f"python: {PY}\n    workdir: {e.workdir}",
                                                      f"python: {slow}\n    workdir: {e.workdir}", 1))
    assert f"python: {slow}" in e.inventory.read_text()
    env = {**os.environ, "HOME": str(e.home), "NO_COLOR": "1", "COLUMNS": "200", "PYTHONPATH": str(REPO)}

    def cli(*args):
        return subprocess.Popen([PY, "-m", "kimi_eagle", "--inventory", str(e.inventory), *args], env=env,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def clean_twice():
        cleans = [cli("clean", "--run", "out", "--host", "gpu", "--yes") for _ in range(2)]
        return [(p.wait(timeout=120), *p.communicate()) for p in cleans]

    def started(run):
        code, so, se = run.wait(timeout=120), *run.communicate()
        assert code == 0, se
        return json.loads(so)["id"]

    removed = refused = 0
    # Staggered moments after `run`, then two that hit each outcome whatever the machine's load (under load every
    # staggered clean found the job running): while the job surely runs (its start noted, 3 s of sleeps ahead),
    # and after it ended.
    for delay in (0.8, 1.3, 1.8, 2.3, 2.8, "running", "ended"):
        (out / "hidden_states").mkdir(parents=True, exist_ok=True)
        (out / "hidden_states" / "hs_0.safetensors").write_bytes(b"\0" * 4096)
        run = cli("--json", "run", "vocab", "--host", "gpu", "--detach", "--no-preflight", "--no-gpu", "--", "--help")
        if isinstance(delay, float):
            time.sleep(delay)
            answers = clean_twice()
            job = started(run)
        else:
            job = started(run)
            deadline = time.time() + 60
            while delay == "running" and not (marks / job).exists() and time.time() < deadline:
                time.sleep(0.05)
            if delay == "ended":
                subprocess.run([PY, "-m", "kimi_eagle", "--inventory", str(e.inventory), "logs", job, "--follow"],
                               env=env, capture_output=True, timeout=120)
            answers = clean_twice()
        assert subprocess.run([PY, "-m", "kimi_eagle", "--inventory", str(e.inventory), "logs", job, "--follow"],
                              env=env, capture_output=True, timeout=120).returncode == 0
        for c, so, se in answers:
            assert "Traceback" not in se, se
            if c == 0:
                removed += "removed hidden_states" in so
            else:
                assert c == 1 and f"job {job} (vocab) is running on {out}; nothing was removed" in se, (delay, c, so, se)
                refused += 1
        seen = (marks / job).read_text().split("\n")
        assert seen[:2] != ["start present", "end absent"], (delay, seen, answers)  # removed under a running job
    assert not [p for p in out.rglob("*") if ".removing-" in p.name]
    assert refused and removed, (refused, removed)  # both outcomes happened


def test_pull_and_clean_from_python_return_result_objects(tmp_path, sshd, monkeypatch):
    from kimi_eagle.api import Controller

    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    monkeypatch.setenv("HOME", str(e.home))
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    ke = Controller(str(e.inventory))
    pulled = ke.pull(job, to=tmp_path / "here")
    assert pulled.host == "gpu" and pulled.run.path == str(out) and pulled.dest == tmp_path / "here"
    assert (pulled.dest / "draft" / "export" / "model.safetensors").is_file() and pulled.report.changed
    dry = ke.clean(job, dry_run=True)
    assert dry.dry_run and dry.bytes == 3_300_000 and not dry.removed and (out / "hidden_states").is_dir()
    asked = []
    assert not ke.clean(job, confirm=lambda r: asked.append(r.bytes) or False).removed and asked == [3_300_000]
    done = ke.clean(job)
    assert done.removed == ["hidden_states", "draft/checkpoints"] and done.freed == 3_300_000
    assert not (out / "hidden_states").exists()


@pytest.fixture
def small_mount(tmp_path):
    """A tmpfs of 256 KiB (a disk that fills up), mounted read-write; skipped where this user cannot mount."""
    import subprocess

    where = tmp_path / "small"
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "none", str(where)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_pull_to_a_place_it_cannot_write_is_one_line_naming_the_path(tmp_path, sshd, small_mount):
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, _ = _a_finished_run(e)
    a_file = tmp_path / "a-file"
    a_file.write_text("mine\n")
    line = one_line_usage_error(e.cli("pull", job, "--to", str(a_file)))
    assert str(a_file) in line and a_file.read_text() == "mine\n"
    # A folder where the export's config.json should go: nothing of the user's is replaced.
    blocked = tmp_path / "blocked"
    (blocked / "draft" / "export" / "config.json").mkdir(parents=True)
    line = one_line_usage_error(e.cli("pull", job, "--to", str(blocked)))
    assert str(blocked / "draft" / "export" / "config.json") in line and "folder" in line
    # A file where a folder of the run should go.
    (tmp_path / "filed").mkdir()
    (tmp_path / "filed" / "draft").write_text("mine\n")
    line = one_line_usage_error(e.cli("pull", job, "--to", str(tmp_path / "filed")))
    assert str(tmp_path / "filed" / "draft") in line
    # A full disk: one line, exit 1 (the destination was right), no partial file left.
    full = e.cli("pull", job, "--to", str(small_mount / "dest"))
    lines = [ln for ln in full.stderr.splitlines() if ln.strip()]
    assert full.code == 1 and len(lines) == 1 and "no space left" in lines[0], (full.code, full.stderr)
    assert str(small_mount / "dest") in lines[0] and not list(small_mount.rglob("*.part"))
    # A read-only file system.
    import subprocess

    subprocess.run(["mount", "-o", "remount,ro", str(small_mount)], check=True)
    line = one_line_usage_error(e.cli("pull", job, "--to", str(small_mount / "dest")))
    assert str(small_mount / "dest") in line and "Read-only file system" in line


def test_the_hosts_clean_waits_for_every_task_of_a_slurm_array(tmp_path):
    """The host's own check, made under the locks a start takes: an extraction array whose first task has ended
    still writes into the folder through its other tasks, so nothing is removed until each one has recorded its
    exit."""
    import subprocess

    from conftest import STEP_ENV, host_cmd

    runs, out = tmp_path / "runs", tmp_path / "out"
    job = runs / "20261207-030000-extract-0a1b2c3d"
    job.mkdir(parents=True)
    (out / "hidden_states").mkdir(parents=True)
    (out / "hidden_states" / "hs_0.safetensors").write_bytes(b"\2" * 1000)
    (job / "slurm_job_id").write_text("4242\n")
    (job / "output_dir").write_text(f"{out}\n")
    (job / "meta.json").write_text(json.dumps({"job_id": job.name, "step": "extract", "scheduler": "slurm",
                                               "tasks": 4}))

    def clean():
        r = subprocess.run(host_cmd("ops.clean", "--runs-dir", runs, "--root", out, "hidden_states"),
                           capture_output=True, text=True, env=STEP_ENV, timeout=120)
        return r.returncode, json.loads(r.stdout.strip().splitlines()[-1])

    for task in range(3):
        (job / f"exit_code.{task}").write_text("0\n")
        code, doc = clean()
        assert code == 1 and doc["busy"][0]["id"] == job.name, doc
        assert (out / "hidden_states" / "hs_0.safetensors").exists()
    (job / "exit_code.3").write_text("0\n")
    code, doc = clean()
    assert code == 0 and doc["removed"] == ["hidden_states"], doc
    assert not (out / "hidden_states").exists()


@pytest.mark.parametrize("name", ["../escaped", "/tmp/absolute", "sub/../../escaped", ""])
def test_pull_refuses_a_file_name_from_the_host_outside_its_destination(tmp_path, name):
    """The names of the files to copy come from the host (its lister's answer): a host that names ~/.ssh/... or
    ../.. (compromised, or its python replaced) must write nothing here, not even the files listed before it."""
    from kimi_eagle.config import inventory
    from kimi_eagle.errors import CommandError
    from kimi_eagle.hosts import sync
    from kimi_eagle.hosts.transport.local import LocalTransport

    source = tmp_path / "host" / "report.json"
    source.parent.mkdir()
    source.write_text('{"ok": true}')
    dest = tmp_path / "here" / "pulled"
    transport = LocalTransport(inventory.load(None).hosts["local"])
    files = [(str(source), "eval/report.json", source.stat().st_size), (str(source), name, source.stat().st_size)]
    with pytest.raises(CommandError, match="outside the destination"):
        sync.fetch(transport, files, dest)
    assert not dest.exists() and not (tmp_path / "here" / "escaped").exists()


def test_clean_dry_run_writes_nothing_on_a_host_with_an_older_payload_set(tmp_path, sshd):
    """clean --dry-run measures through the host package; where the host's set is older it used to upload the new
    one (and status's scripts) first. Now every file under the workdir stays as it was."""
    e = make_env(tmp_path, sshd, extra=PIPELINE)
    job, out = _a_finished_run(e)
    (e.workdir / payload_set().folder / "MANIFEST").write_text("an older set\n")  # this set, not whole
    before = {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in e.workdir.rglob("*")}
    dry = e.cli("clean", job, "--dry-run")
    assert dry.code == 0, dry.stderr
    assert "3.1 MiB would be freed; nothing was removed" in dry.stdout, dry.stdout
    assert {str(p): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in e.workdir.rglob("*")} == before
