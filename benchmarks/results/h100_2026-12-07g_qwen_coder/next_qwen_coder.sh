#!/usr/bin/env bash
# Written in the thirty-ninth session (2026-12-08) for the next one; not run yet (no machine started that day in sixteen attempts).
# Issue 35's Qwen2.5-Coder-1.5B run again, in the background on one warm machine: the first call carries
# .gpu/prelude.sh, .whl and the prompts' piece with the three sha256 files, stashes and keeps them, and starts this:
#   bash .gpu/prelude.sh stash >/dev/null && source .gpu/prelude.sh && bash benchmarks/h200_bench.sh put \
#     && bash benchmarks/h200_bench.sh bg benchmarks/results/h100_2026-12-07g_qwen_coder/next_qwen_coder.sh
# then 26 `put` calls carry the other pieces (one each, with .gpu/prelude.sh), then `wait` calls (~27 minutes in all
# on an H100; with less device time, JOBS=1 and draft=sibling on the qwen_coder line: ~15). No demo target is needed.
# 1. while the pieces come: the GPU tests of lookups and the scheduler inside the steps' CUDA graphs (never run on a
#    GPU yet), then the 1.5B shape's plain step and verification with and without serve/gemv.py;
# 2. once all 27 pieces are in: preset=qwen_coder's three drafts end to end (the sibling with rank-16 LoRA adapters
#    for the first time on a GPU), then one bench decode run, K = 5, lookup first on the host and on the device;
# 3. on an H200, if the session's time allows: the Llama-3.1-8B shape.
set -uo pipefail
o=${OUT:-/tmp/out}
root=${ROOT:-/root/draftsmith-gpu}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" | tee "$o/gpu.txt"
echo "== gpu tests $(date +%T)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k "lookup or scheduler" > "$o/gpu_tests.txt" 2>&1
tail -n 3 "$o/gpu_tests.txt"
echo "== 1.5B shape $(date +%T)"
timeout 240 python3 benchmarks/profile_shape.py --shape qwen2.5-1.5b --variants default cuBLAS --repeats 3 > "$o/shape_1.5b.txt" 2>&1
tail -n 6 "$o/shape_1.5b.txt"
echo "== waiting for the pieces $(date +%T)"
end=$((SECONDS + 900))
until [ "$(ls "$root/qwen_coder" 2>/dev/null | grep -c '\.part')" -ge 27 ] || [ $SECONDS -ge $end ]; do sleep 5; done
echo "== qwen_coder $(date +%T)"
KS=5 PROMPTS=8 JOBS=3 LOOKUP="--lookup --device-lookup" bash benchmarks/h200_bench.sh qwen_coder \
  distill.max_steps=300 distill.eval_every=150 evaluate.num_prompts=64 > "$o/qwen_coder.txt" 2>&1
tail -n 45 "$o/qwen_coder.txt"
if [[ "$gpu" == *H200* ]]; then
  echo "== 8B shape $(date +%T)"
  timeout 300 python3 -m draftsmith.pipeline.cli bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 \
    --repeats 3 --out "$o/bench_shapes_llama-3.1-8b.json" > "$o/shapes_8b.txt" 2>&1
  grep -v -i warn "$o/shapes_8b.txt" | tail -n 12
fi
echo "== all done $(date +%T)"
