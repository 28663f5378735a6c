#!/usr/bin/env bash
# 2026-12-06 eighth run. Issue 35: the Llama-3.1-8B shape with the GEMV kernel on an H200 (bench shapes, verify 5 tokens,
# projected at the 1.5B head's alpha 0.679). Issue 38: the head's pipeline as shipped (fresh machine), then bench decode on
# all 115 held-out prompts (K 5 and 7, batch 16), then profile_batch on the head at batch 16 (where its time goes).
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
cli=(python3 -m draftsmith.pipeline.cli)
newest() { ls -td $1 2>/dev/null | head -1; }
echo "== shapes $(date +%T)"
case "$gpu" in *H200*) ;; *) echo "not an H200: shapes skipped";; esac; [[ "$gpu" == *H200* ]] && timeout 360 "${cli[@]}" bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 --repeats 3 \
  --out "$o/shapes_8b.json" > "$o/shapes_8b.txt" 2>&1
grep -v -i warn "$o/shapes_8b.txt" | tail -n 14
echo "== shipped $(date +%T)"
timeout 900 "${cli[@]}" run preset=eagle3_sweep tracking.enabled=false target.cache_dir=$root/cache paths.root=$root/runs \
  distill.max_steps=2000 distill.eval_every=500 stop_after=publish > "$o/shipped.log" 2>&1
grep -v "^\s*$" "$o/shipped.log" | tail -n 12
mkdir -p "$o/stages"
for s in teacher distill evaluate publish; do cp "$(newest "$root/runs/$s/*")/stage.json" "$o/stages/$s.json" 2>/dev/null; done
cp "$(newest "$root/runs/evaluate/*")/eval.md" "$o/stages/eval.md" 2>/dev/null
bundle="$(newest "$root/runs/publish/*")/bundle"
head_dir="$(newest "$root/runs/distill/*")/draft"
tar -C "$bundle/.." -czf "$o/stages/bundle.tgz" bundle 2>/dev/null
(cd "$o" && tar -czf stages.tgz stages && rm -rf stages)
# batch 16 side by side: the first tokens of joining requests read before the next launch (as at 10d164e) and after
old=(python3 -c "from draftsmith.serve.scheduler import Scheduler as S; a = S._admit; S._admit = lambda self: (a(self), self._emit_first())[0]; from draftsmith.pipeline.cli import main; main()")
for v in new old; do
  echo "== decode8 $v $(date +%T)"
  run=("${cli[@]}"); [ $v = old ] && run=("${old[@]}")
  timeout 300 "${run[@]}" bench decode --device cuda --prompts 8 --new-tokens 256 --k 7 --repeats 3 --batch 16 \
    --draft "$head_dir" --cache-dir $root/cache > "$o/decode8_$v.txt" 2>&1
  grep -E "plain|adaptive|K=7" "$o/decode8_$v.txt" | tail -n 4
  cat "$o/decode8_$v.txt" >> "$o/decode8.txt"; rm "$o/decode8_$v.txt"
done
echo "== decode115 $(date +%T)"
timeout 600 "${cli[@]}" bench decode --device cuda --prompts 115 --new-tokens 256 --k 5 --k 7 --repeats 3 --batch 16 \
  --draft "$head_dir" --cache-dir $root/cache --out "$o/decode115.json" > "$o/decode115.txt" 2>&1
grep -v -i warn "$o/decode115.txt" | tail -n 12
echo "== profile_batch $(date +%T)"
timeout 240 python3 benchmarks/profile_batch.py --draft "$head_dir" --cache-dir $root/cache --batch 16 --k 7 > "$o/profile_batch.txt" 2>&1
grep -v -i warn "$o/profile_batch.txt" | tail -n 30
echo "== done $(date +%T)"
