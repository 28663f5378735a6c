"""The quantize stage's held-out comparison (distill/heldout.compare_drafts) at preset=qwen_coder's sizes, random
weights: a Qwen2.5-Coder-1.5B-shaped target and two 0.5B-shaped drafts (151,936 tokens), one batch of 128 rows of
100 prompt + 150 response tokens (~19k positions, as on 2026-12-05), made `chunk` positions at a time: peak memory."""

import time

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from draftsmith.distill.heldout import compare_drafts

common = dict(vocab_size=151936, tie_word_embeddings=True, rope_theta=1e6, max_position_embeddings=32768)
target_cfg = Qwen2Config(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2, **common)
draft_cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2, **common)


def make(cfg):
    with torch.device("cuda"):
        return Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()


models = make(target_cfg), [make(draft_cfg), make(draft_cfg)]
g = torch.Generator().manual_seed(0)
rows = [
    {"prompt_ids": torch.randint(0, 151936, (100,), generator=g).tolist(), "response_ids": torch.randint(0, 151936, (150,), generator=g).tolist()}
    for _ in range(128)
]
print("| chunk | peak GiB (weights included) | seconds | tokens | tvd |\n|---:|---:|---:|---:|---|")
for chunk in (4096, 0):
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    try:
        out = compare_drafts(*models, rows, 128, 384, "cuda", chunk)
        torch.cuda.synchronize()
        result = f"{out['tokens']} | {[round(t, 4) for t in out['tvd']]}"
    except torch.OutOfMemoryError as e:
        result = f"out of memory: {str(e)[:90]} |"
    print(f"| {chunk or 'whole'} | {torch.cuda.max_memory_allocated() / 2**30:.1f} | {time.perf_counter() - started:.1f} | {result} |", flush=True)
