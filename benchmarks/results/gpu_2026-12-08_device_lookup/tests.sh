#!/usr/bin/env bash
# The sixteenth run, cut again (~5 minutes, one call, no target carried: ten refused starts left 539 of the session's
# 1,800 device seconds): the GPU tests, first those of prompt lookup and lookup first searching on the device inside
# the steps' CUDA graphs and of the scheduler's graphs (never run on a GPU yet), then the rest of tests/test_cuda_graphs.py.
#   bash .gpu/prelude.sh stash >/dev/null; source .gpu/prelude.sh && bash benchmarks/results/gpu_2026-12-08_device_lookup/tests.sh
# carrying .gpu/prelude.sh and .whl.
set -uo pipefail
o=${OUT:-/tmp/out}
mkdir -p "$o"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$o/gpu.txt"
echo "== lookup and scheduler $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k "lookup or scheduler" > "$o/gpu_tests.txt" 2>&1
tail -n 15 "$o/gpu_tests.txt"
echo "== the rest $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k "not (lookup or scheduler)" > "$o/gpu_tests_rest.txt" 2>&1
tail -n 15 "$o/gpu_tests_rest.txt"
echo "== done $(date +%T)"
