"""Progress lines in logs become bars (or one line when not on a terminal); other lines keep a host prefix."""

from __future__ import annotations

import io

from kimi_eagle.jobs.log_stream import LineSplitter
from kimi_eagle.jobs.log_printer import Printer, parse_progress


def test_parses_tqdm_and_vllm_progress():
    assert parse_progress("extract:  45%|####5     | 45/100 [00:01<00:02, 30.0it/s]") == ("extract", 45, 100)
    assert parse_progress("Loading safetensors checkpoint shards:  40% Completed | 26/64 [01:02<01:31,  2.41s/it]") == (
        "Loading safetensors checkpoint shards", 26, 64)
    assert parse_progress("step 10/40 loss 0.02") is None  # a plain line with a fraction is not a bar


def test_bar_spam_collapses_to_one_line_off_terminal():
    from rich.console import Console

    out = io.StringIO()
    printer = Printer("h200", Console(file=out, force_terminal=False, width=200))
    splitter = LineSplitter(printer)
    frames = "".join(f"\rLoading safetensors checkpoint shards: {100 * k // 64:3d}% Completed | {k}/64 [00:0{k % 10}<00:00]"
                     for k in range(65))
    splitter.feed(("==> step extract\n" + frames + "\nloaded model ✓\n").encode())
    splitter.flush()
    lines = out.getvalue().splitlines()
    assert lines == ["[h200] ==> step extract", "[h200] Loading safetensors checkpoint shards: 64/64 done", "[h200] loaded model ✓"]


def test_multibyte_characters_split_across_reads_stay_intact():
    got = []
    s = LineSplitter(lambda kind, text: got.append(text))
    data = "日本語 ✓ 🙂\n".encode() * 3
    for i in range(0, len(data), 5):  # every read cuts a character somewhere
        s.feed(data[i:i + 5])
    assert got == ["日本語 ✓ 🙂"] * 3


def test_progress_parsing_is_linear_on_long_runs_of_spaces():
    """A 60 KB line of spaces took 45 s (a quadratic regex) and stalled the follower."""
    import time

    t0 = time.process_time()   # this process's CPU time: a busy box does not slow it, a quadratic regex does
    for line in ("a" + " " * 2_000_000 + "b", "x:" + " " * 2_000_000 + "5%|" + " " * 100 + "| 3/", "1%|" * 300_000):
        assert parse_progress(line) is None
    assert time.process_time() - t0 < 2.0
    # Still a bar when it is one, however much padding precedes it.
    assert parse_progress("extract" + " " * 100_000 + ":  45%|####5     | 45/100 [00:01<00:02]") == ("extract", 45, 100)


def test_a_ten_megabyte_line_passes_through_in_linear_time():
    import time

    from rich.console import Console

    out = io.StringIO()
    printer = Printer("h", Console(file=out, force_terminal=False, width=200))
    s = LineSplitter(printer)
    line = ("word " + " " * 50) * (10_000_000 // 55)
    data = (line + "\nnext\n").encode()
    t0 = time.process_time()   # CPU time, not wall time: the box's load does not count
    for i in range(0, len(data), 65536):
        s.feed(data[i:i + 65536])
    s.flush()
    assert time.process_time() - t0 < 5.0
    assert out.getvalue() == f"[h] {line}\n[h] next\n"


def test_a_newline_terminated_line_that_looks_like_a_bar_is_printed():
    """Only carriage-return redraws are bars; a finished line is a line, whatever it looks like."""
    from rich.console import Console

    out = io.StringIO()
    printer = Printer("h", Console(file=out, force_terminal=False, width=200))
    s = LineSplitter(printer)
    s.feed(b"eval: 50%|#####     | 5/10 accuracy so far\nepoch 1 done\n")
    # A real bar still collapses: redraws, then its last frame ends with a newline (as tqdm closes it).
    s.feed(b"\rtrain:  10%|#  | 1/10\rtrain: 100%|###| 10/10\n")
    s.flush()
    assert out.getvalue().splitlines() == ["[h] eval: 50%|#####     | 5/10 accuracy so far", "[h] epoch 1 done",
                                           "[h] train: 10/10 done"]
