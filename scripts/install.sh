#!/usr/bin/env bash
# Installs trainforge with every optional backend into the current Python, CPU-only:
# pinned torch CPU wheel first, then DeepSpeed built from source against it (no CUDA ops), then
# the project in editable mode. Safe to re-run; pip skips what is already there.
# Python packages only, never system packages: the tools some tests use (a browser, SLURM) are installed by
# scripts/install-test-tools.sh, which the test path runs (README's second command, .ci/run).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
"$PY" -m pip install -q -r requirements/ci.txt
DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "$PY" -m pip install -q --no-build-isolation -c requirements/ci.txt "deepspeed==0.19.8"
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
# An editable install compiles nothing (a regular one does): compile our modules once here, or every
# process that imports them compiles them again where PYTHONDONTWRITEBYTECODE is set (the test suite starts
# ~300 processes: about 25 s of a 2-core CI run). A stale .pyc is only ignored, never used, by Python.
"$PY" -m compileall -q trainforge trainer callbacks strategies tests benchmarks examples >/dev/null
