#!/usr/bin/env bash
# The fifteenth run (2026-12-07, thirty-seventh session), for issue 35, in the background on one warm machine
# (`bash benchmarks/h200_bench.sh bg benchmarks/results/h100_2026-12-07g_qwen_coder/run.sh` right after the first
# transfer; `put` calls carry the Qwen2.5-Coder pieces meanwhile, then `wait` calls):
# 1. on an H200: the Llama-3.1-8B shape with the runtime as shipped (GEMV kernel with the residual add): plain step,
#    verify 5 tokens (K = 4), both draft kinds' steps, projected at the 1.5B run's head alpha (0.679, H100 2026-12-05);
# 2. once all 27 pieces are in: preset=qwen_coder's three drafts end to end, then one bench decode run (K = 5).
set -uo pipefail
o=${OUT:-/tmp/out}
root=${ROOT:-/root/draftsmith-gpu}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
if [[ "$gpu" == *H200* && -z "${NO_SHAPES:-}" ]]; then
  echo "== shapes $(date +%T)"
  timeout 300 python3 -m draftsmith.pipeline.cli bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 \
    --repeats 3 --out "$o/bench_shapes_llama-3.1-8b.json" > "$o/shapes_8b.txt" 2>&1
  grep -v -i warn "$o/shapes_8b.txt" | tail -n 12
fi
echo "== waiting for the pieces $(date +%T)"
end=$((SECONDS + 900))
until [ "$(ls "$root/qwen_coder" 2>/dev/null | grep -c '\.part')" -ge 27 ] || [ $SECONDS -ge $end ]; do sleep 5; done
echo "== qwen_coder $(date +%T)"
KS=5 PROMPTS=8 bash benchmarks/h200_bench.sh qwen_coder distill.max_steps=300 distill.eval_every=150 \
  evaluate.num_prompts=64 > "$o/qwen_coder.txt" 2>&1
tail -n 40 "$o/qwen_coder.txt"
echo "== all done $(date +%T)"
