"""Where a plain decoding step and a verification forward go at a target's shape, without its weights (random
weights on the GPU, evaluate/bench_shapes.py): CUDA-event times of a whole plain step (one graph replay) and of
the target's compiled forward over 1..6 tokens, against the weights-over-bandwidth floor, and the heaviest
kernels of each.

    python3 benchmarks/profile_shape.py [--shape llama-3.1-8b] [--batch 1] [--bandwidth 4800]
"""

from __future__ import annotations

import argparse

import torch

from draftsmith.evaluate.bench_shapes import SHAPES, bandwidth_floor_ms, build
from draftsmith.serve.engine import Engine
from draftsmith.serve.speculative import DecodeState


def cuda_ms(run, repeats: int = 100) -> float:
    for _ in range(3):
        run()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        run()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def top_kernels(run, rows: int = 15) -> str:
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            run()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=80)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s")
    args = parser.parse_args()
    target = build(SHAPES[args.shape], torch.bfloat16, "cuda")
    floor = bandwidth_floor_ms(target, args.bandwidth)
    engine = Engine(target, None, max_batch_size=args.batch, max_seq_len=512)
    zeros = torch.zeros(args.batch, dtype=torch.long, device="cuda")
    state = DecodeState(lengths=torch.full((args.batch,), 128, device="cuda"), pending=zeros, previous=zeros.clone())
    active = torch.zeros(args.batch, dtype=torch.bool, device="cuda")
    with torch.inference_mode():
        step = lambda: engine.step_graphs(state, active, 0)
        rows = [("whole plain step (graph)", 1, cuda_ms(step))]
        for t in range(1, 7):
            tokens = torch.zeros(args.batch, t, dtype=torch.long, device="cuda")
            positions = (torch.arange(t, device="cuda") + 128).expand(args.batch, t)
            rows.append(("target forward (graphed)", t, cuda_ms(lambda: engine.target_forward(tokens, positions))))
        print(f"\nkernels of a whole plain step, {args.shape}, batch {args.batch}, 10 steps:")
        print(top_kernels(step))
        tokens = torch.zeros(args.batch, 6, dtype=torch.long, device="cuda")
        positions = (torch.arange(6, device="cuda") + 128).expand(args.batch, 6)
        print(f"\nkernels of the target's forward over 6 tokens a row, batch {args.batch}, 10 forwards:")
        print(top_kernels(lambda: engine.target_forward(tokens, positions)))
    print(f"\n{args.shape}, batch {args.batch}: weights-over-bandwidth floor {floor:.3f} ms ({args.bandwidth:.0f} GB/s)")
    print(f"{'what':<28} {'tokens':>6} {'ms':>8} {'x floor':>8} {'x 1 token':>9}")
    one = rows[1][2]
    for what, t, ms in rows:
        print(f"{what:<28} {t:>6} {ms:>8.3f} {ms / floor:>8.2f} {ms / one:>9.2f}")


if __name__ == "__main__":
    main()
