#!/usr/bin/env bash
# issue 35 in the background: preset=qwen_coder (three drafts, STEPS steps) then bench decode; outputs in $r/out
r=/root/draftsmith-gpu
cd "$(dirname "$0")/../.."
source .gpu/prelude.sh >/dev/null 2>&1
mkdir -p $r/out
echo "$(date +%T) start"
LIMIT=1700 OUT=$r/out bash benchmarks/h200_bench.sh qwen_coder distill.max_steps=${STEPS:-400} distill.eval_every=$(( ${STEPS:-400} / 2 ))
echo "$(date +%T) done"; touch $r/chain.done
