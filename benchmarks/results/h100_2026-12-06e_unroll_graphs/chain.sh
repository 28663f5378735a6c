#!/usr/bin/env bash
# 2026-12-06 fifth run: one compiled graph for every later step of the head's unroll: its GPU test, then the head's
# pipeline (torch.compile's time by phase printed at exit), bench decode on its bundle (GEMV as shipped), bench shapes at 8B.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$o/gpu.txt"
echo "== test"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_eagle.py -k "compiled_unroll" 2>&1 | tail -4 | tee "$o/test.txt"
echo "== eagle"
timeout 600 python3 -c "
import atexit, torch._dynamo.utils as u
atexit.register(lambda: print(u.compile_times(repr='str', aggregate=False)))
from draftsmith.pipeline.cli import main; main()" run preset=eagle3_sweep tracking.enabled=false target.cache_dir=$root/cache \
  paths.root=$root/runs distill.max_steps=2000 distill.eval_every=500 stop_after=publish > "$o/eagle_full.txt" 2>&1
grep -v "^\s*$" "$o/eagle_full.txt" | tail -n 30
cp "$(ls -td $root/runs/distill/* | head -1)/stage.json" "$o/distill_stage.json" || true
cp "$(ls -td $root/runs/evaluate/* | head -1)"/eval.md "$o/" || true
echo "== decode"; timeout 500 bash benchmarks/h200_bench.sh decode 2>&1 | tail -n 30 | tee "$o/decode.txt"
echo "== scale"; ALPHA=0.679 timeout 400 bash benchmarks/h200_bench.sh scale llama-3.1-8b 2>&1 | tail -n 20 | tee "$o/scale.txt"
echo "== done"
