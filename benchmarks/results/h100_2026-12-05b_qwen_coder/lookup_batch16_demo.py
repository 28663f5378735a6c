# prompt lookup at batch 16 on the demo target: plain, the old Python search, the vectorised one, side by side
import time
from pathlib import Path
import torch
from draftsmith.distill.data import heldout_messages
from draftsmith.evaluate.bench_decode import bench_batch, chat_prompts
from draftsmith.pipeline.target import convert_gguf, demo_gguf_path
from draftsmith.serve import proposers
from draftsmith.serve.engine import Engine, eos_ids_of
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.weights import load_model

def old_lookup(history, k, max_ngram, min_ngram):
    for n in range(min(max_ngram, len(history) - 1), min_ngram - 1, -1):
        suffix = list(history[-n:])
        for start in range(len(history) - n - 1, -1, -1):
            if list(history[start : start + n]) == suffix:
                follow = list(history[start + n : start + n + k])
                return follow + [follow[-1]] * (k - len(follow))
    return [history[-1]] * k

t0 = time.time()
t = convert_gguf(demo_gguf_path(), Path("/root/draftsmith-gpu/cache"))
prompts = chat_prompts(t, heldout_messages("demo", fraction=0.1)[:8])
target = load_model(t, torch.bfloat16, "cuda")
params = SamplingParams(max_new_tokens=128, ignore_eos=True)
msl = max(map(len, prompts)) + 128 + 16
new = proposers.lookup
for name, k, search in (("plain", 0, None), ("lookup, vectorised", 5, new), ("lookup, Python loop", 5, old_lookup), ("plain again", 0, None)):
    if search is not None:
        proposers.lookup = search
    e = Engine(target, None, max_batch_size=16, max_seq_len=msl, cuda_graphs=True, eos_token_ids=eos_ids_of(t))
    prop = proposers.PromptLookup(target.args.vocab_size) if k else None
    row, _ = bench_batch(e, name, prompts, params, k, k > 0, 64, 3, "cuda", prop)
    print(f"{name:22s} {row.tokens_per_s:9.1f} ({row.spread[0]:.1f}-{row.spread[1]:.1f}) ms/step {row.ms_per_target_step:.3f} tau {row.tau} [{time.time() - t0:.0f} s]", flush=True)
    del e
