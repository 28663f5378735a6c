#!/usr/bin/env bash
# 2026-12-06 fourth run: the one-kernel GEMV's GPU tests, tiles and speed; bench shapes at 8B with it on; the head's
# pipeline with torch.compile's time by phase; bench decode with the kernel on.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 

echo "== gemv"; timeout 900 bash benchmarks/h200_bench.sh gemv 2>&1 | grep -vi warn | tee "$o/gemv.txt"
echo "== scale (GEMV=1)"; GEMV=1 ALPHA=0.679 timeout 400 bash benchmarks/h200_bench.sh scale llama-3.1-8b 2>&1 | tail -n 20 | tee "$o/scale_gemv.txt"
echo "== eagle"
timeout 600 python3 -c "
import atexit, torch._dynamo.utils as u
atexit.register(lambda: print(u.compile_times(repr='str', aggregate=False)))
from draftsmith.pipeline.cli import main; main()" run preset=eagle3_sweep tracking.enabled=false target.cache_dir=$root/cache \
  paths.root=$root/runs distill.max_steps=2000 distill.eval_every=500 stop_after=publish > "$o/eagle_full.txt" 2>&1
grep -v "^\s*$" "$o/eagle_full.txt" | tail -n 60
for s in distill; do cp "$(ls -td $root/runs/$s/* | head -1)/stage.json" "$o/${s}_stage.json" || true; done
cp "$(ls -td $root/runs/evaluate/* | head -1)"/eval.md "$o/" || true
echo "== decode (GEMV=1)"; GEMV=1 timeout 500 bash benchmarks/h200_bench.sh decode 2>&1 | tail -n 30 | tee "$o/decode_gemv.txt"
echo "== done"
