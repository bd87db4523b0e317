#!/usr/bin/env bash
# Download, on a machine with network, what bench/gpu_e2e.sh needs on a GPU machine without one:
#   .whl/       wheels for the controller (fabric, paramiko, pydantic, ...) for CPython 3.12 x86_64
#   .whl/spec/  the speculators 0.3.0 wheel the e2e run patches
#   .debs/      Debian bookworm OpenSSH packages (sshd, ssh, sftp-server and their libraries)
# Both folders are git-ignored; carry them to the GPU machine with the repo.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
mkdir -p .whl/spec .debs
plat=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
for pkg in fabric==3.2.3 paramiko==5.1.0 invoke decorator deprecated wrapt pydantic==2.13.4 pydantic_core==2.46.4 \
           annotated-types typing-inspection typing-extensions cryptography bcrypt pynacl cffi pycparser; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "$pkg"
done
"$PY" -m pip download -q --no-deps -d .whl/spec speculators==0.3.0
(cd .debs && apt-get download openssh-server openssh-client openssh-sftp-server libwrap0 libgssapi-krb5-2 libkrb5-3 \
   libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libnsl2 libtirpc3 libaudit1 libcap-ng0 libpam0g)
echo "ready: $(ls .whl/*.whl | wc -l) wheels, $(ls .debs/*.deb | wc -l) packages"
