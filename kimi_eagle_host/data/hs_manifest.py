"""Which hidden-state samples belong to an extraction: the manifests that readers (train, its speculators path)
use instead of listing the folder, and the decision of extract to continue a folder or start it clean.

  <hs dir>/data_config.json                the extraction's identity: IDENTITY_KEYS (target, weights, layers,
                                           dtype, format, seq_len, the prepared data's manifest sha256)
  <hs dir>/manifest.shard-<lo>-<hi>.json   one extract process (a --rank share): the identity digest and the
                                           samples of [lo, hi) it wrote or verified
  <hs dir>/manifest.json                   written once the shard manifests of the current identity cover every
                                           sample of the prepared data (by the shard that completes them):
                                           identity digest, prepared_sha256, count, the sample file names

A folder holds one identity at a time: extract either continues it (same identity: resume) or removes every
sample and manifest before it writes a new data_config.json (start clean); it says which in one log line. The
check, the cleaning and the manifest assembly run under flock(<hs dir>/.manifest.lock), so shards of one job
that start together agree: the first starts clean, the others continue its data.
"""
import contextlib
import fcntl
import hashlib
import json
import os
import re

from kimi_eagle_host.data.hidden_state_files import COMPAT_KEYS, SAMPLE_RE, TMP_RE, sample_path
from kimi_eagle_host.step_runtime import BadInput, atomic_write_json, settings_changed

MANIFEST = "manifest.json"
MANIFEST_FORMAT = "kimi-eagle-hidden-states-manifest/1"
SHARD_RE = re.compile(r"^manifest\.shard-(\d+)-(\d+)\.json$")
LOCK = ".manifest.lock"
# Beyond COMPAT_KEYS (which an older record may lack and still resume): the truncation and the prepared data
# the samples were cut from. A record without them cannot vouch for its samples, so it is started clean.
STRICT_KEYS = ("seq_len", "prepared_sha256")
IDENTITY_KEYS = COMPAT_KEYS + STRICT_KEYS


def identity_digest(data_config: dict) -> str:
    ident = {k: data_config.get(k) for k in IDENTITY_KEYS}
    return hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]


def changed_settings(old: dict, new: dict) -> list[str]:
    """What differs between a folder's recorded identity and this run's (empty: the same data, continue it)."""
    return settings_changed(old, new, COMPAT_KEYS) + [k for k in STRICT_KEYS if old.get(k) != new.get(k)]


@contextlib.contextmanager
def folder_lock(hs_dir: str):
    os.makedirs(hs_dir, exist_ok=True)
    with open(os.path.join(hs_dir, LOCK), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _leftovers(hs_dir: str) -> list[str]:
    """Every file an extraction writes here (samples, temp and error files, manifests, data_config)."""
    return [n for n in os.listdir(hs_dir)
            if SAMPLE_RE.match(n) or TMP_RE.match(n) or SHARD_RE.match(n) or n in (MANIFEST, "data_config.json")
            or (n.startswith(".hs_") and n.endswith(".error"))]


def _describe(old: dict, new: dict, keys) -> str:
    def short(v):   # a digest's first 12 digits say enough
        return v[:12] if isinstance(v, str) and len(v) == 64 else v

    return ", ".join(f"{k} {short(old.get(k))!r} -> {short(new.get(k))!r}" for k in keys)


def begin(hs_dir: str, data_config: dict, overwrite: bool = False) -> str:
    """Continue this folder's extraction or start it clean, and record data_config. Returns the one line that
    says which. `data_config` gets what an earlier run learnt from the loaded model."""
    cfg_path = os.path.join(hs_dir, "data_config.json")
    with folder_lock(hs_dir):
        old = None
        if os.path.isfile(cfg_path):
            try:
                with open(cfg_path) as f:
                    old = json.load(f)
            except ValueError:
                old = {}
            if not isinstance(old, dict):
                old = {}   # torn or foreign: nothing in this folder can be vouched for
        changed = changed_settings(old, data_config) if old is not None else []
        leftovers = _leftovers(hs_dir)
        if old is not None and not changed:
            for key in ("model_class", "decoder_path"):  # learnt from the loaded model by an earlier run
                if key in old:
                    data_config[key] = old[key]
            atomic_write_json(cfg_path, data_config)
            what = "re-extracting this share (--overwrite)" if overwrite else "resuming"
            return f"continuing the extraction in {hs_dir} (same prepared data and settings): {what}"
        samples = [n for n in leftovers if SAMPLE_RE.match(n)]
        for name in leftovers:
            os.unlink(os.path.join(hs_dir, name))
        atomic_write_json(cfg_path, data_config)
        if old is None and not samples:
            return f"starting a new extraction in {hs_dir}"
        why = (_describe(old, data_config, changed) if old is not None else "no data_config.json recorded them")
        return f"starting clean in {hs_dir}: removed {len(samples)} samples of an earlier extraction ({why})"


def record_shard(hs_dir: str, data_config: dict, lo: int, hi: int, rewrite_config: bool) -> str:
    """After a share [lo, hi) is complete: data_config.json again when this run learnt from the loaded model
    (rewrite_config), its shard manifest, then manifest.json when every share of this identity is in. Returns
    a line saying how far the extraction is."""
    digest = identity_digest(data_config)
    count = int(data_config["count"])
    with folder_lock(hs_dir):
        with open(os.path.join(hs_dir, "data_config.json")) as f:
            now = json.load(f)
        if identity_digest(now) != digest:   # another run started this folder clean meanwhile: nothing to add
            raise RuntimeError(f"{hs_dir}: another extraction (other settings or data) restarted this folder "
                               f"while this one ran")
        if rewrite_config:
            atomic_write_json(os.path.join(hs_dir, "data_config.json"), data_config)
        atomic_write_json(os.path.join(hs_dir, f"manifest.shard-{lo}-{hi}.json"),
                          {"format": MANIFEST_FORMAT, "identity": digest, "range": [lo, hi]})
        covered, shards = set(), []
        for name in sorted(os.listdir(hs_dir)):
            if not SHARD_RE.match(name):
                continue
            with open(os.path.join(hs_dir, name)) as f:
                shard = json.load(f)
            if shard.get("identity") == digest:
                covered.update(range(*shard["range"]))
                shards.append(name)
        if not covered.issuperset(range(count)):
            return f"{len(covered)} of {count} samples extracted so far; manifest.json comes with the last share"
        atomic_write_json(os.path.join(hs_dir, MANIFEST), {
            "format": MANIFEST_FORMAT, "identity": digest, "prepared_sha256": data_config.get("prepared_sha256"),
            "seq_len": data_config.get("seq_len"), "count": count, "shards": shards,
            "samples": [os.path.basename(sample_path(hs_dir, i)) for i in range(count)]})
        return f"all {count} samples extracted: {os.path.join(hs_dir, MANIFEST)}"


def write_manifest(hs_dir: str, count: int, prepared_sha256: str | None = None) -> None:
    """manifest.json for samples hs_0 .. hs_{count-1} of a folder made without extract (tests, benchmarks)."""
    with open(os.path.join(hs_dir, "data_config.json")) as f:
        dc = json.load(f)
    dc.update({"count": count, "prepared_sha256": prepared_sha256})
    atomic_write_json(os.path.join(hs_dir, "data_config.json"), dc)
    atomic_write_json(os.path.join(hs_dir, MANIFEST), {
        "format": MANIFEST_FORMAT, "identity": identity_digest(dc), "prepared_sha256": prepared_sha256,
        "count": count, "shards": [], "samples": [f"hs_{i}.safetensors" for i in range(count)]})


def read_samples(hs_dir: str, data_config: dict, prepared_sha256: str | None = None) -> list[str]:
    """The sample files of the extraction recorded in data_config, exactly as its manifest lists them.
    prepared_sha256: the prepared data the caller was given (None: none at hand); the samples must come from
    it. Anything else is refused in one line (BadInput), never read."""
    path = os.path.join(hs_dir, MANIFEST)
    if not os.path.isfile(path):
        raise BadInput(f"{path}: missing: the extraction in this folder is not complete (run extract; it "
                       f"continues where it stopped)")
    try:
        with open(path) as f:
            manifest = json.load(f)
        samples = [str(n) for n in manifest["samples"]]
    except (ValueError, KeyError, TypeError) as e:
        raise BadInput(f"{path}: unreadable ({type(e).__name__}: {e}); run extract again") from None
    if manifest.get("format") != MANIFEST_FORMAT or manifest.get("identity") != identity_digest(data_config):
        raise BadInput(f"{path}: belongs to another extraction than data_config.json records (re-run extract)")
    if prepared_sha256 is not None and manifest.get("prepared_sha256") != prepared_sha256:
        raise BadInput(f"{path}: the hidden states were extracted from other prepared data than "
                       f"the prepared manifest.json now holds (sha256 {str(manifest.get('prepared_sha256'))[:12]} "
                       f"vs {prepared_sha256[:12]}); run extract again")
    files = []
    for name in samples:
        if not SAMPLE_RE.match(name) or not os.path.isfile(os.path.join(hs_dir, name)):
            raise BadInput(f"{path}: lists {name!r}, which is not a sample file of {hs_dir}; run extract again")
        files.append(os.path.join(hs_dir, name))
    if not files:
        raise BadInput(f"{path}: lists no samples")
    return files
