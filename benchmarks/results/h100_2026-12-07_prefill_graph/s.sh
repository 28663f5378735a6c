#!/usr/bin/env bash
# Next run (written 2026-12-07, tenth session): admissions after the launch (Scheduler.admit_after_launch) and the EAGLE-3
# head's prompt read in a CUDA graph (GraphedPrefill.read_head), each against the old way, side by side:
# bench decode at batch 16 on 8 prompts, medians of 3 (the GPU tests after the first two), then profile_batch (device spans of steps and prefills, one
# timed run each; new and old only). Variants: new (both), before (admit before the launch, head graphed), old (admit before, head eager).
# The head: the eighth run's, carried as .gpu/head.tgz by a third call. On a fresh H100 the first profile_batch
# (GGUF conversion, every batch size warmed up three times) took over 150 s.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
cli=(python3 -m draftsmith.pipeline.cli)
echo "== waiting for the head $(date +%T)"
head_dir=$root/head/draft
for i in $(seq 180); do [ -f "$head_dir/model.safetensors" ] && break; sleep 5; done
before="from draftsmith.serve.scheduler import Scheduler; Scheduler.admit_after_launch = False; "
eager="from draftsmith.serve.graphs import GraphedPrefill; GraphedPrefill.read_head = lambda self, *a: self.head(*a); "
pre() { case $1 in new) echo "";; before) echo "$before";; old) echo "$before$eager";; esac; }
for v in new old gpu_tests before; do
  [ $v = gpu_tests ] && { echo "== gpu tests $(date +%T)"; timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k "scheduler" > "$o/gpu_tests.txt" 2>&1; tail -n 2 "$o/gpu_tests.txt"; continue; }
  echo "== decode8 $v $(date +%T)"
  timeout 300 python3 -c "$(pre $v)from draftsmith.pipeline.cli import main; main()" bench decode --device cuda --prompts 8 --new-tokens 256 --k 7 \
    --repeats 3 --batch 16 --draft "$head_dir" --cache-dir $root/cache > "$o/decode8_$v.txt" 2>&1
  grep "│" "$o/decode8_$v.txt" | cut -c1-130
done
for v in new old; do
  echo "== profile $v $(date +%T)"
  timeout 420 python3 -c "$(pre $v)import runpy, sys; sys.argv = ['profile_batch.py', '--draft', '$head_dir', '--cache-dir', '$root/cache', '--batch', '16', '--k', '7']; runpy.run_path('benchmarks/profile_batch.py', run_name='__main__')" > "$o/profile_$v.txt" 2>&1
  grep -v -i warn "$o/profile_$v.txt" | tail -n 6 | cut -c1-400
done
echo "== shapes $(date +%T)"  # issue 35 on an H200 only
[[ "$gpu" == *H200* ]] && timeout 360 "${cli[@]}" bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 --repeats 3 \
  --out "$o/shapes_8b.json" > "$o/shapes_8b.txt" 2>&1 && grep -v -i warn "$o/shapes_8b.txt" | tail -n 14
echo "== done $(date +%T)"
