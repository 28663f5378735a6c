#!/usr/bin/env bash
# For the next GPU session (written 2026-12-07, thirty-fourth session): where batch 16's tokens part from batch 1's
# with the prompt forward compiled (benchmarks/RESULTS.md, thirteenth run). From the repository root, after the
# recipe's two transfers (no head needed):
#   bash benchmarks/h200_bench.sh bg benchmarks/results/h100_2026-12-07c_prefill_parity/next.sh; ... wait
# 1. parity.py with the prompt also in 128- and 256-token buckets (the unchanged code; it compiles by itself);
# 2. the twelfth run's patch applied, engine_parity.py: each prompt's prefill as bench decode's batch-1 and batch-16
#    engines make it, compared (equal prefills with parted tokens put the cause in the decode steps);
# 3. on an H200, issue 35's Llama-3.1-8B shape.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
here=benchmarks/results/h100_2026-12-07c_prefill_parity
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
tdir=$(python3 -c "from pathlib import Path; from draftsmith.pipeline.target import convert_gguf, demo_gguf_path; print(convert_gguf(demo_gguf_path(), Path('$root/cache')))" 2>/dev/null | tail -1)
echo "== parity $(date +%T)"
timeout 240 python3 "$here/parity.py" "$tdir" cuda sdpa > "$o/parity_buckets.txt" 2>&1
grep "^| sdpa" "$o/parity_buckets.txt" | cut -c1-170
echo "== engine parity $(date +%T)"
git apply benchmarks/results/h100_2026-12-07b_compiled_prompts/compiled_prompts.patch 2>/dev/null \
  || patch -p1 < benchmarks/results/h100_2026-12-07b_compiled_prompts/compiled_prompts.patch
timeout 360 python3 "$here/engine_parity.py" "$tdir" cuda 8 256 > "$o/engine_parity.txt" 2>&1
grep -v -i warn "$o/engine_parity.txt" | tail -n 14
if [[ "$gpu" == *H200* && -z "${NO_SHAPES:-}" ]]; then  # NO_SHAPES=1: measured elsewhere
  echo "== shapes $(date +%T)"
  timeout 360 python3 -m draftsmith.pipeline.cli bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 --repeats 3 \
    --out "$o/shapes_8b.json" > "$o/shapes_8b.txt" 2>&1; grep -v -i warn "$o/shapes_8b.txt" | tail -n 14
fi
echo "== done $(date +%T)"
