#!/usr/bin/env bash
# Thirteenth run, last call: parity.py with each prefill's effect on the cache's other rows (filled with noise first)
root=/root/draftsmith-gpu
tdir=$(python3 -c "from pathlib import Path; from draftsmith.pipeline.target import convert_gguf, demo_gguf_path; print(convert_gguf(demo_gguf_path(), Path('$root/cache')))" 2>/dev/null | tail -1)
timeout 200 python3 .gpu/q/parity.py "$tdir" cuda sdpa 2>&1 | grep -v -i warn | tee $OUT/parity_rows.txt | grep -v "^|---"
