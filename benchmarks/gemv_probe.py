"""How fast a batch-1 step's products can read a target's weights on this GPU: cuBLAS (what F.linear runs) against
the runtime's own Triton kernel (serve/gemv.py) at each of its tile sizes, and both against a device-to-device
copy of the same bytes, for every weight shape of a target shape (random bf16 weights, every layer's own copy, so
that the L2 cache holds none of them), each shape's products replayed from one CUDA graph; over one row of
activations (a plain step) or several (--rows 6: a verification of 5 drafted tokens). Last, the tiles that read all
of the shape's weights fastest together.

    python3 benchmarks/gemv_probe.py [--shape llama-3.1-8b] [--rows 1] [--quick]

Issue 35 asks for a plain Llama-3.1-8B step of at most 3.9 ms on an H200; on 2026-12-03 the step's 129 products
alone took 3.906 ms through cuBLAS there (3.84 TB/s) while a copy moved 4.28 TB/s. This says whether a kernel of
our own can close that gap, and how far the copy's rate is from the step's goal.
"""

from __future__ import annotations

import argparse
import itertools

import torch
import torch.nn.functional as F
from profile_shape import graph_ms  # beside this script

from draftsmith.evaluate.bench_shapes import SHAPES
from draftsmith.serve.gemv import fit, gemv


def configs(quick: bool) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k, warps, stages) to try (the weight tile in bf16, the sums [16, block_n])."""
    grid = itertools.product((16, 32, 64), (128, 256, 512), (4,) if quick else (4, 8), (3, 4))
    return [c for c in grid if c[0] * c[1] <= 16384]


def weight_shapes(shape: str) -> dict[tuple[int, int], int]:
    """(out, in) -> how many matrices of it a step reads: the runtime's fused q/k/v and gate/up, its output and
    down projections, and the LM head."""
    c = SHAPES[shape]
    hidden, layers, head_dim = c["hidden_size"], c["num_hidden_layers"], c["hidden_size"] // c["num_attention_heads"]
    kv = c["num_key_value_heads"] * head_dim
    return {
        (hidden + 2 * kv, hidden): layers,
        (hidden, hidden): layers,
        (2 * c["intermediate_size"], hidden): layers,
        (hidden, c["intermediate_size"]): layers,
        (c["vocab_size"], hidden): 1,
    }


def probe(shape: str, quick: bool, activations: int) -> tuple[list[tuple], dict]:
    """A row of the table for each weight shape, and each tile configuration's milliseconds by shape."""
    rows, by_config = [], {}
    for (n, k), count in weight_shapes(shape).items():
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(count)]
        x = torch.randn(activations, k, device="cuda", dtype=torch.bfloat16)
        ys = [torch.empty(activations, n, device="cuda", dtype=torch.bfloat16) for _ in weights]
        reference = F.linear(x, weights[0])
        gb = count * n * k * 2 / 1e9
        cublas = graph_ms(lambda: [F.linear(x, w, out=y) for w, y in zip(weights, ys)])
        copies = [torch.empty_like(w) for w in weights[: max(1, count // 4)]]
        copy = graph_ms(lambda: [c.copy_(w) for c, w in zip(copies, weights)]) * count / len(copies) / 2  # read + write
        best = (float("inf"), None)
        for config in configs(quick):
            tiles = fit(config, k)  # as the runtime fits its default to k
            y = gemv(x, weights[0], None, tiles)
            if not torch.allclose(y.float(), reference.float(), rtol=2e-2, atol=2e-1):
                raise AssertionError(f"{config} at {n}x{k}: {(y.float() - reference.float()).abs().max()}")
            ms = graph_ms(lambda c=tiles: [gemv(x, w, None, c) for w in weights])
            best = min(best, (ms, tiles))
            by_config.setdefault(config, {})[n, k] = ms
        rows.append((f"{n}x{k} x{count}", gb, cublas, best[0], best[1], copy))
    return rows, by_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(SHAPES))
    parser.add_argument("--rows", type=int, default=1, help="activation rows (1: a plain step; K + 1: a verification)")
    parser.add_argument("--quick", action="store_true", help="4 warps only")
    args = parser.parse_args()
    rows, by_config = probe(args.shape, args.quick, args.rows)
    print(f"\n{args.shape}, {args.rows} row(s), {torch.cuda.get_device_name()}: TB/s (ms) of one graph of each shape's products")
    print("| weights | GB | cuBLAS | Triton (block_n, block_k, warps, stages) | copy ((read + write) / s) |")
    print("|---|---:|---:|---:|---:|")
    for name, gb, cublas, triton_ms, config, copy in rows:
        print(
            f"| {name} | {gb:.2f} | {gb / cublas:.2f} ({cublas:.3f}) | {gb / triton_ms:.2f} ({triton_ms:.3f}) {config} | {gb / copy:.2f} |"
        )
    gb = sum(r[1] for r in rows)
    total = [sum(r[i] for r in rows) for i in (2, 3, 5)]
    print(
        f"| all | {gb:.2f} | {gb / total[0]:.2f} ({total[0]:.3f}) | {gb / total[1]:.2f} ({total[1]:.3f}) | {gb / total[2]:.2f} ({total[2]:.3f}) |"
    )
    whole = {c: sum(ms.values()) for c, ms in by_config.items()}
    config = min(whole, key=whole.get)
    print(f"one configuration for every shape (block_k fitted to each): {config}, {gb / whole[config]:.2f} TB/s ({whole[config]:.3f} ms)")


if __name__ == "__main__":
    main()
