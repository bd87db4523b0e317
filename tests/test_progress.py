"""Progress you can see: a real training job's `logs --follow` in a real pseudo-terminal shows one bar for the
step with step/total, ETA, loss, the acceptance signal and tokens/s; piped, the same log is plain lines."""

from __future__ import annotations

import io
import json
import os
import pty
import re
import select
import sys
import time

from conftest import REPO, host_cmd, make_env
from test_train import make_pipeline

PY = sys.executable
TRAIN = host_cmd("pipeline.train")


def _in_a_terminal(argv, env, timeout=240) -> str:
    """Run a command with a pseudo-terminal as its stdout/stderr (what a user's shell gives it)."""
    pid, fd = pty.fork()
    if pid == 0:  # the child: the CLI, talking to the terminal
        os.execvpe(argv[0], argv, env)
    out, deadline = b"", time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready, _, _ = select.select([fd], [], [], 1.0)
        if ready:
            try:
                chunk = os.read(fd, 65536)
            except OSError:  # the child closed the terminal
                break
            if not chunk:
                break
            out += chunk
    os.waitpid(pid, 0)
    return out.decode(errors="replace")


def test_a_real_training_shows_a_bar_in_a_terminal_and_lines_in_a_pipe(tmp_path):
    p = make_pipeline(tmp_path)
    e = make_env(tmp_path, None)
    r = e.cli("--json", "run", "exec", "--host", "local", "--detach", "--no-gpu", "--", *TRAIN, "--model",
              str(p["target"]), "--output-dir", str(p["out"]), "--device", "cpu", "--batch-size", "4", "--epochs", "40",
              "--log-every", "1", "--report-to", "none")
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    # 40 epochs of the tiny pipeline: ~1 s of steps, so the follower sees the bar while it runs (with 4, ~0.1 s, a
    # loaded box's follower once drew only the finished bar, without its eta)
    frames = _follow_in_a_terminal(e, job)  # the bar redraws itself in place; no raw machine line reaches a person
    bar = [ln for ln in frames if "[local] train" in ln and "━" in ln]
    assert bar, frames[-20:]
    last = bar[-1]
    total = int(re.search(r"(\d+)/(\d+)", last).group(2))
    assert f"{total}/{total}" in last and "loss " in last and "acc " in last and "tok/s" in last, last
    assert any("eta " in ln for ln in frames)  # while it ran

    piped = e.cli("logs", job)  # the same log, not a terminal
    assert piped.code == 0
    lines = [ln for ln in piped.stdout.splitlines() if ln.startswith("[local] train ")]
    assert lines and lines[-1].startswith(f"[local] train {total}/{total} (100%)") and "loss " in lines[-1], lines[-3:]
    assert "━" not in piped.stdout and "@kimi-eagle-progress" not in piped.stdout


def _follow_in_a_terminal(e, job) -> list[str]:
    """`logs JOB --follow` in a pseudo-terminal: the screen's frames, escape codes removed."""
    env = {**os.environ, "HOME": str(e.home), "PYTHONPATH": str(REPO), "TERM": "xterm-256color", "COLUMNS": "160",
           "LINES": "40"}
    env.pop("NO_COLOR", None)
    screen = _in_a_terminal([PY, "-m", "kimi_eagle", "--inventory", str(e.inventory), "logs", job, "--follow"], env)
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert "job " + job + " succeeded" in plain, plain[-3000:]
    assert "@kimi-eagle-progress" not in plain
    return re.split(r"[\r\n]+", plain)


def test_a_real_regenerate_shows_tokens_per_second_in_its_bar_and_its_lines(tmp_path):
    """regenerate's bar: chunks done of all, the ETA while it runs, and the answers' tokens/s (not only
    conversations/s), in a terminal and as plain lines."""
    from drafts import build_tiny_llama

    model = build_tiny_llama(tmp_path)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n"
                               for i in range(8)))
    e = make_env(tmp_path, None)
    r = e.cli("--json", "run", "exec", "--host", "local", "--detach", "--no-gpu", "--",
              *host_cmd("pipeline.regenerate"), "--model", str(model), "--dataset",
              str(prompts), "--output-dir", str(tmp_path / "out"), "--engine", "hf", "--max-tokens", "16",
              "--chunk-size", "1", "--max-model-len", "256")
    assert r.code == 0, r.stderr
    job = r.json()["id"]
    frames = _follow_in_a_terminal(e, job)
    bar = [ln for ln in frames if "[local] regenerate" in ln and "━" in ln]
    assert bar and "8/8" in bar[-1] and "tok/s" in bar[-1], bar[-3:]
    assert any("eta " in ln for ln in bar), bar
    piped = e.cli("logs", job)
    lines = [ln for ln in piped.stdout.splitlines() if ln.startswith("[local] regenerate ")]
    assert lines and lines[-1].startswith("[local] regenerate 8/8 (100%)"), lines[-3:]
    rate = re.search(r"([\d,]+) tok/s", lines[-1])
    assert rate and int(rate.group(1).replace(",", "")) > 0, lines[-1]
    assert "eta " in lines[1] and "━" not in piped.stdout


def test_a_steps_own_line_replaces_its_tqdm_bar():
    from rich.console import Console

    from kimi_eagle.jobs.log_stream import LineSplitter
    from kimi_eagle.jobs.log_printer import Printer

    out = io.StringIO()
    s = LineSplitter(Printer("h", Console(file=out, force_terminal=False, width=200)))
    # As a log has them: tqdm redraws without a newline, the progress line running into the redraw before it.
    s.feed(b"\rextract[vllm]:   0%|          | 0/4 [00:00<?]"
           b'@kimi-eagle-progress {"step": "extract", "done": 2, "total": 4, "eta_s": 1.0, "tok_s": 1234.5}\n'
           b"\rextract[vllm]:  50%|#####     | 2/4 [00:01<00:01]"
           b'@kimi-eagle-progress {"step": "extract", "done": 4, "total": 4, "eta_s": 0.0, "tok_s": 1234.5}\n'
           b"\rextract[vllm]: 100%|##########| 4/4 [00:01<00:00]\n")
    s.flush()
    assert out.getvalue().splitlines() == ["[h] extract 2/4 (50%)  eta 0m01s  1,234 tok/s",
                                           "[h] extract 4/4 (100%)  1,234 tok/s"]


def test_a_steps_tqdm_bar_also_prints_its_progress_lines():
    """extract's bars (hf and vLLM paths) carry the step's progress lines without each path printing its own."""
    import json
    import subprocess

    code = ("from kimi_eagle_host.step_runtime import progress\n"
            "bar = progress(None, total=3, desc='extract[vllm]')\n"
            "for _ in range(3): bar.update(1, tokens=100)\n"
            "bar.close()\n")
    res = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    points = [json.loads(ln.split(" ", 1)[1]) for ln in res.stderr.splitlines() if ln.startswith("@kimi-eagle-progress ")]
    assert points[-1]["step"] == "extract" and points[-1]["done"] == 3 and points[-1]["total"] == 3
    assert points[-1]["tok_s"] > 0 and points[-1]["eta_s"] == 0
