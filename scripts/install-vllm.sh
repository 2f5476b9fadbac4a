#!/usr/bin/env bash
# install-vllm.sh -- install vLLM 0.33.0 for CPU-only tests into the *current* python
# (`python3` on PATH, or $PYTHON). Called by scripts/install-test-deps.sh; tests/vllm/ needs it.  Idempotent: a second run only verifies (~0.2 s).
#
#   1. torch==2.13.0+cpu   with pip (only if another torch is there): the CPU wheel on this machine kind's disk
#                          (/opt/wheels, pip find-links). The exact "+cpu" local version
#                          makes pip fail rather than ever fall back to a multi-GB CUDA
#                          build from PyPI. (uv does not look in /opt/wheels: never use
#                          uv for torch.)
#   2. requirements-vllm.txt, --no-deps (a full pinned lock; no resolver, so triton and
#                          CUDA packages never come in). Done with uv when available
#                          (~5 s) else pip (~1.5-3 min on 2 cores).
#   3. vllm==0.33.0 --no-deps (its METADATA pins torch==2.14.0 and CUDA-only packages).
#   4. optional (WITH_NIXL=1): nixl==1.5.1 + nixl-cu13==1.5.1 --no-deps, needed only to
#      instantiate NixlConnector with role=WORKER. Importing vllm / NixlConnector and
#      the scheduler side do not need nixl.
#   5. smoke: VLLM_TARGET_DEVICE=cpu python -c "import vllm; ... Scheduler ..."
#
# Env knobs: PYTHON (default python3), TORCH_SPEC (default torch==2.13.0+cpu),
#   WITH_NIXL=1, VLLM_INSTALLER=pip|uv (default: uv, bootstrapped with pip; falls back
#   to pip), VLLM_INSTALL_FORCE=1 (skip the fast path), SKIP_SMOKE=1.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PY="$(command -v "${PYTHON:-python3}")"
VLLM_SPEC="vllm==0.33.0"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0+cpu}"
UV_SPEC="uv==0.13.9"
NIXL_SPECS=(nixl==1.5.1 nixl-cu13==1.5.1)
REQ="$HERE/requirements-vllm.txt"
export PIP_DISABLE_PIP_VERSION_CHECK=1
export VLLM_TARGET_DEVICE=cpu

t0=$(date +%s)
log() { echo "[install-vllm +$(( $(date +%s) - t0 ))s] $*"; }

check_installed() {  # exit 0 iff every pin (and vllm, torch, nixl if asked) is present
  local extra=()
  [[ "${WITH_NIXL:-0}" == 1 ]] && extra=("${NIXL_SPECS[@]}")
  "$PY" - "$REQ" "$VLLM_SPEC" "$TORCH_SPEC" "${extra[@]}" <<'PYEOF'
import sys
from importlib.metadata import version, PackageNotFoundError
req, *pins = sys.argv[1:]
for line in open(req):
    line = line.split("#", 1)[0].strip()
    if line:
        pins.append(line)
bad = []
for p in pins:
    name, want = p.split("==")
    try:
        have = version(name)
    except PackageNotFoundError:
        bad.append(f"{name} missing"); continue
    if have != want:
        bad.append(f"{name} {have}!={want}")
if bad:
    print("to install: " + ", ".join(bad[:8]) + (f" ... (+{len(bad)-8})" if len(bad) > 8 else ""))
    sys.exit(1)
PYEOF
}

if [[ "${VLLM_INSTALL_FORCE:-0}" != 1 ]] && check_installed; then
  log "vLLM 0.33.0 + pinned CPU deps already installed in $PY; nothing to do"
  exit 0
fi

# --- 1. CPU torch (pip only) --------------------------------------------------------
torch_now="$("$PY" -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)"
if [[ "torch==$torch_now" != "$TORCH_SPEC" ]]; then
  log "installing $TORCH_SPEC with pip (was: ${torch_now:-none})"
  "$PY" -m pip install "$TORCH_SPEC" || {
    echo "ERROR: could not install $TORCH_SPEC. Expected the CPU wheel in /opt/wheels" >&2
    echo "       (pip find-links). Refusing to fall back to a CUDA torch from PyPI." >&2
    exit 1; }
fi

# --- choose the bulk installer --------------------------------------------------------
installer="${VLLM_INSTALLER:-uv}"
UV=()
if [[ "$installer" == uv ]]; then
  if command -v uv >/dev/null 2>&1; then
    UV=(uv)
  elif "$PY" -m uv --version >/dev/null 2>&1 || "$PY" -m pip install -q "$UV_SPEC"; then
    UV=("$PY" -m uv)
  else
    log "could not get uv; falling back to pip"; installer=pip
  fi
fi
nodeps_install() {  # args: pip-style requirement args
  if [[ "$installer" == uv ]]; then
    "${UV[@]}" pip install --python "$PY" --no-deps "$@" && return 0
    log "uv failed; retrying with pip"
    "$PY" -m pip install --no-deps "$@"
  else
    "$PY" -m pip install --no-deps "$@"
  fi
}

# --- 2. pinned, non-GPU deps ------------------------------------------------------------
log "installing pinned deps from $(basename "$REQ") with $installer"
nodeps_install -r "$REQ"

# --- 3. vLLM itself ----------------------------------------------------------------------
log "installing $VLLM_SPEC --no-deps with $installer"
nodeps_install "$VLLM_SPEC"

# --- 4. nixl (optional) -------------------------------------------------------------------
if [[ "${WITH_NIXL:-0}" == 1 ]]; then
  log "installing ${NIXL_SPECS[*]} --no-deps"
  nodeps_install "${NIXL_SPECS[@]}"
fi

# guard: nothing above may have replaced the CPU torch
"$PY" -c 'import importlib.metadata as m, sys; v=m.version("torch"); sys.exit(0 if v.endswith("+cpu") else f"torch {v} is not a CPU build")'
check_installed >/dev/null

# --- 5. smoke test -------------------------------------------------------------------------
if [[ "${SKIP_SMOKE:-0}" != 1 ]]; then
  log "smoke test (imports take ~10 s)"
  "$PY" - <<'PYEOF'
import os, time
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
t = time.time()
import torch, vllm
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector  # noqa: F401
from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector  # noqa: F401
assert vllm.__version__.startswith("0.33.0"), vllm.__version__
assert torch.version.cuda is None, "CUDA torch installed"
print(f"vllm {vllm.__version__} / torch {torch.__version__} import ok in {time.time()-t:.1f}s")
PYEOF
fi
log "done"
