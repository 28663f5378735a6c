#!/usr/bin/env bash
# this session's rest: the from-target draft as a job of its own, then bench decode on what exists, prompt lookup too
R=/root/draftsmith-gpu; A=$HOME/.cache/draftsmith/qwen_coder; O=$R/out; mkdir -p $O
cli=(python3 -m draftsmith.pipeline.cli)
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True timeout 330 "${cli[@]}" run preset=qwen_coder draft=from_target tracking.enabled=false \
  target.cache_dir=$R/cache paths.root=$R/runs stop_after=quantize distill.max_steps=300 distill.eval_every=150 > $O/from_target.log 2>&1
nvidia-smi --query-gpu=memory.used --format=csv >> $O/from_target.log
head=$(python3 -c "import json,glob; print(json.load(open(sorted(glob.glob('$R/runs/hydra/multirun/*/*/0/result.json'))[-1]))['outputs']['distill'])")/draft
drafts=(--draft $head)
ft=$(ls -td $R/runs/quantize/*/draft 2>/dev/null | while read d; do [ -f $d/config.json ] && echo $d && break; done)
[ -n "$ft" ] && drafts+=(--draft $ft)
echo "drafts: ${drafts[*]}" > $O/bench.log
"${cli[@]}" bench decode --device cuda --target $A/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf --data $A/code_prompts.jsonl \
  --eval-fraction 0.2 --prompts 8 --new-tokens 128 --batch 16 --k 3 --k 5 --repeats 3 "${drafts[@]}" --lookup --cache-dir $R/cache \
  --out $O/bench_decode_qwen_coder.json >> $O/bench.log 2>&1
touch $R/q2.done
