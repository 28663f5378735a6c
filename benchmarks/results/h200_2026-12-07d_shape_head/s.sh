#!/usr/bin/env bash
# Written in the thirty-fifth session (2026-12-07) and not run yet: no machine came that day (eleven refused
# starts spent 1,546 of the session's 1,800 device seconds), and in the thirty-sixth only an H100, late. For the
# next session, from the repository root after the recipe's two transfers (first part00, .whl and prelude.sh; then
# part01 and prelude.sh):
#   bash benchmarks/h200_bench.sh bg benchmarks/results/h200_2026-12-07d_shape_head/s.sh; then `wait` calls
# 1. on an H200, issue 35's Llama-3.1-8B shape with the runtime as shipped (GEMV kernel on): plain and verify steps, both draft
#    kinds' steps, projected at the 1.5B run's head alpha (0.679, H100 2026-12-05);
# 2. issue 38's two-layer EAGLE-3 head (next_head.sh of the thirteenth run's folder);
# 3. the compiled prompt forward's parity checks (next.sh of that folder; its 8B step skipped, done in 1).
set -uo pipefail
o=${OUT:-/tmp/out}
prev=benchmarks/results/h100_2026-12-07c_prefill_parity
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
if [[ "$gpu" == *H200* && -z "${NO_SHAPES:-}" ]]; then  # an H100's figures are known (RESULTS.md, fourth and fifth runs);
  # NO_SHAPES=1 where an earlier call measured it (h200_bench.sh scale, alone on the device)
  echo "== shapes $(date +%T)"
  timeout 420 python3 -m draftsmith.pipeline.cli bench shapes --shape llama-3.1-8b --batch 1 --batch 16 --k 2 --k 4 \
    --alpha 0.679 --repeats 3 --out "$o/bench_shapes_llama-3.1-8b.json" > "$o/shapes_8b.txt" 2>&1
  grep -v -i warn "$o/shapes_8b.txt" | tail -n 16
fi
if [[ -z "${NO_HEAD:-}" ]]; then  # NO_HEAD=1 where the device time left is short of its ~11 minutes
  echo "== two-layer head $(date +%T)"
  OUT="$o" bash "$prev/next_head.sh"
fi
echo "== parity $(date +%T)"
OUT="$o" NO_SHAPES=1 bash "$prev/next.sh" | tail -n +2
echo "== all done $(date +%T)"
