"""Acceptance of a draft model, of prompt lookup, and of the draft with lookup first (serve.proposers.LookupFirst), on
held-out prompts of a domain, with the speedup each would give at batch 1 at step costs measured on a GPU.

    .venv/bin/python benchmarks/lookup_first_acceptance.py [--prompts 24] [--new-tokens 128] [--out FILE]

Defaults: the qwen_coder preset's files (benchmarks/qwen_coder_assets.py): Qwen2.5-Coder-1.5B-Instruct as the
target, its 0.5B sibling as the draft (pretrained, not distilled), the held-out fifth of the code prompts; the step
costs of the H200 run of 2026-12-04 (benchmarks/RESULTS.md: plain 1.962 ms, a verify step ~2.10 ms, a sibling draft
step 1.16 ms; a lookup step adds the host's search and sync, ~0.6 ms on the H100). Acceptance is exact at T = 0
(evaluate/acceptance.py) and runs on a CPU: the target's 24 greedy continuations took 28 minutes on 2 cores.
LookupFirst's choice is per row and step, as computed here; where every row takes the lookup's drafts, the draft
does not run (at batch 1, every step the lookup drafts).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from transformers import AutoTokenizer

from draftsmith.distill.data import heldout_messages
from draftsmith.evaluate.acceptance import acceptance, matched_lengths, reach, references, replay
from draftsmith.pipeline.target import convert_gguf
from draftsmith.serve.engine import Engine
from draftsmith.serve.protocol import chat_token_ids
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

CACHE = Path("~/.cache/draftsmith").expanduser()
KS = (1, 2, 3, 4, 5, 7)


def speed(accepts, drafted_by_lookup, refs, k: int, costs: dict[str, float]) -> tuple[float, float]:
    """(tau, speedup over plain) of the steps the engine takes at K, each drafted by lookup where
    drafted_by_lookup[m] (its cost: a verify step and the host's search) and by the draft elsewhere."""
    tokens = ms = steps = 0.0
    for (draft, lookup), chosen, ref in zip(accepts, drafted_by_lookup, refs):
        chosen = np.asarray(chosen)
        mixed = np.where(chosen[:, None], lookup, draft)
        s, accepted, _ = replay(mixed, ref.end, k)
        step_ms = costs["verify"] + np.where(chosen, costs["lookup"], k * costs["draft_step"])
        steps, tokens = steps + s, tokens + s + accepted
        ms += reach(mixed, ref.end, k)[1 : ref.end + 1] @ step_ms[1 : ref.end + 1]
    return tokens / steps, tokens / ms * costs["plain"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    qwen = CACHE / "qwen_coder"
    parser.add_argument("--target", type=Path, default=qwen / "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf")
    parser.add_argument("--draft", type=Path, default=qwen / "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf")
    parser.add_argument("--data", default=str(qwen / "code_prompts.jsonl"))
    parser.add_argument("--eval-fraction", type=float, default=0.2)
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--costs", default='{"plain": 1.962, "verify": 2.10, "draft_step": 1.16, "lookup": 0.6}', help="ms, JSON")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    costs, k_max = json.loads(args.costs), max(KS)
    dirs = [convert_gguf(p, CACHE) if p.suffix == ".gguf" else p for p in (args.target, args.draft)]
    tokenizer = AutoTokenizer.from_pretrained(dirs[0])
    chats = heldout_messages(args.data, fraction=args.eval_fraction, seed=0)
    chats = [chats[i] for i in np.random.default_rng(0).permutation(len(chats))[: args.prompts]]
    prompts = [chat_token_ids(tokenizer, m) for m in chats]
    target, draft = (load_model(d, torch.float32) for d in dirs)
    engine = Engine(target, max_batch_size=4, max_seq_len=max(map(len, prompts)) + args.new_tokens + k_max + 8)
    started = time.perf_counter()
    params = SamplingParams(max_new_tokens=args.new_tokens)
    refs = references(engine, prompts, params, k_max)
    accept = acceptance(target, {"draft": draft, "lookup": None}, refs, params, k_max, batch_size=2)
    seconds = time.perf_counter() - started
    pairs = list(zip(accept["draft"], accept["lookup"]))
    matched = [matched_lengths(r) for r in refs]
    policies = {"draft": lambda n: False, "lookup": lambda n: True} | {
        f"draft, lookup first {t}": (lambda n, t=t: n >= t) for t in (1, 2, 3)
    }
    results = {}
    for name, use_lookup in policies.items():
        chosen = [[use_lookup(n) for n in row] for row in matched]
        results[name] = {k: speed(pairs, chosen, refs, k, costs) for k in KS}
    print(f"{len(prompts)} held-out prompts x {args.new_tokens} tokens, T = 0 ({seconds:.0f} s); tau / predicted x plain at batch 1")
    print("policy".ljust(24) + "".join(f"K={k}".rjust(14) for k in KS))
    for name, row in results.items():
        print(name.ljust(24) + "".join(f"{tau:6.2f} / {x:4.2f}x".rjust(14) for tau, x in row.values()))
    if args.out:
        payload = {"args": {k: str(v) for k, v in vars(args).items()}, "costs_ms": costs, "seconds": seconds, "results": results}
        args.out.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
