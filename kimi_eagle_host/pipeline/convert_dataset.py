#!/usr/bin/env python3
"""Convert a dataset named in data_sources.py (sharegpt, mt-bench) to chat JSONL with its provenance beside it
(<out>.source.json), e.g. on the controller, to upload to a host without network:

  python3 convert_dataset.py --source sharegpt --out sharegpt.jsonl

A step given the uploaded file records where it came from (its .source.json) with its outputs.
stdout: one JSON summary. Exit 0 ok, 2 bad input (unknown name, package nowhere to be found).
"""
import os
import sys


import argparse

from kimi_eagle_host.data.data_sources import SOURCES, convert
from kimi_eagle_host.step_runtime import run_step


def run(args):
    path, prov = convert(args.source, os.path.abspath(args.out) if args.out else None)
    return {"ok": True, "step": "data", "path": os.path.abspath(path), **prov}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help=f"dataset name: {', '.join(sorted(SOURCES))}")
    ap.add_argument("--out", default=None, help="JSONL to write (default: the cache, ~/.cache/kimi-eagle/datasets)")
    return run_step("data", run, ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
