"""Host cost of a step: a tiny random target on the CPU (device work ~nil), prompt lookup at batch 1 and 16, through
bench decode's run_bench. Run from the repository root as `PYTHONPATH=. .venv/bin/python <this file>`; for another
commit's code, put a directory whose draftsmith/ links that checkout's package folders first on PYTHONPATH
(2026-12-07: 7628161 against c53d245, two rounds each, RESULTS.md's fifteenth run). Prompts: the first 8 of
preset=qwen_coder's code prompts, each one's first 300 bytes as tokens (code repeats itself: the lookup finds some)."""

import json
from pathlib import Path

import torch

import draftsmith.serve.engine
from draftsmith.evaluate.bench_decode import run_bench
from tests.conftest import save_tiny_model

print("draftsmith from", draftsmith.serve.engine.__file__)
torch.set_num_threads(1)
target = Path("/tmp/tinyq")
if not (target / "config.json").exists():
    save_tiny_model(target, "qwen2", seed=0, vocab_size=256, num_layers=2)
lines = [json.loads(line) for line in open(Path("~/.cache/draftsmith/qwen_coder/code_prompts.jsonl").expanduser())][:8]
prompts = [list(r["prompt"].encode()[:300]) for r in lines]
rows = run_bench(target, [], prompts, new_tokens=128, ks=(5,), device="cpu", dtype="float32", repeats=3, batch=16, lookup=True)
for r in rows:
    print(f"{r.method:45s} steps {r.target_steps:5d} ms/step {r.ms_per_target_step:7.3f} tau {r.tau}")
