#!/usr/bin/env bash
# issue 38, next session (written 2026-12-06, 23rd session): FlexAttention for the later steps' attention (b-commit
# "flex_window_attention"), never yet run on a GPU. 1) the GPU tests, the flex one among them; 2) side by side:
# written-out vs flex attention, same run; 3) a steady-step profile of whichever is last, with a Chrome trace.
# A CPU probe (2026-12-06) compiled the flex path (no grad, dynamic shapes): the first shape matched, the second
# recompiled on a guard from create_block_mask (keys past one 128-block) and inductor's C++ codegen failed; the
# GPU (Triton) path is untested, and profile_train's flex variant meets many shapes, so it will tell.
# Runs in $ROOT/snapshot via `bash benchmarks/h200_bench.sh bg .gpu/q/next.sh`.
r=/root/draftsmith-gpu; O=$r/out; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader > $O/gpu.txt
echo "$(date +%T) tests"
python3 -m pytest -q -p no:cacheprovider tests/test_eagle.py -k "compiled or window or flex" > $O/tests.log 2>&1; tail -3 $O/tests.log
echo "$(date +%T) gemv"
python3 benchmarks/gemv_probe.py > $O/gemv.log 2>&1; tail -9 $O/gemv.log
echo "$(date +%T) train"
python3 benchmarks/profile_train.py --cache-dir $r/cache --head --repeats 3 --steps 6 \
  --variant "head, chunked, compiled, length-grouped" --variant "head, chunked, compiled, length-grouped, flex" \
  --profile --trace $O/trace.json > $O/train.log 2>&1; grep -v "Loading\|Convert\|Writing" $O/train.log | tail -8
gzip -f $O/trace.json 2>/dev/null; ls -la $O
echo "$(date +%T) done"
