#!/usr/bin/env bash
# 2026-12-06 seventh run (issue 38). On an H200: the head's pipeline as shipped through publish, bench decode on its
# bundle (EOS ignored), the same recipe on the chat domain, bench decode ended at EOS at batch 1, then distill.length_group_steps=3.
# On an H100: the shipped pipeline and length_group_steps=3 side by side (through evaluate), then bench decode.
set -uo pipefail
root=${ROOT:-/root/draftsmith-gpu}
o=${OUT:-/tmp/out}
mkdir -p "$o"
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu" | tee "$o/gpu.txt"
cli=(python3 -m draftsmith.pipeline.cli)
newest() { ls -td $1 2>/dev/null | head -1; }
head_run() {  # name overrides...: preset=eagle3_sweep's head, 2,000 steps; its stages' files as $o/<name>_*
  local name=$1; shift
  echo "== $name $(date +%T)"
  timeout 900 "${cli[@]}" run preset=eagle3_sweep tracking.enabled=false target.cache_dir=$root/cache paths.root=$root/runs \
    distill.max_steps=2000 distill.eval_every=500 "$@" > "$o/$name.log" 2>&1
  grep -v "^\s*$" "$o/$name.log" | tail -n 16
  for s in teacher distill evaluate publish; do cp "$(newest "$root/runs/$s/*")/stage.json" "$o/${name}_$s.json" 2>/dev/null; done
  cp "$(newest "$root/runs/evaluate/*")/eval.md" "$o/${name}_eval.md" 2>/dev/null
  echo "$(newest "$root/runs/distill/*")/draft" > "$root/$name.draft"
}
decode() {  # name extra-args...: bench decode on the shipped head, held-out demo prompts, K 3/5/7, medians of 3
  echo "== decode $1 $(date +%T)"
  timeout 420 "${cli[@]}" bench decode --device cuda --prompts 8 --new-tokens 256 --k 3 --k 5 --k 7 --repeats 3 \
    --draft "$(cat $root/shipped.draft)" --cache-dir $root/cache --out "$o/bench_decode_$1.json" "${@:2}" > "$o/bench_decode_$1.txt" 2>&1
  grep -v -i warn "$o/bench_decode_$1.txt" | tail -n 14
}
case "$gpu" in
  *H200*)
    head_run shipped stop_after=publish
    decode eos_ignored --batch 16
    head_run chat data.path="$(realpath .gpu/q/alpaca_eval.jsonl)" stop_after=publish
    decode eos_stop --batch 0 --stop-at-eos
    head_run grouped3 distill.length_group_steps=3 stop_after=evaluate
    ;;
  *)
    head_run shipped stop_after=evaluate
    head_run grouped3 distill.length_group_steps=3 stop_after=evaluate
    decode eos_stop --batch 0 --stop-at-eos
    ;;
esac
echo "== done $(date +%T)"
