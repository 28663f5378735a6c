#!/usr/bin/env bash
# 2026-12-06 third run: the GEMV kernel's tests and three rounds against cuBLAS at two shapes, the quantize stage's
# held-out comparison's peak memory at qwen_coder's sizes, and the head trainer with read_later, profiled.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$o/gpu.txt"
cp .gpu/q/next.sh .gpu/q/heldout_memory.py "$o/" 2>/dev/null
echo "== gemv tests"; python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_gemv.py -k gemv 2>&1 | tail -n 5 | tee "$o/tests.txt"
for shape in llama-3.1-8b smollm2-135m; do
  echo "== $shape"; python3 benchmarks/profile_shape.py --shape $shape --variants default "gemv kernel" --repeats 3 2>&1 | tail -n 12 | tee "$o/variants_$shape.txt"
done
echo "== heldout memory"; python3 .gpu/q/heldout_memory.py 2>&1 | tail -n 6 | tee "$o/heldout_memory.txt"
echo "== train"; python3 benchmarks/profile_train.py --cache-dir $root/cache --head --repeats 3 --steps 6 \
  --variant "head, chunked, compiled, length-grouped" --profile 2>&1 | tail -n 40 | tee "$o/train.txt"
if nvidia-smi --query-gpu=name --format=csv,noheader | grep -q H200; then
  bash benchmarks/h200_bench.sh eagle 2>&1 | tail -n 30
  bash benchmarks/h200_bench.sh decode 2>&1 | tail -n 30
fi
echo "== done"
