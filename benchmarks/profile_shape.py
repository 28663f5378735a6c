"""Where a plain decoding step and a verification forward go at a target's shape, without its weights (random
weights on the GPU, evaluate/bench_shapes.py): CUDA-event times of a whole plain step (one graph replay) and of
the target's compiled forward over 1..6 tokens, against the weights-over-bandwidth floor, and the heaviest
kernels of each.

    python3 benchmarks/profile_shape.py [--shape llama-3.1-8b] [--batch 1] [--bandwidth 4800] [--variants [NAME ...]]
        [--repeats 1]

--variants times the plain step and a verification over 6 tokens instead, under settings that may move them:
torch's attention instead of the runtime's kernel, inductor's GEMM autotuning for the compiled blocks, and cuBLAS
instead of the runtime's own kernel for one sequence's products (serve/gemv.py) (all of them, or those named), in
turns, --repeats rounds: the medians and ranges.
"""

from __future__ import annotations

import argparse

import torch
from profile_step import top_kernels  # beside this script

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


def graph_ms(run) -> float:
    """run() captured as one CUDA graph (after a first, eager call: kernels built, allocations settled), replayed:
    cuda_ms of a replay."""
    run()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    return cuda_ms(graph.replay)


def gemv_ms(target) -> float:
    """The model's matrix products alone at one token (each layer's and the LM head), replayed from one CUDA
    graph: what cuBLAS's kernels cost for these weights, apart from everything else in a step."""
    import torch.nn.functional as F

    weights = [m.weight for m in target.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {w.shape[1]: torch.randn(1, w.shape[1], device="cuda", dtype=w.dtype) for w in weights}
    return graph_ms(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights])


def step_and_verify_ms(shape: str, batch: int) -> tuple[float, float]:
    """(A whole plain step, one graph replay; the target's graphed forward over 6 tokens a row), in ms."""
    target = build(SHAPES[shape], torch.bfloat16, "cuda")
    engine = Engine(target, None, max_batch_size=batch, max_seq_len=512)
    zeros = torch.zeros(batch, dtype=torch.long, device="cuda")
    state = DecodeState(lengths=torch.full((batch,), 128, device="cuda"), pending=zeros, previous=zeros.clone())
    active = torch.zeros(batch, dtype=torch.bool, device="cuda")
    tokens = torch.zeros(batch, 6, dtype=torch.long, device="cuda")
    positions = (torch.arange(6, device="cuda") + 128).expand(batch, 6)
    with torch.inference_mode():
        return cuda_ms(lambda: engine.step_graphs(state, active, 0)), cuda_ms(lambda: engine.target_forward(tokens, positions))


SETTINGS = {
    "default": {},  # as the runtime ships (its attention kernel, serve/gemv.py for large weights); the others change that
    "torch attention": {"attention": False},
    "GEMM autotuning": {"autotune": True},
    "cuBLAS": {"gemv": False},
}


def variants(shape: str, batch: int, floor: float, names: list[str], repeats: int) -> None:
    """The whole plain step's and a 6-token verification's time under each setting, each on a fresh engine and
    compilation, the settings in turns for `repeats` rounds; then each one's medians and ranges."""
    import statistics

    import torch._dynamo
    import torch._inductor.config as inductor

    from draftsmith.serve import model

    shipped = {"attention": model.USE_DECODE_ATTENTION, "gemv": model.USE_GEMV, "autotune": inductor.max_autotune_gemm}
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in names}
    print(f"\n{shape}, batch {batch}: the whole plain step and a 6-token verification by setting (floor {floor:.3f} ms)")
    for turn in range(repeats):
        for name in names:
            torch._dynamo.reset()
            setting = {**shipped, **SETTINGS[name]}
            model.USE_DECODE_ATTENTION, model.USE_GEMV = setting["attention"], setting["gemv"]
            inductor.max_autotune_gemm = setting["autotune"]
            times[name].append(step_and_verify_ms(shape, batch))
            torch.cuda.empty_cache()
            print(f"round {turn + 1} {name}: {times[name][-1][0]:.3f} / {times[name][-1][1]:.3f} ms", flush=True)
    print("| setting | plain step, ms (range) | x floor | verify 6 tokens, ms (range) | x step |\n|---|---:|---:|---:|---:|")
    for name, runs in times.items():
        step, verify = (statistics.median(t[i] for t in runs) for i in (0, 1))
        spread = lambda i: f"{min(t[i] for t in runs):.3f}-{max(t[i] for t in runs):.3f}"
        print(f"| {name} | {step:.3f} ({spread(0)}) | {step / floor:.2f} | {verify:.3f} ({spread(1)}) | {verify / step:.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--bandwidth", type=float, default=4800.0, help="GB/s")
    parser.add_argument(
        "--variants", nargs="*", choices=list(SETTINGS), help="time the plain step and a verification under each setting (or these) instead"
    )
    parser.add_argument("--repeats", type=int, default=1, help="with --variants: rounds of the settings in turns")
    args = parser.parse_args()
    target = build(SHAPES[args.shape], torch.bfloat16, "cuda")
    floor = bandwidth_floor_ms(target, args.bandwidth)
    if args.variants is not None:
        del target
        return variants(args.shape, args.batch, floor, args.variants or list(SETTINGS), args.repeats)
    engine = Engine(target, None, max_batch_size=args.batch, max_seq_len=512)
    zeros = torch.zeros(args.batch, dtype=torch.long, device="cuda")
    state = DecodeState(lengths=torch.full((args.batch,), 128, device="cuda"), pending=zeros, previous=zeros.clone())
    active = torch.zeros(args.batch, dtype=torch.bool, device="cuda")
    with torch.inference_mode():
        step = lambda: engine.step_graphs(state, active, 0)
        rows = [("whole plain step (graph)", 1, cuda_ms(step)), ("matrix products alone", 1, gemv_ms(target))]
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
    one = rows[2][2]
    for what, t, ms in rows:
        print(f"{what:<28} {t:>6} {ms:>8.3f} {ms / floor:>8.2f} {ms / one:>9.2f}")


if __name__ == "__main__":
    main()
