#!/usr/bin/env bash
# 2026-12-06 third run, second machine: the rows kernel and the kernels on by default: GPU tests, tiles for 6 rows,
# three rounds of default / cuBLAS / one row at two shapes, bench shapes at 8B, then the head's pipeline and decode.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$o/gpu2.txt"
cp .gpu/q/next2.sh "$o/"
echo "== tests"; timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_gemv.py tests/test_cuda_graphs.py 2>&1 | grep -vi warn | tail -n 8 | tee "$o/tests2.txt"
echo "== probe"
python3 benchmarks/gemv_probe.py --shape llama-3.1-8b --rows 6 --quick 2>&1 | tail -n 12 | tee "$o/probe_rows6_8b.txt"
config=$(grep -o "one configuration.*: ([0-9, ]*)" "$o/probe_rows6_8b.txt" | grep -o "([0-9, ]*)")
if [ -n "$config" ]; then sed -i "s/^ROWS_CONFIG: Config = ([0-9, ]*)/ROWS_CONFIG: Config = $config/" serve/gemv.py; fi
grep -n "^ROWS_CONFIG" serve/gemv.py | tee -a "$o/probe_rows6_8b.txt"
python3 benchmarks/gemv_probe.py --shape smollm2-135m --rows 6 --quick 2>&1 | tail -n 10 | tee "$o/probe_rows6_smollm2.txt"
for shape in llama-3.1-8b smollm2-135m; do
  echo "== $shape"; python3 benchmarks/profile_shape.py --shape $shape --variants default cuBLAS "gemv one row" --repeats 3 2>&1 | tail -n 14 | tee "$o/variants2_$shape.txt"
done
echo "== scale"; ALPHA=0.679 bash benchmarks/h200_bench.sh scale llama-3.1-8b 2>&1 | tail -n 20 | tee "$o/scale.txt"
echo "== eagle"; bash benchmarks/h200_bench.sh eagle 2>&1 | tail -n 25 | tee "$o/eagle.txt"
echo "== decode"; bash benchmarks/h200_bench.sh decode 2>&1 | tail -n 30 | tee "$o/decode.txt"
echo "== done"
