#!/usr/bin/env bash
# 2026-12-07 ninth run. Issue 35: the Llama-3.1-8B shape with the GEMV kernel on an H200 (bench shapes, verify 5 tokens,
# projected at the 1.5B head's alpha 0.679). Issue 38: adaptive K on the run's own step costs (seeded rows keep the
# warm-up's), side by side with the warm-up's costs kept (StepCostTable.observe a no-op), on the eighth run's published
# head (carried as .gpu/head.tgz: its training is unchanged); then bench decode on all 115 held-out prompts (K 5 and 7,
# batch 16) and profile_batch at batch 16.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
cli=(python3 -m draftsmith.pipeline.cli)
newest() { ls -td $1 2>/dev/null | head -1; }
echo "== waiting for the head $(date +%T)"  # the last run's published head (2026-12-06 eighth run), carried by a later call
head_dir=$root/head/draft
for i in $(seq 180); do [ -f "$head_dir/model.safetensors" ] && break; sleep 5; done
# batch 16 side by side: adaptive K on the run's own step costs (new) and on the warm-up's (old)
old=(python3 -c "from draftsmith.serve.scheduler import StepCostTable as T; T.observe = lambda self, *a: None; from draftsmith.pipeline.cli import main; main()")
for v in new old; do
  echo "== decode8 $v $(date +%T)"
  run=("${cli[@]}"); [ $v = old ] && run=("${old[@]}")
  timeout 300 "${run[@]}" bench decode --device cuda --prompts 8 --new-tokens 256 --k 7 --repeats 3 --batch 16 \
    --draft "$head_dir" --cache-dir $root/cache > "$o/decode8_$v.txt" 2>&1
  grep -E "plain|adaptive|K=7" "$o/decode8_$v.txt" | tail -n 4
  cat "$o/decode8_$v.txt" >> "$o/decode8.txt"; rm "$o/decode8_$v.txt"
done
echo "== gpu tests $(date +%T)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k "scheduler" > "$o/gpu_tests.txt" 2>&1; tail -n 3 "$o/gpu_tests.txt"
echo "== shapes $(date +%T)"
case "$gpu" in *H200*) ;; *) echo "not an H200: shapes skipped";; esac; [[ "$gpu" == *H200* ]] && timeout 360 "${cli[@]}" bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 --repeats 3 \
  --out "$o/shapes_8b.json" > "$o/shapes_8b.txt" 2>&1
grep -v -i warn "$o/shapes_8b.txt" | tail -n 14
echo "== decode115 $(date +%T)"
timeout 600 "${cli[@]}" bench decode --device cuda --prompts 115 --new-tokens 256 --k 5 --k 7 --repeats 3 --batch 16 \
  --draft "$head_dir" --cache-dir $root/cache --out "$o/decode115.json" > "$o/decode115.txt" 2>&1
grep -v -i warn "$o/decode115.txt" | tail -n 12
echo "== profile_batch $(date +%T)"
timeout 240 python3 benchmarks/profile_batch.py --draft "$head_dir" --cache-dir $root/cache --batch 16 --k 7 > "$o/profile_batch.txt" 2>&1
grep -v -i warn "$o/profile_batch.txt" | tail -n 30
echo "== done $(date +%T)"
