#!/usr/bin/env bash
# End to end on a GPU machine with no network. Before, on a machine with network:
#   bash bench/gpu/fetch_gpu_deps.sh        # .whl/ (controller wheels, speculators) and .debs/ (OpenSSH)
# Then on the GPU machine, from the repo root:
#   PYTHON=/opt/torch/.venv/bin/python3 OUT=./out bash bench/gpu/gpu_e2e.sh
# Nothing is installed from a registry there: the wheels go to a private --target folder and the
# Debian packages are unpacked with dpkg -x into a private folder.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
OUT=${OUT:-./out}
mkdir -p "$OUT"
site=/tmp/kimi-eagle-site
ossh=/tmp/kimi-eagle-openssh
"$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

if ! command -v sshd >/dev/null 2>&1; then
  mkdir -p "$ossh" /run/sshd
  for f in .debs/*.deb; do dpkg -x "$f" "$ossh"; done
  id sshd >/dev/null 2>&1 || useradd -r -M -d /run/sshd -s /usr/sbin/nologin sshd
  libs="$ossh/usr/lib/x86_64-linux-gnu:$ossh/lib/x86_64-linux-gnu"
  mkdir -p "$ossh/wrap"
  for tool in usr/sbin/sshd usr/bin/ssh usr/bin/ssh-keygen usr/bin/scp; do
    printf '#!/bin/sh\nLD_LIBRARY_PATH=%s exec %s "$@"\n' "$libs" "$ossh/$tool" > "$ossh/wrap/$(basename $tool)"
    chmod +x "$ossh/wrap/$(basename $tool)"
  done
  export PATH="$ossh/wrap:$PATH"
fi
export PATH="$PATH:/usr/local/nvidia/bin"
"$PY" bench/gpu/gpu_e2e.py
