"""The matrix-vector product of a plain decoding step at batch 1 on a GPU: one row of activations against a
weight matrix, read once.

At batch 1 a step's time is the time to read the weights. At the Llama-3.1-8B shape on an H100, cuBLAS's kernels
read them at 84% of the rated bandwidth and this kernel, tuned over its tiles, at 90% (benchmarks/gemv_probe.py,
benchmarks/RESULTS.md 2026-12-06). Each program holds BLOCK_N rows of the weight and walks the K columns BLOCK_K
at a time, keeping float32 partial sums per lane and reducing them once at the end. Only one row: over a
verification's 6 rows a version of it that multiplied each tile by every row took 3x cuBLAS's time, so those stay
with cuBLAS. Needs triton; its interpreter (TRITON_INTERPRET=1) runs it on CPU tensors in float32, which is how
the suite tests it.
"""

from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the model uses F.linear
    triton = None

Config = tuple[int, int, int, int]  # (block_n: weight rows a program reads, block_k, warps, stages)


def runs(x: Tensor, weight: Tensor) -> bool:
    """Whether gemv runs for activations x [..., K] against weight [N, K]: one row on a GPU, a weight laid out as
    stored, K a multiple of 16."""
    return (
        triton is not None
        and x.device.type == "cuda"
        and x.numel() == x.shape[-1]
        and x.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.is_contiguous()
        and weight.shape[1] % 16 == 0
    )


def default_config(k: int) -> Config:
    """The tiles that read the 8B shape's weights fastest (benchmarks/gemv_probe.py), block_k a divisor of k."""
    block_k = 1024
    while k % block_k:
        block_k //= 2
    return 4, block_k, 8, 3


def gemv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, config: Optional[Config] = None) -> Tensor:
    """F.linear(x, weight, bias) for one row x [..., K] and weight [N, K], summed in float32; returns [..., N] in x's
    dtype. config: the tiles (default_config's by default; block_k must divide K)."""
    N, K = weight.shape
    block_n, block_k, warps, stages = config or default_config(K)
    out = torch.empty(N, dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(N, block_n),)](
        x.contiguous(),
        weight,
        bias if bias is not None else weight,  # not read without HAS_BIAS
        out,
        N,
        K=K,
        HAS_BIAS=bias is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=warps,
        num_stages=stages,
    )
    return out.view(*x.shape[:-1], N)


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    return gemv(x, weight, bias)


if triton is not None:
    # an opaque op to torch.compile (the compiled blocks call it; inductor does not trace into triton here)
    op = torch.library.custom_op("draftsmith::gemv", _linear, mutates_args=())
    op.register_fake(lambda x, weight, bias=None: x.new_empty(*x.shape[:-1], weight.shape[0]))

    @triton.jit
    def _gemv(X, W, B, Y, N, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_read = tl.where(n < N, n, 0)  # a last partial block reads row 0 again and stores nothing for it
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            w = tl.load(W + n_read[:, None] * K + cols[None, :], eviction_policy="evict_first")
            acc += w.to(tl.float32) * tl.load(X + cols).to(tl.float32)[None, :]
        y = tl.sum(acc, axis=1)
        if HAS_BIAS:
            y += tl.load(B + n_read).to(tl.float32)
        tl.store(Y + n, y.to(Y.dtype.element_ty), mask=n < N)
