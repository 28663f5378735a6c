#!/usr/bin/env bash
# Twelfth run (written 2026-12-07, thirty-third session): the target's prompt forward compiled once for every shape
# (Transformer.fused_prompt_block) against the eager one (old), side by side: bench decode at batch 16 on 8 prompts,
# medians of 3; the GPU tests; the whole held-out split on the new code (issue 38); profile_batch on the new code; on an
# H200 the Llama-3.1-8B shape (issue 35). No head was carried this time and start-up refusals left too little device
# time for the shipped recipe (~7.5 min): a short one (4 answers a prompt, 600 steps) trains it, through distill.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
cli=(python3 -m draftsmith.pipeline.cli)
newest() { ls -td $1 2>/dev/null | head -1; }
t0=$SECONDS
if [ -f .gpu/head.tgz ]; then  # a carried head (trained elsewhere): no training here
  mkdir -p "$root/head" && tar -xf .gpu/head.tgz -C "$root/head" && head_dir=$root/head/draft
  python3 -c "from pathlib import Path; from draftsmith.pipeline.target import convert_gguf, demo_gguf_path; convert_gguf(demo_gguf_path(), Path('$root/cache'))" >/dev/null 2>&1
else
echo "== head $(date +%T)"
timeout 560 "${cli[@]}" run preset=eagle3_sweep tracking.enabled=false target.cache_dir=$root/cache paths.root=$root/runs \
  distill.max_steps=600 distill.eval_every=600 distill.teacher.extra_samples=3 stop_after=distill > "$o/head.txt" 2>&1
grep -E "stage [a-z]+: " "$o/head.txt" | tail -5
for s in teacher distill; do cp "$(newest "$root/runs/$s/*")/stage.json" "$o/${s}_stage.json" 2>/dev/null; done
head_dir=$(newest "$root/runs/distill/*")/draft
(cd "$head_dir/.." && tar -czf "$o/head.tgz" draft) && ls -la "$o/head.tgz"
fi
echo "head ready in $((SECONDS - t0)) s"
old="from draftsmith.serve import model as m; c = m.Transformer.compile_blocks; m.Transformer.compile_blocks = lambda self: (c(self), setattr(self, 'fused_prompt_block', m._run_block))[0]; "
for v in new old; do
  echo "== decode8 $v $(date +%T)"; t=$SECONDS
  timeout 330 python3 -c "$([ $v = old ] && echo "$old")from draftsmith.pipeline.cli import main; main()" bench decode --device cuda --prompts 8 \
    --new-tokens 256 --k 7 --repeats 3 --batch 16 --draft "$head_dir" --cache-dir $root/cache > "$o/decode8_$v.txt" 2>&1
  grep "│" "$o/decode8_$v.txt" | cut -c1-130; echo "$v: $((SECONDS - t)) s"
done
echo "== gpu tests $(date +%T)"
timeout 300 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_model.py -k "graph or compiled or scheduler" > "$o/gpu_tests.txt" 2>&1
tail -n 3 "$o/gpu_tests.txt"
echo "== profile new $(date +%T)"
timeout 300 python3 benchmarks/profile_batch.py --draft "$head_dir" --cache-dir $root/cache --batch 16 --k 7 > "$o/profile_new.txt" 2>&1
grep -v -i warn "$o/profile_new.txt" | tail -n 6 | cut -c1-400
echo "== decode115 $(date +%T)"
timeout 420 "${cli[@]}" bench decode --device cuda --prompts 115 --new-tokens 256 --k 7 --repeats 3 --batch 16 \
  --draft "$head_dir" --cache-dir $root/cache > "$o/decode115.txt" 2>&1
grep "│" "$o/decode115.txt" | cut -c1-130
echo "== shapes $(date +%T)"  # issue 35 on an H200 only
[[ "$gpu" == *H200* ]] && timeout 360 "${cli[@]}" bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 --repeats 3 \
  --out "$o/shapes_8b.json" > "$o/shapes_8b.txt" 2>&1 && grep -v -i warn "$o/shapes_8b.txt" | tail -n 14
echo "== done $(date +%T)"
