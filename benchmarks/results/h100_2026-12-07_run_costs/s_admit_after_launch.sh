#!/usr/bin/env bash
# 2026-12-07 tenth run (as run, on commit afa152e): admissions after the launch (Scheduler.admit_after_launch) against before it, side by side:
# profile_batch (device spans of steps and prefills, one timed run each) then bench decode at batch 16 on 8 prompts,
# medians of 3. The head: the eighth run's, carried as .gpu/head.tgz by a third call.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
cli=(python3 -m draftsmith.pipeline.cli)
echo "== gpu tests $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py -k "scheduler" > "$o/gpu_tests.txt" 2>&1; tail -n 2 "$o/gpu_tests.txt"
echo "== waiting for the head $(date +%T)"
head_dir=$root/head/draft
for i in $(seq 180); do [ -f "$head_dir/model.safetensors" ] && break; sleep 5; done
before="from draftsmith.serve.scheduler import Scheduler; Scheduler.admit_after_launch = False"
for v in after before; do
  echo "== profile $v $(date +%T)"
  pre=""; [ $v = before ] && pre="$before; "
  timeout 150 python3 -c "${pre}import runpy, sys; sys.argv = ['profile_batch.py', '--draft', '$head_dir', '--cache-dir', '$root/cache', '--batch', '16', '--k', '7']; runpy.run_path('benchmarks/profile_batch.py', run_name='__main__')" > "$o/profile_$v.txt" 2>&1
  grep -v -i warn "$o/profile_$v.txt" | tail -n 6 | cut -c1-400
done
for v in after before; do
  echo "== decode8 $v $(date +%T)"
  pre=""; [ $v = before ] && pre="$before; "
  timeout 240 python3 -c "${pre}from draftsmith.pipeline.cli import main; main()" bench decode --device cuda --prompts 8 --new-tokens 256 --k 7 \
    --repeats 3 --batch 16 --draft "$head_dir" --cache-dir $root/cache > "$o/decode8_$v.txt" 2>&1
  grep "│" "$o/decode8_$v.txt" | cut -c1-130
done
echo "== done $(date +%T)"
