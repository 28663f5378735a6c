"""Matrix products for decode steps on a GPU: a few rows of activations (a plain step's one token a row at
batch 1, a verification's K + 1) against a weight matrix, read once.

At batch 1 a step's time is the time to read the weights. cuBLAS's kernels for these shapes read them at 84%
of an H100's rated bandwidth at the Llama-3.1-8B shape; this kernel, tuned over its tiles, at 90%
(benchmarks/gemv_probe.py, benchmarks/RESULTS.md 2026-12-06). Each program holds BLOCK_N rows of the weight
and walks the K columns BLOCK_K at a time, multiplying each tile by every activation row, with float32
partial sums per lane reduced once at the end. Needs triton; its interpreter (TRITON_INTERPRET=1) runs it on
CPU tensors in float32, which is how the suite tests it.
"""

from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the model uses F.linear
    triton = None

MAX_ROWS = 8  # activation rows a launch takes at most: a plain step at batch 1 and a verification of K <= 7
BLOCK_N = 4  # weight rows a program reads
TILE = 4096  # partial sums a program holds (rows x weight rows x BLOCK_K): the registers of 8 warps


def runs(x: Tensor, weight: Tensor) -> bool:
    """Whether gemv runs for activations x [..., K] against weight [N, K] on a GPU: at most MAX_ROWS rows, a
    weight laid out as stored, and K a multiple of 16."""
    rows = x.numel() // max(1, x.shape[-1])
    return (
        triton is not None
        and x.device.type == "cuda"
        and x.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and rows <= MAX_ROWS
        and weight.shape[1] % 16 == 0
        and weight.is_contiguous()
    )


def block_k(rows: int, k: int) -> int:
    """The columns a program reads an iteration: as many as TILE allows for `rows` (padded to a power of two) x
    BLOCK_N partial sums, and a divisor of k."""
    size = TILE // (triton.next_power_of_2(rows) * BLOCK_N)
    while k % size:
        size //= 2
    return size


def gemv(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """F.linear(x, weight, bias) for x [..., K] of at most MAX_ROWS rows and weight [N, K] (K a multiple of 16),
    accumulated in float32; returns [..., N] in x's dtype."""
    K = x.shape[-1]
    N = weight.shape[0]
    flat = x.reshape(-1, K).contiguous()
    M = flat.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(N, BLOCK_N),)](
        flat,
        weight,
        bias if bias is not None else weight,  # not read without HAS_BIAS
        out,
        N,
        K=K,
        M=M,
        M_PAD=triton.next_power_of_2(M),
        HAS_BIAS=bias is not None,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k(M, K),
        num_warps=8,
        num_stages=3,
    )
    return out.view(*x.shape[:-1], N)


if triton is not None:
    # an opaque op to torch.compile (the compiled blocks call it; inductor does not trace into triton here)
    op = torch.library.custom_op("draftsmith::gemv", gemv, mutates_args=())
    op.register_fake(lambda x, weight, bias=None: x.new_empty(*x.shape[:-1], weight.shape[0]))

    @triton.jit
    def _gemv(
        X,
        W,
        B,
        Y,
        N,
        K: tl.constexpr,
        M: tl.constexpr,
        M_PAD: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_read = tl.where(n < N, n, 0)  # a last partial block reads row 0 again and stores nothing for it
        m = tl.arange(0, M_PAD)
        m_read = tl.where(m < M, m, 0)
        acc = tl.zeros((M_PAD, BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            w = tl.load(W + n_read[:, None] * K + cols[None, :], eviction_policy="evict_first").to(tl.float32)
            x = tl.load(X + m_read[:, None] * K + cols[None, :]).to(tl.float32)
            acc += x[:, None, :] * w[None, :, :]
        y = tl.sum(acc, axis=2)  # [M_PAD, BLOCK_N]
        if HAS_BIAS:
            y += tl.load(B + n_read).to(tl.float32)[None, :]
        tl.store(Y + m[:, None] * N + n[None, :], y.to(Y.dtype.element_ty), mask=(m[:, None] < M) & (n[None, :] < N))
