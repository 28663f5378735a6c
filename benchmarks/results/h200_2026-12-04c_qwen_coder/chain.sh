#!/usr/bin/env bash
# issue 35: preset=qwen_coder's three drafts of Qwen2.5-Coder-1.5B on one H200 (STEPS steps each), then one
# bench decode run on the three shipped drafts (held-out HumanEval prompts). Runs in the background.
r=/root/draftsmith-gpu
cd "$(dirname "$0")/../.."
source .gpu/prelude.sh >/dev/null 2>&1
assets=$HOME/.cache/draftsmith/qwen_coder; mkdir -p $assets $r/outq
join() {  # $1 from its pieces in $r/qwen_coder, once all are there (the sha256 says so)
  f=$assets/$1; [ -f $f ] && return 0
  cat $r/qwen_coder/$1.part[0-9][0-9] > $f.tmp 2>/dev/null
  if [ "$(sha256sum $f.tmp | cut -c1-64)" = "$(cut -c1-64 $r/qwen_coder/$1.sha256)" ]; then mv $f.tmp $f; echo "$(date +%T) joined $1"; return 0; fi
  rm -f $f.tmp; return 1
}
join humaneval.jsonl; join qwen2.5-coder-1.5b-instruct-q4_k_m.gguf || { echo "1.5B pieces missing"; exit 1; }
(until join qwen2.5-coder-0.5b-instruct-q4_k_m.gguf; do sleep 10; done) &
echo "$(date +%T) run"
timeout ${LIMIT:-1500} python3 -m draftsmith.pipeline.cli run -m preset=qwen_coder tracking.enabled=false target.cache_dir=$r/cache \
  paths.root=$r/runs distill.max_steps=${STEPS:-500} distill.eval_every=250 > $r/q.log 2>&1
echo "$(date +%T) run done"; touch $r/q.done
drafts=$(python3 -c "
import json, glob, os
for f in sorted(glob.glob('$r/runs/hydra/multirun/*/*/result.json')):
    out = json.load(open(f))['outputs']
    q = out.get('quantize', '') + '/draft'
    if 'distill' in out: print('--draft', q if os.path.isfile(q + '/config.json') else out['distill'] + '/draft')")
echo "bench decode $drafts"
python3 -m draftsmith.pipeline.cli bench decode --device cuda --target $assets/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf \
  --data $assets/humaneval.jsonl --eval-fraction 0.2 --prompts 8 --new-tokens 192 --batch 16 --k 3 --k 6 --repeats 3 \
  $drafts --cache-dir $r/cache --out $r/outq/bench_decode.json > $r/qdecode.log 2>&1
echo "$(date +%T) decode done"; touch $r/qdecode.done
