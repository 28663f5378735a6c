#!/usr/bin/env bash
# 2026-12-06 sixth run: one compiled graph a later step with the split attention (git revert d3d9f89): GPU test, then
# profile_train (shipped on this machine, same command, right before: 394,909).
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
echo "== test"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_eagle.py -k "compiled_unroll or flex_window" 2>&1 | tail -2 | tee "$o/test_ps.txt"
echo "== per_step_split"
timeout 240 python3 benchmarks/profile_train.py --cache-dir $root/cache --head --variant "head, chunked, compiled, length-grouped" \
  --repeats 3 --steps 6 2>&1 | grep -v -i warn | tail -n 7 | tee "$o/train_per_step_split.txt"
echo "== done"
