"""What the cache's size costs the target's graphed, compiled forward: milliseconds per forward over 1,
4 and 8 tokens per row (a plain step, a K=3 and a K=7 verification) at batch 1 and 16, with caches of
320 slots (bench decode's 256 new tokens) and 2,056 (a server's 2,048-token context), all filled, for each way of
attending: torch's fused kernel and the runtime's triton kernel (serve/decode_attention.py). Needs a GPU.

    python3 benchmarks/profile_attention.py [--cache-dir DIR] [--choices fused kernel]
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.evaluate.cost import time_forward
from draftsmith.pipeline.config import TargetConfig
from draftsmith.pipeline.target import resolve_target_dir
from draftsmith.serve import model
from draftsmith.serve.engine import Engine
from draftsmith.serve.weights import load_model

CHOICES = {"fused": False, "kernel": True}  # name: the triton kernel?


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--cache-dir", default="~/.cache/draftsmith")
    parser.add_argument("--choices", nargs="+", choices=list(CHOICES), default=list(CHOICES))
    args = parser.parse_args()
    target_dir = resolve_target_dir(TargetConfig(name_or_path="demo", cache_dir=args.cache_dir, gguf_file=None))
    target = load_model(target_dir, torch.bfloat16, "cuda")
    rows = []
    for name in args.choices:
        model.USE_DECODE_ATTENTION = CHOICES[name]
        torch._dynamo.reset()  # the compiled blocks read the choice when they compile
        for slots in (320, 2056):
            engine = Engine(target, max_batch_size=16, max_seq_len=slots)
            # queries at the cache's end: the triton kernel reads every slot, as for a row of the cache's length
            rows += [
                (name, slots, b, t, time_forward(engine.target_forward, b, t, engine.device, repeats=30, start=slots - t))
                for b in (1, 16)
                for t in (1, 4, 8)
            ]
            del engine
    model.USE_DECODE_ATTENTION = True
    print(f"\n{'attention':<10} {'slots':>6} {'batch':>6} {'tokens':>7} {'ms':>8}")
    for name, slots, b, t, ms in rows:
        print(f"{name:<10} {slots:>6} {b:>6} {t:>7} {ms:>8.3f}")


if __name__ == "__main__":
    main()
