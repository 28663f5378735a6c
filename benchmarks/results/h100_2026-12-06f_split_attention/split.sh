#!/usr/bin/env bash
# 2026-12-06 sixth run: the later steps' attention split (FlexAttention over step 0's keys + each entry's own keys
# written out, merged by log-sum-exp; ../h100_2026-12-06e_unroll_graphs/split_attention_on_9548fd8.patch on main): its GPU test, then profile_train side by side with the
# shipped attention (main's serve/eagle.py, .gpu/q/old/), then, if the split is faster, the head's pipeline with it.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$o/gpu.txt"
echo "== test"
timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_eagle.py -k "compiled_unroll or flex_window" 2>&1 | tail -4 | tee "$o/test.txt"
grep -q " passed" "$o/test.txt" && ! grep -q "failed" "$o/test.txt" || { echo "== test did not pass"; exit 1; }
rate() { grep -E "^\| head" "$1" | awk -F'|' '{gsub(/[ ,]/, "", $3); print $3}'; }
train() {
  echo "== $1"
  timeout 260 python3 benchmarks/profile_train.py --cache-dir $root/cache --head --variant "head, chunked, compiled, length-grouped" \
    --repeats 3 --steps 6 2>&1 | grep -v -i warn | tail -n 7 | tee "$o/train_$1.txt"
}
train split
cp .gpu/q/old/serve_eagle.py serve/eagle.py
train shipped
cp .gpu/q/old/split_serve_eagle.py serve/eagle.py
s=$(rate "$o/train_split.txt"); m=$(rate "$o/train_shipped.txt")
echo "split $s shipped $m"
if [ -n "$s" ] && [ -n "$m" ] && [ "$s" -gt "$m" ]; then
  echo "== eagle (split)"
  timeout 600 python3 -c "
import atexit, torch._dynamo.utils as u
atexit.register(lambda: print(u.compile_times(repr='str', aggregate=False)))
from draftsmith.pipeline.cli import main; main()" run preset=eagle3_sweep tracking.enabled=false target.cache_dir=$root/cache \
    paths.root=$root/runs distill.max_steps=2000 distill.eval_every=500 stop_after=publish > "$o/eagle_full.txt" 2>&1
  grep -v "^\s*$" "$o/eagle_full.txt" | tail -n 30
  cp "$(ls -td $root/runs/distill/* | head -1)/stage.json" "$o/distill_stage.json" || true
  cp "$(ls -td $root/runs/evaluate/* | head -1)"/eval.md "$o/" || true
fi
echo "== done"
