#!/usr/bin/env bash
# Lint (ruff, configured in ruff.toml), as .ci/run does before the tests.
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -m ruff check .
