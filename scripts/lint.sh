#!/usr/bin/env bash
# Lint (ruff, configured in ruff.toml) and type check (scripts/typecheck.sh), as .ci/run does before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m ruff check .
# type check (mypy, mypy.ini): strict on the public API, default checks elsewhere
bash scripts/typecheck.sh
