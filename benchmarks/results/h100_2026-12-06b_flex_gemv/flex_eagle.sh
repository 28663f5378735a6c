#!/usr/bin/env bash
# issue 38 (24th session): the distill stage with the later steps through FlexAttention (now the compiled CUDA path):
# the demo head's recipe end to end, its tokens/s over the stage against last session's 148k (chat, H100).
r=/root/draftsmith-gpu; O=$r/out; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader > $O/gpu.txt
echo "$(date +%T) eagle"
OUT=$O LIMIT=720 bash benchmarks/h200_bench.sh eagle > $O/eagle.log 2>&1; tail -12 $O/eagle.log
rm -rf $O/bundle
echo "$(date +%T) done"
