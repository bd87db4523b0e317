"""The eval step's report beside report.json: report.png drawn by matplotlib (the `plot` extra: acceptance per
draft position, output tokens/s with and without the draft), and report.txt, the same figures as text, which is
all a host without matplotlib gets."""


def report_text(rep) -> str:
    k, acc, tps = rep["num_speculative_tokens"], rep["acceptance_per_position"], rep["tokens_per_s"]
    lines = [f"EAGLE-3 eval: acceptance length {rep['mean_acceptance_length']:.2f} at k={k} ({rep['engine']}, "
             f"{rep['prompts']} prompts)", "", "acceptance per draft position"]
    lines += [f"  pos {i + 1}  {'#' * round(a * 40):<40}  {a:.0%}" for i, a in enumerate(acc)]
    top = max(tps["without_draft"], tps["with_draft"], 1e-9)
    lines += ["", "output tokens/s"]
    lines += [f"  {name:<8}  {'#' * round(v / top * 40):<40}  {v:.1f}"
              for name, v in (("no draft", tps["without_draft"]), ("draft", tps["with_draft"]))]
    lines += ["", f"speedup {rep['speedup']:.2f}x, identical completions {rep['identical_completions']:.0%}"]
    return "\n".join(lines) + "\n"


def report_png(rep) -> bytes:
    """The chart as PNG bytes; ImportError without matplotlib."""
    import io

    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    acc = rep["acceptance_per_position"]
    tps = rep["tokens_per_s"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 4.2), gridspec_kw={"width_ratios": [1.3, 1]})
    fig.suptitle(f"EAGLE-3 eval: acceptance length {rep['mean_acceptance_length']:.2f} at "
                 f"k={rep['num_speculative_tokens']} ({rep['engine']})")
    bars = a.bar([f"pos {i + 1}" for i in range(len(acc))], acc, color="#3465a4")
    a.bar_label(bars, labels=[f"{v:.0%}" for v in acc])
    a.set_ylim(0, 1)
    a.set_title("acceptance per position")
    vals = [tps["without_draft"], tps["with_draft"]]
    bars = b.bar(["no draft", "draft"], vals, color=["#969696", "#e67e22"])
    b.bar_label(bars, labels=[f"{v:.1f}" for v in vals])
    b.set_title("output tokens/s")
    fig.text(0.5, 0.01, f"{rep['prompts']} prompts, speedup {rep['speedup']:.2f}x, identical "
                        f"{rep['identical_completions']:.0%}", ha="center", color="grey")
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    return buf.getvalue()


def render_report(rep) -> dict:
    """{file name: bytes}: report.txt always, report.png when matplotlib is installed."""
    files = {"report.txt": report_text(rep).encode("utf-8")}
    try:
        files["report.png"] = report_png(rep)
    except ImportError:
        pass
    return files
