#!/usr/bin/env bash
# Installs trainforge with every optional backend into the current Python, CPU-only:
# pinned torch CPU wheel first, then DeepSpeed built from source against it (no CUDA ops), then
# the project in editable mode. Safe to re-run; pip skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
"$PY" -m pip install -q -r requirements/ci.txt
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip install -q --no-build-isolation -c requirements/ci.txt "deepspeed==0.19.8"
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
