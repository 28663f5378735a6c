"""Where continuous batching's time goes on a GPU: whole-step graph costs at the batch size by K, then
`4 x batch` greedy requests (the held-out demo prompts, cycled) through the scheduler, plain, at fixed
K and with adaptive K, with the host time spent launching steps, handing out tokens (waiting for the
device included) and admitting requests, the K chosen, the device's own time in steps (by K) and in
prefills (CUDA events around each) and the rest of the run's wall time (the device idle, waiting for the
host, or copying admitted rows into the batch), and a cProfile of the adaptive run's host side.

    python3 benchmarks/profile_batch.py --draft BUNDLE/draft [--cache-dir DIR] [--batch 16] [--k 5]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
from collections import Counter
from pathlib import Path

import torch

from draftsmith.distill.data import heldout_messages
from draftsmith.evaluate.bench_decode import chat_prompts
from draftsmith.pipeline.config import TargetConfig
from draftsmith.pipeline.target import resolve_target_dir
from draftsmith.serve.engine import Engine, load_draft
from draftsmith.serve.sampling import SamplingParams
from draftsmith.serve.scheduler import Request, Scheduler
from draftsmith.serve.weights import load_model


def timed_phases(scheduler: Scheduler) -> dict[str, float]:
    """Wrap the scheduler's launch, hand-out, admission and prefill to add up their wall time (seconds), and
    count the prefills (each admits the requests that join at one step)."""
    spent = Counter()
    for name in ("_launch", "_hand_out", "_admit", "_prefill"):
        inner = getattr(scheduler, name)

        def wrapped(*args, inner=inner, name=name):
            started = time.perf_counter()
            try:
                return inner(*args)
            finally:
                spent[name] += time.perf_counter() - started
                spent[name + " calls"] += 1

        setattr(scheduler, name, wrapped)
    return spent


def device_spans(engine: Engine) -> dict[str, list]:
    """Wrap the engine's step launch and prefill to record CUDA events around the work each enqueues: pairs
    of events by "K=<k>" and "prefill" (read them after the device is done: `ms`)."""
    spans: dict[str, list] = {}
    for name, key in (("launch", lambda args: f"K={args[2]}"), ("prefill", lambda args: "prefill")):
        inner = getattr(engine, name)

        def wrapped(*args, inner=inner, key=key, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = inner(*args, **kwargs)
            end.record()
            spans.setdefault(key(args), []).append((start, end))
            return out

        setattr(engine, name, wrapped)
    return spans


def ms(spans: dict[str, list]) -> dict[str, tuple[int, float]]:
    """Each key's count and milliseconds in all (after torch.cuda.synchronize)."""
    return {key: (len(pairs), sum(a.elapsed_time(b) for a, b in pairs)) for key, pairs in sorted(spans.items())}


def run(scheduler: Scheduler, prompts: list[list[int]], requests: int, new_tokens: int) -> tuple[float, Counter, int]:
    ks = Counter()
    scheduler.on_step = lambda k, accepted: ks.update([k])
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(requests):
        scheduler.submit(Request(prompts[i % len(prompts)], params))
    scheduler.drain()
    torch.cuda.synchronize()
    return time.perf_counter() - started, ks, requests * new_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--draft", type=Path, required=True)
    parser.add_argument("--cache-dir", default="~/.cache/draftsmith")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--k", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=256)
    args = parser.parse_args()
    target_dir = resolve_target_dir(TargetConfig(name_or_path="demo", cache_dir=args.cache_dir, gguf_file=None))
    prompts = chat_prompts(target_dir, heldout_messages()[:8])
    target = load_model(target_dir, torch.bfloat16, "cuda")
    draft = load_draft(args.draft, torch.bfloat16, "cuda")
    max_seq_len = max(map(len, prompts)) + args.new_tokens + args.k + 8
    lines = []
    for label, d, k, adaptive in (
        ("plain", None, 0, False),
        (f"K={min(3, args.k)}", draft, min(3, args.k), False),
        (f"adaptive K<={args.k}", draft, args.k, True),
    ):
        engine = Engine(target, d, max_batch_size=args.batch, max_seq_len=max_seq_len)
        scheduler = Scheduler(engine, k, adaptive=adaptive)
        scheduler.warm_up(full=False)  # every batch size a run's end meets, so that none is timed in the run
        costs = {kk: round(t, 3) for (b, kk), t in scheduler.costs.step_ms.items() if b == args.batch}
        run(scheduler, prompts, 4 * args.batch, args.new_tokens)  # warm-up: prefill shapes
        spent = timed_phases(scheduler)
        spans = device_spans(engine)
        seconds, ks, tokens = run(scheduler, prompts, 4 * args.batch, args.new_tokens)
        steps = sum(ks.values())
        device = ms(spans)
        busy = sum(total for _, total in device.values())
        by_key = "  ".join(f"{key} {n} x {total / n:.3f}" for key, (n, total) in device.items())
        lines.append(
            f"{label:<16} device ms: {by_key}; busy {busy:.1f} of {1000 * seconds:.1f} wall, "
            f"the rest (idle or copying rows in) {1000 * seconds - busy:.1f}"
        )
        lines.append(
            f"{label:<16} {tokens / seconds:>9.1f} tok/s  {steps:>5} steps  {1000 * seconds / steps:6.3f} ms/step  "
            f"launch {1000 * spent['_launch'] / steps:.3f}  hand-out {1000 * spent['_hand_out'] / steps:.3f}  "
            f"admit {1000 * spent['_admit']:.1f} ms total ({spent['_prefill calls']} prefills)  K {dict(sorted(ks.items()))}  graph ms by K {costs}"
        )
        if adaptive:
            profiler = cProfile.Profile()
            profiler.enable()
            run(scheduler, prompts, 4 * args.batch, args.new_tokens)
            profiler.disable()
            text = io.StringIO()
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(18)
            print(text.getvalue()[-4000:])
    print("\n".join(lines))


if __name__ == "__main__":
    main()
