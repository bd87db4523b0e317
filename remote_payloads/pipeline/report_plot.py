"""report.png for the eval step: acceptance rate per draft position and output tokens/s with/without the
draft, side by side. matplotlib when the host has it; otherwise a small built-in rasterizer (bars, axes,
a 5x7 bitmap font, zlib-compressed PNG), so a host without plotting libraries still gets a picture."""
import struct
import zlib

W, H = 900, 420
BG, INK, GRID = (255, 255, 255), (30, 30, 30), (225, 225, 225)
BLUE, ORANGE, GREY = (52, 101, 164), (230, 126, 34), (150, 150, 150)

# 5x7 glyphs, one string of 7 rows of 5 bits each (row-major, '1' = ink)
_FONT = {
    "0": "01110100011001110101110011000101110", "1": "00100011000010000100001000010001110",
    "2": "01110100010000100010001000100011111", "3": "11111000100010000010000011000101110",
    "4": "00010001100101010010111110001000010", "5": "11111100001111000001000011000101110",
    "6": "00110010001000011110100011000101110", "7": "11111000010001000100010000100001000",
    "8": "01110100011000101110100011000101110", "9": "01110100011000101111000010001001100",
    "A": "01110100011000111111100011000110001", "B": "11110100011000111110100011000111110",
    "C": "01110100011000010000100001000101110", "D": "11100100101000110001100011001011100",
    "E": "11111100001000011110100001000011111", "F": "11111100001000011110100001000010000",
    "G": "01110100011000010111100011000101111", "H": "10001100011000111111100011000110001",
    "I": "01110001000010000100001000010001110", "J": "00111000100001000010000101001001100",
    "K": "10001100101010011000101001001010001", "L": "10000100001000010000100001000011111",
    "M": "10001110111010110101100011000110001", "N": "10001100011100110101100111000110001",
    "O": "01110100011000110001100011000101110", "P": "11110100011000111110100001000010000",
    "Q": "01110100011000110001101011001001101", "R": "11110100011000111110101001001010001",
    "S": "01111100001000001110000010000111110", "T": "11111001000010000100001000010000100",
    "U": "10001100011000110001100011000101110", "V": "10001100011000110001100010101000100",
    "W": "10001100011000110101101011010101010", "X": "10001100010101000100010101000110001",
    "Y": "10001100011000101010001000010000100", "Z": "11111000010001000100010001000011111",
    ".": "00000000000000000000000000110001100", ",": "00000000000000000000011000010001000",
    "%": "11000110010001000100010001001100011", "/": "00000000010001000100010001000000000",
    "-": "00000000000000011111000000000000000", "(": "00010001000100001000010000010000010",
    ")": "01000001000001000010000100010001000", "=": "00000000001111100000111110000000000",
    ":": "00000011000110000000011000110000000", "+": "00000001000010011111001000010000000",
    "[": "01110010000100001000010000100001110", "]": "01110000100001000010000100001001110",
    " ": "0" * 35, "X_": "0" * 35,
}


class Canvas:
    def __init__(self, w, h):
        self.w, self.h = w, h
        self.px = bytearray(bytes(BG) * (w * h))

    def rect(self, x0, y0, x1, y1, color):
        x0, x1 = max(0, int(x0)), min(self.w, int(x1))
        y0, y1 = max(0, int(y0)), min(self.h, int(y1))
        row = bytes(color) * max(0, x1 - x0)
        for y in range(y0, y1):
            i = (y * self.w + x0) * 3
            self.px[i:i + len(row)] = row

    def text(self, x, y, s, color=INK, scale=2, anchor="left"):
        s = str(s).upper()
        width = len(s) * 6 * scale
        if anchor == "center":
            x -= width // 2
        elif anchor == "right":
            x -= width
        for ch in s:
            g = _FONT.get(ch, _FONT["X_"])
            for r in range(7):
                for c in range(5):
                    if g[r * 5 + c] == "1":
                        self.rect(x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, color)
            x += 6 * scale

    def png(self):
        raw = b"".join(b"\x00" + bytes(self.px[y * self.w * 3:(y + 1) * self.w * 3]) for y in range(self.h))

        def chunk(kind, data):
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0))
                + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))


def _bars(cv, x0, y0, w, h, labels, values, vmax, colors, fmt, title):
    """A bar panel: axes, 5 grid lines with tick labels, value labels on top of the bars."""
    cv.text(x0 + w // 2, y0 - 40, title, anchor="center")
    for i in range(6):
        y = y0 + h - h * i / 5
        cv.rect(x0, y, x0 + w, y + 1, GRID)
        cv.text(x0 - 8, y - 7, fmt(vmax * i / 5), GREY, scale=2, anchor="right")
    cv.rect(x0, y0 + h, x0 + w, y0 + h + 2, INK)
    cv.rect(x0, y0, x0 + 2, y0 + h + 2, INK)
    n = len(values)
    slot = w / max(n, 1)
    for i, (lab, v) in enumerate(zip(labels, values)):
        bh = h * min(v / vmax, 1.0) if vmax > 0 else 0
        bx = x0 + slot * i + slot * 0.2
        cv.rect(bx, y0 + h - bh, bx + slot * 0.6, y0 + h, colors[i % len(colors)])
        cv.text(bx + slot * 0.3, y0 + h - bh - 20, fmt(v), anchor="center")
        cv.text(bx + slot * 0.3, y0 + h + 12, lab, anchor="center")


def _builtin(rep):
    cv = Canvas(W, H)
    k = rep["num_speculative_tokens"]
    cv.text(W // 2, 14, f"EAGLE-3 EVAL: ACCEPTANCE LENGTH {rep['mean_acceptance_length']:.2f} AT K={k} "
                        f"({rep['engine']})", anchor="center")
    acc = rep["acceptance_per_position"]
    _bars(cv, 90, 100, 360, 240, [f"POS {i + 1}" for i in range(len(acc))], acc, 1.0, [BLUE],
          lambda v: f"{v * 100:.0f}%", "ACCEPTANCE PER POSITION")
    tps = rep["tokens_per_s"]
    vals = [tps["without_draft"], tps["with_draft"]]
    top = max(vals + [1e-9]) * 1.2
    _bars(cv, 580, 100, 280, 240, ["NO DRAFT", "DRAFT"], vals, top, [GREY, ORANGE],
          lambda v: f"{v:.0f}" if top >= 10 else f"{v:.1f}", "OUTPUT TOKENS/S")
    cv.text(W // 2, H - 26, f"{rep['prompts']} PROMPTS, SPEEDUP {rep['speedup']:.2f}X, IDENTICAL "
                            f"{rep['identical_completions'] * 100:.0f}%", GREY, anchor="center")
    return cv.png()


def _matplotlib(rep):
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


def render_report_png(rep):
    try:
        return _matplotlib(rep)
    except ImportError:
        return _builtin(rep)
