#!/usr/bin/env bash
# The sixteenth run (thirty-ninth session), in the foreground of one call (~7 minutes) after the recipe's first
# transfer (.gpu/target.part00, .gpu/target.sha256, .gpu/prelude.sh, .whl with `bash .gpu/prelude.sh stash`), carrying
# .gpu/target.part01, .gpu/head.tgz and .gpu/prelude.sh:
#   source .gpu/prelude.sh && bash benchmarks/results/gpu_2026-12-08_device_lookup/run.sh
# Seven refused starts left too little device time for the Qwen2.5-Coder run; this is next.sh of
# h100_2026-12-07g_qwen_coder cut to what has never run on a GPU: prompt lookup and lookup first searching each row's
# text on the device, inside the step's CUDA graph. The head in .gpu/head.tgz is the twelfth run's short one (600
# steps, 4 answers a prompt; tau 1.70 at K = 7 on these prompts then), so lookup first has much to add to it.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" | tee "$o/gpu.txt"
mkdir -p "$root/head" && tar -xf .gpu/head.tgz -C "$root/head" && head_dir=$root/head/draft
echo "== gpu tests $(date +%T)"  # the lookups in the steps' graphs equal eager decoding; the scheduler's graphs too
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k "lookup or scheduler" > "$o/gpu_tests.txt" 2>&1
tail -n 3 "$o/gpu_tests.txt"
echo "== decode $(date +%T)"  # the head alone, lookup first on the host and on the device, prompt lookup: batch 1 and 16
timeout 330 python3 -m draftsmith.pipeline.cli bench decode --device cuda --prompts 8 --new-tokens 256 --k 5 --repeats 3 \
  --batch 16 --draft "$head_dir" --lookup --device-lookup --cache-dir "$root/cache" --out "$o/bench_decode.json" > "$o/decode.txt" 2>&1
grep "│" "$o/decode.txt" | cut -c1-150
echo "== done $(date +%T)"
