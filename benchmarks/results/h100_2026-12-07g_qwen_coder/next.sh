#!/usr/bin/env bash
# Written in the thirty-seventh session (2026-12-07) for the next one; not run yet (the session's device time went to
# run.sh). Prompt lookup now searches each row's text on the device, inside the step's graph, and lookup first can
# too (LookupFirst(on_device=True), bench decode --device-lookup). Measure that side by side with the host's search,
# then the 1.5B shape's plain step with and without serve/gemv.py. From the repository root after two transfers
# (first .gpu/target.part00, .gpu/target.sha256, .gpu/prelude.sh and .whl with `bash .gpu/prelude.sh stash`; then
# .gpu/target.part01, .gpu/head.tgz and .gpu/prelude.sh), as
#   source .gpu/prelude.sh && bash benchmarks/h200_bench.sh bg benchmarks/results/h100_2026-12-07g_qwen_coder/next.sh
# then `wait` calls (~10 minutes; on an H200 ~13 with the 8B shape).
# .gpu/head.tgz is the twelfth run's short head (600 steps, 4 answers a prompt: tau 1.70 at K = 7 on these prompts),
# not the shipped recipe's: lookup first has much to add to it, so compare host and device, not against other runs.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2)" | tee "$o/gpu.txt"
cli=(python3 -m draftsmith.pipeline.cli)
mkdir -p "$root/head" && tar -xf .gpu/head.tgz -C "$root/head" && head_dir=$root/head/draft
echo "== gpu tests $(date +%T)"  # the lookups in the steps' graphs equal eager decoding; the scheduler's graphs too
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k "lookup or scheduler" > "$o/gpu_tests.txt" 2>&1
tail -n 3 "$o/gpu_tests.txt"
echo "== decode $(date +%T)"  # the head alone, lookup first on the host and on the device, prompt lookup: batch 1 and 16
timeout 420 "${cli[@]}" bench decode --device cuda --prompts 8 --new-tokens 256 --k 5 --repeats 3 --batch 16 \
  --draft "$head_dir" --lookup --device-lookup --cache-dir "$root/cache" --out "$o/bench_decode.json" > "$o/decode.txt" 2>&1
grep "│" "$o/decode.txt" | cut -c1-140
echo "== 1.5B shape $(date +%T)"  # the kernel at Qwen2.5-Coder-1.5B's products: the plain step went 2.15 -> 2.29 ms
timeout 240 python3 benchmarks/profile_shape.py --shape qwen2.5-1.5b --variants default cuBLAS --repeats 3 2>&1 | tail -n 6
if [[ "$gpu" == *H200* ]]; then  # issue 35's 8B step, with the runtime as shipped
  echo "== 8B shape $(date +%T)"
  timeout 300 "${cli[@]}" bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 --repeats 3 \
    --out "$o/bench_shapes_llama-3.1-8b.json" > "$o/shapes_8b.txt" 2>&1
  grep -v -i warn "$o/shapes_8b.txt" | tail -n 12
fi
echo "== done $(date +%T)"
