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
# An editable install compiles nothing (a regular one does): compile our modules once here, or every
# process that imports them compiles them again where PYTHONDONTWRITEBYTECODE is set (the test suite starts
# ~300 processes: about 25 s of a 2-core CI run). A stale .pyc is only ignored, never used, by Python.
"$PY" -m compileall -q trainforge trainer callbacks strategies tests benchmarks examples >/dev/null
# Best effort, last: Debian's chromium for the docs' headless-browser test (tests/test_docs.py skips it when
# no browser is installed). Only as root where apt-get exists and chromium is missing; any failure (no
# network, another distribution, a held lock) is reported and never fails the install. Measured: about
# 1.5 minutes on a Debian 12 machine without it (apt-get update, then chromium and its libraries).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then
    if ! (timeout 900 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq chromium) >/dev/null 2>&1; then
        echo "install.sh: chromium could not be installed (optional: the docs' browser test will be skipped)" >&2
    fi
fi
# Best effort: SLURM and munge for tests/trainer/test_slurm_requeue.py, which starts a single-node SLURM
# (skipped with its reason without them). Root and apt only; a failure never fails the install.
# Measured on Debian 12 (apt lists present; 9 packages, 3.5 MB downloaded): 18 s, well under the ~60 s
# budget, so CI installs it and runs the test (about 90 s for its two jobs). An `apt-get update` (2.4 s
# here) is run only when the plain install fails (stale package lists).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v slurmctld >/dev/null; then
    slurm_pkgs="slurm-wlm munge"
    export DEBIAN_FRONTEND=noninteractive
    timeout 180 apt-get install -y -q --no-install-recommends $slurm_pkgs >/dev/null 2>&1 ||
        { timeout 120 apt-get update -q >/dev/null 2>&1 &&
            timeout 180 apt-get install -y -q --no-install-recommends $slurm_pkgs >/dev/null 2>&1; } ||
        echo "install.sh: could not apt-get install $slurm_pkgs (best effort): the SLURM requeue test will skip" >&2
fi
