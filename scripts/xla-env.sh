#!/usr/bin/env bash
# Builds a separate virtual environment pinned to torch 2.9.0 + torch_xla 2.9.0 (CPU wheels; torch_xla's
# last release, which imports only on torch 2.9) and runs the `xla`-marked tests on one XLA:CPU device
# (PJRT_DEVICE=CPU). The default CI environment (newer torch, no torch_xla) skips those tests.
#
#   scripts/xla-env.sh                 # build (idempotent) then test
#   scripts/xla-env.sh --build-only    # only build the environment
#   scripts/xla-env.sh --test-only     # only run the tests in an existing environment
#   XLA_VENV=/path scripts/xla-env.sh  # environment location (default: .xla-venv, ignored by git)
#
# Several GB of downloads. The CPU index of download.pytorch.org is tried first, PyPI second.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${XLA_VENV:-$ROOT/.xla-venv}
PY=${PYTHON:-python3}
TORCH_VERSION=2.9.0
TORCH_XLA_VERSION=2.9.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore PIP_NO_CACHE_DIR=1
MODE=${1:-all}
case "$MODE" in all|--build-only|--test-only) ;; *)
  echo "xla-env.sh: unknown option '$MODE'; valid: --build-only, --test-only (or none for both)" >&2; exit 2;;
esac

build() {
  echo "== disk before: $(df -h --output=avail "$ROOT" | tail -1 | tr -d ' ') free"
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  local vpy="$VENV/bin/python"
  # The CPU index is used only when it answers (probed once, 15 s): otherwise pip would retry it for
  # every package. PyPI's torch 2.9.0 wheel is the CUDA build (about 3x larger, still runs on CPU).
  local extra=()
  if "$vpy" -c "import urllib.request; urllib.request.urlopen('$CPU_INDEX/torch/', timeout=15)" 2>/dev/null; then
    extra=(--extra-index-url "$CPU_INDEX")
    "$vpy" -m pip install -q "torch==$TORCH_VERSION" --index-url "$CPU_INDEX"
  else
    echo "== $CPU_INDEX does not answer; installing torch==$TORCH_VERSION from PyPI"
    "$vpy" -m pip install -q "torch==$TORCH_VERSION"
  fi
  # torch_xla is on PyPI; its CPU PJRT runtime ships in the wheel (no libtpu needed for PJRT_DEVICE=CPU).
  "$vpy" -m pip install -q "torch==$TORCH_VERSION" "torch_xla==$TORCH_XLA_VERSION" "${extra[@]}"
  # trainforge's own dependencies (pins from requirements/ci.txt except torch and the optional trackers).
  grep -E '^(torchdata|safetensors|tqdm|psutil|PyYAML|numpy|pytest|pytest-timeout)==' requirements/ci.txt \
      > "$VENV/xla-constraints.txt"
  "$vpy" -m pip install -q -r "$VENV/xla-constraints.txt" "torch==$TORCH_VERSION" "${extra[@]}"
  echo "== venv size: $(du -sh "$VENV" | cut -f1); disk after: $(df -h --output=avail "$ROOT" | tail -1 | tr -d ' ') free"
}

run_tests() {
  local vpy="$VENV/bin/python"
  [ -x "$vpy" ] || { echo "xla-env.sh: no environment at $VENV; run scripts/xla-env.sh --build-only first" >&2; exit 2; }
  PJRT_DEVICE=CPU "$vpy" -c 'import sys, torch, torch_xla; print("python", sys.version.split()[0], "torch", torch.__version__, "torch_xla", torch_xla.__version__)'
  # The repository root goes first on the path: the tests import this checkout, never an installed copy.
  PJRT_DEVICE=CPU PYTHONPATH="$ROOT" "$vpy" -m pytest -q -p no:cacheprovider -m xla tests/
}

[ "$MODE" = --test-only ] || build
[ "$MODE" = --build-only ] || run_tests
