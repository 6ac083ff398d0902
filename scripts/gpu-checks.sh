#!/usr/bin/env bash
# What a session with a CUDA GPU runs (see docs/development.md, "Tests"): the gpu-marked tests, then the GPU
# benchmarks, each log under ${OUT:-gpu-logs}/. Packages missing there (torchdata, deepspeed, torchao...)
# can come as wheels in .whl/ (installed into /tmp/site, made visible to every child through a .pth).
#   bash scripts/gpu-checks.sh [tests] [throughput] [fp8] [overhead] [stall] [inference]   (default: all)
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-logs}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
  site=$(python3 -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  printf '/tmp/site\n%s\n' "$PWD" > "$site/zz_trainforge_gpu.pth"
fi
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests throughput fp8 overhead stall inference)
for step in "${steps[@]}"; do
  case $step in
    tests) timeout 420 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py tests/inference/test_gpu.py 2>&1 | tee "$out/gpu-tests.log" | tail -15 ;;
    throughput) timeout 420 python3 benchmarks/throughput.py --modes eager --repeats 3 2>&1 | tee "$out/throughput.log" | tail -9 ;;
    fp8) timeout 330 python3 benchmarks/throughput.py --model gpt1b --seq-len 2048 --batch-size 4 --modes compile \
           --loops raw,trainer --precision bf16-mixed,fp8 --repeats 1 --steps 20 --warmup 8 2>&1 | tee "$out/fp8.log" | tail -7 ;;
    overhead) timeout 200 python3 benchmarks/overhead.py --repeats 9 2>&1 | tee "$out/overhead.log" | tail -14 ;;
    stall) timeout 300 python3 benchmarks/checkpoint.py --stall --gpt2 2>&1 | tee "$out/stall.log" | tail -14 ;;
    inference) timeout 200 python3 benchmarks/inference.py --device cuda 2>&1 | tee "$out/inference.log" | tail -14 ;;
    *) echo "unknown step '$step': choose from tests throughput fp8 overhead stall inference" >&2; exit 2 ;;
  esac
done
