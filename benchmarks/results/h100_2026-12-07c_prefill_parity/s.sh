#!/usr/bin/env bash
# Thirteenth run (written 2026-12-07, thirty-fourth session). Why did batch 16's tokens part from batch 1's with the
# prompt forward compiled (twelfth run)? parity.py: one prompt's prefill (logits, KV rows, then 48 eager greedy tokens)
# in a batch-1 cache, alone in a batch-16 cache, beside a second prompt, and padded to two rows, eager and compiled,
# direct and through GraphedPrefill. (A first call found that sdpa inside an opaque custom op parts as much.) The
# working tree pads every prompt bucket to at least two rows, so one compile serves them all; bench decode new against
# old (eager prompt forward) side by side on the carried head, then the GPU tests.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
cli=(python3 -m draftsmith.pipeline.cli)
t0=$SECONDS
mkdir -p "$root/head" && tar -xf .gpu/head.tgz -C "$root/head" && head_dir=$root/head/draft
tdir=$(python3 -c "from pathlib import Path; from draftsmith.pipeline.target import convert_gguf, demo_gguf_path; print(convert_gguf(demo_gguf_path(), Path('$root/cache')))" 2>/dev/null | tail -1)
echo "target $tdir ready in $((SECONDS - t0)) s"
if [[ "$gpu" == *H200* && -z "${SKIP_SHAPES:-}" ]]; then
  echo "== shapes $(date +%T)"
  timeout 360 "${cli[@]}" bench shapes --shape llama-3.1-8b --batch 1 --k 4 --alpha 0.679 --repeats 3 \
    --out "$o/shapes_8b.json" > "$o/shapes_8b.txt" 2>&1; grep -v -i warn "$o/shapes_8b.txt" | tail -n 14
fi
echo "== parity $(date +%T)"; t=$SECONDS
timeout 420 python3 .gpu/q/parity.py "$tdir" cuda sdpa > "$o/parity.txt" 2>&1
grep "^|\|NVIDIA" "$o/parity.txt"; echo "parity: $((SECONDS - t)) s"
# the opaque attention's compiled rows: each equal to its own b1 row (logits, KV, tokens)
if grep "^| sdpa | .* | compiled |" "$o/parity.txt" | grep "padded\|pair\|graphed" | grep -qv "| 0, 0, None |"; then echo "padded rows part: bench anyway"; fi
old="from draftsmith.serve import model as m; c = m.Transformer.compile_blocks; m.Transformer.compile_blocks = lambda self: (c(self), setattr(self, 'fused_prompt_block', m._run_block))[0]; "
for v in new old; do
  echo "== decode8 $v $(date +%T)"; t=$SECONDS
  timeout 330 python3 -c "$([ $v = old ] && echo "$old")from draftsmith.pipeline.cli import main; main()" bench decode --device cuda --prompts 8 \
    --new-tokens 256 --k 7 --repeats 3 --batch 16 --draft "$head_dir" --cache-dir $root/cache > "$o/decode8_$v.txt" 2>&1
  grep "│" "$o/decode8_$v.txt" | cut -c1-130; echo "$v: $((SECONDS - t)) s"
done
echo "== gpu tests $(date +%T)"
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/test_cuda_graphs.py tests/test_model.py -k "graph or compiled or scheduler" > "$o/gpu_tests.txt" 2>&1
tail -n 3 "$o/gpu_tests.txt"
echo "== done $(date +%T)"
