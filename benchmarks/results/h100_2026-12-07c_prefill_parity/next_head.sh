#!/usr/bin/env bash
# For a later GPU session (written 2026-12-07, thirty-fourth session): does a second layer pay for its cost in the
# EAGLE-3 head (issue 38 asks)? The shipped recipe with draft.num_layers=2, through the evaluate stage, to set beside
# the one-layer head's figures on the same split (benchmarks/RESULTS.md, eighth run, H100: held-out teacher-forced
# alpha 0.808, tau 4.338 at K = 7; evaluate tau 3.424 at K = 5 and 3.735 at K = 7, 1.71x at batch 32). vLLM 0.32's CPU
# build loads a two-layer head's bundle and agrees on its acceptance (RESULTS.md, thirteenth run). ~10 device minutes:
#   bash benchmarks/h200_bench.sh bg benchmarks/results/h100_2026-12-07c_prefill_parity/next_head.sh; ... wait
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tee "$o/gpu.txt"
newest() { ls -td $1 2>/dev/null | head -1; }
timeout 900 python3 -m draftsmith.pipeline.cli run preset=eagle3_sweep draft.num_layers=2 tracking.enabled=false \
  target.cache_dir=$root/cache paths.root=$root/runs distill.max_steps=2000 distill.eval_every=500 stop_after=evaluate \
  > "$o/head2.log" 2>&1
grep -E "stage [a-z]+: |alpha=|tau" "$o/head2.log" | grep -v "│" | tail -8
for s in teacher distill evaluate; do cp "$(newest "$root/runs/$s/*")/stage.json" "$o/head2_${s}.json" 2>/dev/null; done
cp "$(newest "$root/runs/evaluate/*")/eval.md" "$o/head2_eval.md" 2>/dev/null
echo "== done $(date +%T)"
