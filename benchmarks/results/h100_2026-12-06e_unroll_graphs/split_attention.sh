#!/usr/bin/env bash
# 2026-12-06 fifth run: the later steps' attention split (FlexAttention over step 0's keys + the own keys written out,
# merged by log-sum-exp). Its GPU test and profile_train with one compiled graph a later step (this commit), then
# profile_train with one graph of all later steps and the same attention (.gpu/q/alt/).
# Ran with the loop cut to one_step_graph (sed on the device, to fit the device time left); the call ran out of
# device time during the test, which printed nothing: the split attention has no GPU result. .gpu/q/alt/ held
# 9548fd8's files with the split attention: split_attention_on_9548fd8.patch
set -uo pipefail
root=/root/draftsmith-gpu
o=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$o/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_eagle.py -k "compiled_unroll" 2>&1 | tail -2 | tee "$o/test.txt"
for v in one_step_graph all_steps_graph; do
  if [ $v = all_steps_graph ]; then cp .gpu/q/alt/serve_eagle.py serve/eagle.py; cp .gpu/q/alt/distill_eagle.py distill/eagle.py; fi
  echo "== $v"
  timeout 200 python3 benchmarks/profile_train.py --cache-dir $root/cache --head --variant "head, chunked, compiled, length-grouped" \
    --repeats 3 --steps 4 2>&1 | grep -v -i warn | tail -n 6 | tee "$o/train_$v.txt"
done
