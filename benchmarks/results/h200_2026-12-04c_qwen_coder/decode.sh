#!/usr/bin/env bash
# one bench decode run on the three shipped drafts of preset=qwen_coder (held-out HumanEval prompts)
r=/root/draftsmith-gpu
cd "$(dirname "$0")/../.."
source .gpu/prelude.sh >/dev/null 2>&1
assets=$HOME/.cache/draftsmith/qwen_coder
drafts=$(python3 -c "
import json, glob, os
for f in sorted(glob.glob('$r/runs/hydra/multirun/*/*/result.json')):
    out = json.load(open(f))['outputs']
    q = out.get('quantize', '') + '/draft'
    if 'distill' in out: print('--draft', q if os.path.isfile(q + '/config.json') else out['distill'] + '/draft')")
echo "bench decode $drafts"
python3 -m draftsmith.pipeline.cli bench decode --device cuda --target $assets/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
  --data $assets/humaneval.jsonl --eval-fraction 0.2 --prompts 6 --new-tokens 128 --batch 16 --k 3 --k 5 --repeats 3 \
  $drafts --cache-dir $r/cache --out $r/outq/bench_decode.json > $r/qdecode.log 2>&1
echo "$(date +%T) decode done"; touch $r/qdecode.done
