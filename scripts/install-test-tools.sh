#!/usr/bin/env bash
# The system tools some tests use, installed for the test path only (README's second command, .ci/run):
# scripts/install.sh installs the Python packages, and a user who only trains needs nothing of this.
# Best effort: every step is skipped without root or apt-get, and a failure is reported, never fatal
# (the tests that need a tool skip with their reason when it is missing). Always exits 0.
set -uo pipefail
# Debian's chromium for the docs' headless-browser test (tests/test_docs.py skips it when
# no browser is installed). Only as root where apt-get exists and chromium is missing; any failure (no
# network, another distribution, a held lock) is reported and never fails this script. Measured: about
# 1.5 minutes on a Debian 12 machine without it (apt-get update, then chromium and its libraries).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v chromium >/dev/null; then
    if ! (timeout 900 apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq chromium) >/dev/null 2>&1; then
        echo "install-test-tools.sh: chromium could not be installed (optional: the docs' browser test will be skipped)" >&2
    fi
fi
# Best effort: SLURM and munge for tests/trainer/test_slurm_requeue.py, which starts a single-node SLURM
# (skipped with its reason without them). Root and apt only; a failure never fails this script.
# Measured on Debian 12 (apt lists present; 9 packages, 3.5 MB downloaded): 18 s, well under the ~60 s
# budget, so CI installs it and runs the test (about 90 s for its two jobs). An `apt-get update` (2.4 s
# here) is run only when the plain install fails (stale package lists).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v slurmctld >/dev/null; then
    slurm_pkgs="slurm-wlm munge"
    export DEBIAN_FRONTEND=noninteractive
    timeout 180 apt-get install -y -q --no-install-recommends $slurm_pkgs >/dev/null 2>&1 ||
        { timeout 120 apt-get update -q >/dev/null 2>&1 &&
            timeout 180 apt-get install -y -q --no-install-recommends $slurm_pkgs >/dev/null 2>&1; } ||
        echo "install-test-tools.sh: could not apt-get install $slurm_pkgs (best effort): the SLURM requeue test will skip" >&2
fi
exit 0
