#!/usr/bin/env bash
# Lint and format check (ruff, configured in ruff.toml) and type check (scripts/typecheck.sh), as
# .ci/run does before the tests. `ruff format .` applies the format.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m ruff check .
"${PYTHON:-python3}" -m ruff format --check .
# the import floors of docs/ARCHITECTURE.md (strategies/ imports no trainer or callbacks, ...)
"${PYTHON:-python3}" scripts/check_imports.py
# type check (mypy, mypy.ini): strict on the public API, default checks elsewhere
bash scripts/typecheck.sh
