"""For the next GPU session (thirteenth run's follow-up): where do batch 16's tokens part from batch 1's with the prompt
forward compiled? parity.py found a prompt's prefill bitwise the same alone, in a pair and padded, so this records what
bench decode's own engines do: each prompt's prefill (its last logits and KV rows, and the bucket it replayed) as the
batch-1 engine and the batch-16 engine made it, and compares them; then the tokens. Equal prefills with parted tokens
put the cause in the decode steps.
usage: python engine_parity.py <target dir> <device> [prompts] [new tokens]"""

import sys
from collections import defaultdict
from pathlib import Path

import torch

from draftsmith.distill.data import heldout_messages
from draftsmith.evaluate.bench_decode import chat_prompts, run_bench
from draftsmith.serve.graphs import GraphedPrefill

target_dir, device = Path(sys.argv[1]), sys.argv[2]
n_prompts, new_tokens = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (8, 256)
records: dict[int, dict] = defaultdict(dict)  # the engine's max batch -> prompt -> (logits, KV, bucket)
call = GraphedPrefill.__call__


def recording(self, tokens, positions, lengths, cache_rows):
    last, hidden = call(self, tokens, positions, lengths, cache_rows)
    engine = self.model.max_batch_size
    for i in range(tokens.shape[0]):
        n, row = int(lengths[i]), int(cache_rows[i])
        prompt = tuple(tokens[i, :n].tolist())
        if prompt not in records[engine]:
            kv = torch.stack([torch.stack([c.k[row, :, :n], c.v[row, :, :n]]) for c in self.model.cache_state.caches])
            records[engine][prompt] = (last[i].float().cpu(), kv.float().cpu(), self.shape(*tokens.shape) or tuple(tokens.shape))
    return last, hidden


GraphedPrefill.__call__ = recording
prompts = chat_prompts(target_dir, heldout_messages("demo", fraction=0.1)[:n_prompts])
rows = run_bench(target_dir, [], prompts, new_tokens=new_tokens, ks=(1,), device=device, repeats=1, batch=16)
for row in rows:
    print(f"{row.method}: {row.tokens_per_s:.1f} tok/s, equal to plain: {row.matches_plain} ({row.differing} parted, from token {row.first_difference})")
print("| prompt | tokens | batch-1 bucket | batch-16 bucket | logits: max abs diff | KV: max abs diff (first layer > 0) |")
print("|---:|---:|---|---|---:|---:|")
for i, prompt in enumerate(records[1]):
    a, b = records[1][prompt], records[16].get(prompt)
    if b is None:
        print(f"| {i} | {len(prompt)} | {a[2]} | not admitted | | |")
        continue
    per_layer = (a[1] - b[1]).abs().flatten(1).amax(1).tolist()
    first = next((j for j, x in enumerate(per_layer) if x > 0), None)
    print(f"| {i} | {len(prompt)} | {a[2]} | {b[2]} | {(a[0] - b[0]).abs().max().item():.4g} | {max(per_layer):.4g} ({first}) |")
