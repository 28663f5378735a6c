#!/usr/bin/env bash
# issue 38, next session: the compiled-unroll GPU test (the two-part unroll of b5c3022 has not run on a GPU), the head
# trainer's speed, then the head recipe on AlpacaEval (general chat) through publish. Runs in $ROOT/snapshot via `bg`.
r=/root/draftsmith-gpu; O=$r/out; mkdir -p $O
nvidia-smi --query-gpu=name --format=csv,noheader > $O/gpu.txt
echo "$(date +%T) tests"
python3 -m pytest -q -p no:cacheprovider tests/test_eagle.py -k "compiled or window" > $O/tests.log 2>&1; tail -3 $O/tests.log
echo "$(date +%T) train"
TORCH_LOGS=recompiles python3 benchmarks/profile_train.py --cache-dir $r/cache --head --repeats 5 --steps 8 \
  --variant "head, chunked, compiled" --variant "head, chunked, compiled, length-grouped" > $O/train.log 2>&1; tail -6 $O/train.log
echo "$(date +%T) chat"
OUT=$O LIMIT=1300 CHAT=.gpu/alpaca_eval.jsonl bash benchmarks/h200_bench.sh eagle_chat > $O/chat.log 2>&1; tail -5 $O/chat.log
echo "$(date +%T) done"
