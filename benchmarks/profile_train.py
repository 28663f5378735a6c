"""Distillation throughput, side by side: training tokens per second of a standalone draft with the target
online, for the trainer's settings (the loss over the whole batch at once or in chunks, padded or packed
rows, torch.compile), with the median and the spread over --repeats windows of timed steps.

    python3 benchmarks/profile_train.py [--cache-dir DIR] [--batch 128] [--steps 12] [--repeats 3] [--head]

The demo target (bf16) and a 4-layer draft built from it, as the gpu preset trains them (--head: an EAGLE-3
head as preset=eagle3_sweep trains it); the rows are
random tokens with the gpu preset's lengths (prompts of 30-90 tokens, responses of 60-256, mean ~160),
since throughput does not depend on what the tokens are. Each variant runs once: a fresh draft trains for
--warmup steps (compiling, where the variant compiles), then --repeats windows of --steps timed ones, each
window a measurement (a run a round compiled each time: ~3 minutes a round for a compiled head on an H100);
tokens are response tokens, as the distill stage counts them. The warm-up
steps make one pass over the rows and the timed steps repeat them, as the gpu preset's 6,000 steps make ~87
passes over the teacher data: with kept states (distill.target_states_gib) the timed steps run only the
target's LM head, which is the steady state of a run (its first pass runs the whole target). Beside each
window's rate it prints the graphs compiled and the device allocations made during it: one-time work that a
window's rate still holds (on an H200 a head's windows rose from 27k to 279k tokens/s within 18 steps).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import torch

VARIANTS = {  # name -> DistillConfig overrides
    "whole, padded": {"loss_chunk_size": 0, "pack_sequences": False, "target_states_gib": 0.0},
    "chunked, padded": {"loss_chunk_size": 4096, "pack_sequences": False, "target_states_gib": 0.0},
    "chunked, packed": {"loss_chunk_size": 4096, "pack_sequences": True, "target_states_gib": 0.0},
    "chunked, packed, compiled": {"loss_chunk_size": 4096, "pack_sequences": True, "compile": True, "target_states_gib": 0.0},
    "chunked, packed, kept states": {"loss_chunk_size": 4096, "pack_sequences": True, "target_states_gib": 8.0},
    "chunked, packed, kept states, compiled": {"loss_chunk_size": 4096, "pack_sequences": True, "compile": True, "target_states_gib": 8.0},
}
DEFAULT_VARIANTS = ["chunked, packed", "chunked, packed, kept states", "chunked, packed, kept states, compiled"]
HEAD_VARIANTS = {  # --head: an EAGLE-3 head (preset=eagle3_sweep's: one layer, 8,192 tokens, unrolled 7 steps), kept states
    "head, chunked": {"loss_chunk_size": 4096, "target_states_gib": 32.0},
    "head, whole loss": {"loss_chunk_size": 0, "target_states_gib": 32.0},
    "head, chunked, compiled": {"loss_chunk_size": 4096, "compile": True, "target_states_gib": 32.0},
    "head, whole loss, compiled": {"loss_chunk_size": 0, "compile": True, "target_states_gib": 32.0},
    # each group of 3 steps (the default --warmup) sorts one pass over the rows by length; compiled on CUDA, the
    # later steps attend through FlexAttention (1.22x the written-out attention on an H100, 2026-12-06)
    "head, chunked, compiled, length-grouped": {
        "loss_chunk_size": 4096,
        "compile": True,
        "target_states_gib": 32.0,
        "length_group_steps": 3,
    },
}
HEAD_STEPS, HEAD_VOCAB = 7, 8192


def synthetic_rows(n: int, vocab: int, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    lengths = lambda low, high: int(torch.randint(low, high + 1, (1,), generator=g))
    return [
        {
            "prompt_ids": torch.randint(3, vocab, (lengths(30, 90),), generator=g).tolist(),
            "response_ids": torch.randint(3, vocab, (lengths(60, 256),), generator=g).tolist(),
        }
        for _ in range(n)
    ]


def one_time_work(cpu: bool) -> tuple[int, int]:
    """(graphs compiled, device allocations made) so far in this process: the one-time work a step can hide."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], 0 if cpu else torch.cuda.memory_stats().get("num_device_alloc", 0)


def one_run(
    cfg, target_dir: Path, draft_dir: Path | None, rows: list[dict], warmup: int, work: Path, cpu: bool, on_step=None
) -> tuple[list[tuple[float, int, int]], float, float]:
    """(the warm-up's last step and each step after it: its training tokens/s and one_time_work() as it is read,
    peak GPU memory in GiB, seconds spent compiling) of a fresh draft and a freshly
    loaded target (distill.compile compiles the target's layers in place); draft_dir None: an EAGLE-3 head.
    on_step(): called as each step's rate is read (a profiler's schedule)."""
    from transformers import AutoModelForCausalLM

    from draftsmith.distill.train import Distiller, DraftObjective

    seen: list[tuple[int, float]] = []

    def log(step: int, metrics: dict) -> None:
        if "tokens_per_s" in metrics:
            seen.append((step, metrics["tokens_per_s"], *one_time_work(cpu)))
            if on_step is not None:
                on_step()

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32 if cpu else torch.bfloat16)
    if draft_dir is None:  # --head
        from draftsmith.distill import eagle

        aux = eagle.resolve_aux_layers([], target.config.num_hidden_layers)
        head, layer_config = eagle.build_head(target_dir, 1, aux, list(range(HEAD_VOCAB)), seed=0)
        objective = eagle.EagleObjective(cfg, aux, list(range(HEAD_VOCAB)), layer_config, {})
        chunk = eagle.loss_chunk(cfg.loss_chunk_size, target.config.vocab_size, HEAD_VOCAB)
        draft = eagle.UnrolledHead(head, target.get_input_embeddings(), HEAD_STEPS, 0.8, chunk=chunk)
    else:
        draft, objective = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32), DraftObjective(cfg, online=True)
    distiller = Distiller(cfg, draft, target, objective, rows, [], work, seed=0, cpu=cpu, log=log)
    if not cpu:
        torch.cuda.reset_peak_memory_stats()
    result = distiller.train()
    # from the warm-up's last step (one_time_work's baseline) on; the last step, read at once and timed from its own
    # start where the others are timed between reads, left out
    timed = [facts for step, *facts in seen if warmup <= step < cfg.max_steps]
    return timed, 0.0 if cpu else torch.cuda.max_memory_allocated() / 2**30, result["compile_seconds"]


def device_busy(events) -> tuple[float, float]:
    """(milliseconds the device ran kernels or copies, milliseconds from the first recorded event to the last) of a
    profile: the busy time is the union of the device's intervals, the profiler's own ranges (record_function's
    copies on the device's timeline) left out."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if e.time_range.end > e.time_range.start)
    device = sorted(
        (e.time_range.start, e.time_range.end)
        for e in events
        if e.device_type != torch.autograd.DeviceType.CPU and not getattr(e, "is_user_annotation", False)
    )
    busy, reached = 0.0, float("-inf")
    for begin, end in device:
        busy += max(0.0, end - max(begin, reached))
        reached = max(reached, end)
    return busy / 1e3, (max(end for _, end in spans) - spans[0][0]) / 1e3 if spans else 0.0


def profile(cfg, target_dir: Path, draft_dir: Path | None, rows: list[dict], warmup: int, work: Path, cpu: bool, trace: str | None) -> str:
    """Where the steady steps' time goes: a fresh run of `cfg` whose steps after the first `warmup` + 1 run under
    torch.profiler (compiling and the target's first pass over the rows fall in the warm-up). Returns the share of
    that time the device was busy, the trainer's phases (target forward, draft forward, chunked loss, backward,
    optimizer) and what they contain by GPU time, then the kernels by their own GPU time; trace: a Chrome trace
    of the profiled steps written there."""
    from torch.profiler import ProfilerActivity, schedule
    from torch.profiler import profile as torch_profile

    active = max(1, cfg.max_steps - warmup - 2)  # the last step is read at once, not as the next one runs
    activities = [ProfilerActivity.CPU] + ([] if cpu else [ProfilerActivity.CUDA])
    with torch_profile(activities=activities, schedule=schedule(wait=warmup, warmup=1, active=active)) as prof:
        one_run(cfg, target_dir, draft_dir, rows, 0, work, cpu, on_step=prof.step)  # a step's rate is read as the next one runs
    if trace:
        prof.export_chrome_trace(trace)
    averages = prof.key_averages()
    if cpu:
        return averages.table(sort_by="cpu_time_total", row_limit=25, max_name_column_width=60)
    busy, wall = device_busy(prof.events())
    tables = [averages.table(sort_by=key, row_limit=25, max_name_column_width=60) for key in ("cuda_time_total", "self_cuda_time_total")]
    return "\n".join(
        [
            *tables,
            f"{active} profiled steps after {warmup + 1}: the device busy {busy:,.0f} ms of {wall:,.0f} ms ({busy / max(wall, 1e-9):.0%})",
        ]
    )


def main() -> None:
    from draftsmith.distill.draft import build_from_target, every_nth_layer
    from draftsmith.pipeline.config import TargetConfig, composed
    from draftsmith.pipeline.target import resolve_target_dir
    from draftsmith.serve.weights import read_config

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cache-dir", default="~/.cache/draftsmith/targets")
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--profile",
        action="store_true",
        help="then one more run of the last variant, its later steps under torch.profiler: where a step's GPU time goes",
    )
    parser.add_argument("--trace", help="with --profile: write the profiled steps' Chrome trace (chrome://tracing, Perfetto) here")
    parser.add_argument("--device", default="cuda", help="cpu: a quick check of the script, not a measurement")
    parser.add_argument("--head", action="store_true", help=f"train an EAGLE-3 head instead (default variants: {'; '.join(HEAD_VARIANTS)})")
    parser.add_argument("--variant", action="append", choices=[*VARIANTS, *HEAD_VARIANTS], help=f"default: {'; '.join(DEFAULT_VARIANTS)}")
    args = parser.parse_args()

    target_dir = resolve_target_dir(TargetConfig(name_or_path="demo", cache_dir=args.cache_dir, gguf_file=None))
    cpu = args.device == "cpu"
    steps = args.warmup + args.steps * args.repeats + 1  # the last one untimed
    # compile off unless a variant turns it on (the gpu preset compiles)
    base = replace(composed("preset=gpu").distill, batch_size=args.batch, max_steps=steps, eval_every=10**9, compile=False)
    rows = synthetic_rows(args.batch * args.warmup, read_config(target_dir)["vocab_size"], seed=0)  # one pass in warm-up
    variants = HEAD_VARIANTS if args.head else VARIANTS
    names = args.variant or (list(HEAD_VARIANTS) if args.head else DEFAULT_VARIANTS)
    rates: dict[str, list[float]] = {name: [] for name in names}
    memory: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        layers = every_nth_layer(read_config(target_dir)["num_hidden_layers"], 4)
        draft_dir = None if args.head else build_from_target(target_dir, Path(tmp) / "draft", layers)
        for name in names:  # one run a variant (compiling once), its timed steps in --repeats windows of --steps
            started = time.time()
            cfg = replace(base, **variants[name])
            try:
                timed, memory[name], compiling = one_run(cfg, target_dir, draft_dir, rows, args.warmup, Path(tmp) / name, cpu)
            except Exception as error:  # a variant that fails here is reported, the others still run
                print(f"{name}: failed: {type(error).__name__}: {str(error)[:300]}", flush=True)
                continue
            windows = [timed[i : i + args.steps] for i in range(1, len(timed), args.steps)]
            rates[name] = [statistics.harmonic_mean([rate for rate, *_ in window]) for window in windows]
            # what each window compiled and allocated anew: one-time work inside the timing
            starts = [timed[0][1:]] + [window[-1][1:] for window in windows[:-1]]
            anew = [tuple(b - a for a, b in zip(start, window[-1][1:])) for start, window in zip(starts, windows)]
            print(
                f"{name}: {', '.join(f'{r:,.0f}' for r in rates[name])} tokens/s ({time.time() - started:.0f} s, "
                f"{compiling:.0f} s of it compiling); "
                f"(graphs compiled, device allocations) in each window: {anew}",
                flush=True,
            )
        if args.profile:
            cfg = replace(base, **variants[names[-1]])
            print(profile(cfg, target_dir, draft_dir, rows, args.warmup, Path(tmp) / "profiled", cpu, args.trace))
    baseline = statistics.median(rates[names[0]]) if rates[names[0]] else float("nan")
    print(
        f"\nbatch {args.batch} rows, {args.repeats} windows of {args.steps} timed steps after {args.warmup}; "
        f"{'CPU' if cpu else torch.cuda.get_device_name()}"
    )
    print(f"| variant | tokens/s (median) | spread | x {names[0]} | peak GiB |\n|---|---:|---|---:|---:|")
    for name in names:
        if rates[name]:
            median = statistics.median(rates[name])
            print(
                f"| {name} | {median:,.0f} | {min(rates[name]):,.0f}-{max(rates[name]):,.0f} | "
                f"{median / baseline:.2f} | {memory[name]:.1f} |"
            )


if __name__ == "__main__":
    main()
