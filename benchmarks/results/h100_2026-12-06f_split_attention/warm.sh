#!/usr/bin/env bash
# 2026-12-06 sixth run: the head's pipeline as shipped (main 188411b), on the machine that had just compiled the head's
# graphs in profile_train (its inductor cache warm): the distill stage's rate with compiling mostly cached.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
timeout 520 python3 -c "
import atexit, torch._dynamo.utils as u
atexit.register(lambda: print(u.compile_times(repr='str', aggregate=False)))
from draftsmith.pipeline.cli import main; main()" run preset=eagle3_sweep tracking.enabled=false target.cache_dir=$root/cache \
  paths.root=$root/runs distill.max_steps=2000 distill.eval_every=500 stop_after=evaluate > "$o/eagle_warm.txt" 2>&1
grep -v "^\s*$" "$o/eagle_warm.txt" | tail -n 12
cp "$(ls -td $root/runs/distill/* | head -1)/stage.json" "$o/distill_stage_warm.json" || true
cp "$(ls -td $root/runs/evaluate/* | head -1)"/eval.md "$o/eval_warm.md" || true
echo "== done"
