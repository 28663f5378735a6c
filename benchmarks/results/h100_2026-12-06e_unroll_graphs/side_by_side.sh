#!/usr/bin/env bash
# 2026-12-06 fifth run, side by side on one machine (the one chain.sh had just run on): the head trainer's steady rate
# with one compiled graph for every later step (commit f980c43) and with one graph of all later steps (9548fd8's
# serve/eagle.py and distill/eagle.py, carried in .gpu/q/old/). Output: side_by_side.txt
set -uo pipefail
root=/root/draftsmith-gpu
o=${OUT:-/tmp/out}
nvidia-smi --query-gpu=name --format=csv,noheader
for v in one_step_graph all_steps_graph; do
  if [ $v = all_steps_graph ]; then cp .gpu/q/old/serve_eagle.py serve/eagle.py; cp .gpu/q/old/distill_eagle.py distill/eagle.py; fi
  echo "== $v"
  timeout 230 python3 benchmarks/profile_train.py --cache-dir $root/cache --head --variant "head, chunked, compiled, length-grouped" \
    --repeats 3 --steps 6 2>&1 | grep -v -i warn | tail -n 7 | tee "$o/train_$v.txt"
done
