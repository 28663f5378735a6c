#!/usr/bin/env bash
# The GPU measurements of the README's Benchmarks section, on the offline GPU machine, in three calls
# of under 10 minutes each (after `source .gpu/prelude.sh`, see ../shared/gpu/README.md):
#   bash evaluate/h200_bench.sh pipeline   demo target -> distilled W4A16 draft -> bundle (gates overridden)
#   bash evaluate/h200_bench.sh decode     bench decode: batch 1 and 16, side by side, greedy
#   bash evaluate/h200_bench.sh serve      the GPU tests, then draftsmith serve on the bundle + bench serve
# Results go to $OUT (the device tool brings them back).
set -euo pipefail
root=/root/draftsmith-gpu
out=${OUT:-/tmp/out}
mkdir -p "$out"
cli=(python3 -m draftsmith.pipeline.cli)
newest() { ls -td $1 2>/dev/null | head -1; }
get() { python3 -c "import sys, urllib.request; sys.stdout.write(urllib.request.urlopen('http://127.0.0.1:8011$1').read().decode())"; }

case "${1:?pipeline, decode or serve}" in
pipeline)
  # evaluate at batch 4 on 16 held-out prompts: enough to choose K for the bundle, quick on one GPU
  "${cli[@]}" run preset=gpu tracking.enabled=false target.cache_dir=$root/cache paths.root=$root/runs \
    distill.eval_every=1000 evaluate.num_prompts=16 evaluate.batch_size=4 evaluate.max_new_tokens=96 \
    evaluate.max_speculative_tokens=4 publish.override_gates=true stop_after=publish 2>&1 | tail -40
  cp "$(newest "$root/runs/quantize/*")/stage.json" "$out/quantize_stage.json" || true
  cp "$(newest "$root/runs/evaluate/*")"/{stage.json,eval.md} "$out/" || true
  ;;
decode)
  "${cli[@]}" bench decode --device cuda --assisted --prompts 4 --new-tokens 256 --batch 16 --k 2 --k 3 --k 4 \
    --draft "$(newest "$root/runs/quantize/*")/draft" --cache-dir $root/cache --out "$out/bench_decode.json"
  ;;
serve)
  bundle=$(newest "$root/runs/publish/*")/bundle
  "${cli[@]}" serve "$bundle" --device cuda --port 8011 > "$out/serve.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py 2>&1 | tail -5
  for _ in $(seq 600); do
    get /ready >/dev/null 2>&1 && break
    kill -0 $server 2>/dev/null || { tail -20 "$out/serve.log"; exit 1; }
    sleep 1
  done
  "${cli[@]}" bench serve --url http://127.0.0.1:8011 --concurrency 1 --concurrency 4 --concurrency 16 \
    --concurrency 64 --duration 20 --out "$out/bench_serve.json"
  get /metrics | grep -E '^draftsmith.spec_decode' | head -20 || true
  ;;
esac
