"""The products of one sequence's decoding step on a GPU: a few rows of activations (one for a plain step at batch 1,
K + 1 for a verification) against a weight matrix, read once.

At batch 1 a step's time is the time to read the weights. Each program of the kernel holds BLOCK_N rows of the
weight and 16 rows of activations (the rows padded with zeros), walks the K columns BLOCK_K at a time and multiplies
each weight tile by all 16 on the tensor cores. Every row's sums are made the same way whatever the number of rows,
so a plain step's token and the same token verified among K + 1 come out bit for bit the same: a greedy
verification keeps exactly what plain decoding would have chosen. Mixing kernels broke that: on 2026-12-06 (H100,
bf16, the demo target) a one-row kernel for plain steps beside cuBLAS or this kernel for verifications gave greedy
output that parted from plain decoding's in 7 of 8 prompts (benchmarks/RESULTS.md). A batch of several sequences
stays with cuBLAS (F.linear), as before, and so do weights under MIN_WEIGHT elements.

Needs triton; its interpreter (TRITON_INTERPRET=1) runs it on CPU tensors in float32, which is how the suite tests it.
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

MAX_ROWS = 64  # one sequence's tokens the kernel takes: a verification of up to 63 drafted tokens
CONFIG: Config = (64, 256, 4, 4)  # the tiles that read the 8B shape's weights fastest at 6 rows (gemv_probe.py, H100)
MIN_WEIGHT = 8 << 20  # elements: smaller weights stay with cuBLAS (the demo target's layers: a step 3.5% slower, H100)


def runs(x: Tensor, weight: Tensor) -> bool:
    """Whether gemv runs for activations x [1, T, K] against weight [N, K]: one sequence of at most MAX_ROWS tokens
    on a GPU, a weight laid out as stored, K a multiple of 16, of at least MIN_WEIGHT elements (the rule is the
    weight's, not the rows', so a plain step and a verification run the same kernel on it)."""
    return (
        triton is not None
        and x.device.type == "cuda"
        and x.dim() == 3
        and x.shape[0] == 1
        and x.shape[1] <= MAX_ROWS
        and x.dtype == weight.dtype
        and weight.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and weight.is_contiguous()
        and weight.shape[1] % 16 == 0
        and weight.numel() >= MIN_WEIGHT
    )


def fit(config: Config, k: int) -> Config:
    """config with its block_k halved until it divides k."""
    block_n, block_k, warps, stages = config
    while k % block_k:
        block_k //= 2
    return block_n, block_k, warps, stages


def gemv(
    x: Tensor,
    weight: Tensor,
    bias: Optional[Tensor] = None,
    config: Optional[Config] = None,
    residual: Optional[Tensor] = None,
) -> Tensor:
    """F.linear(x, weight, bias) (plus residual [..., N], in the same kernel) for rows x [..., K] and weight [N, K],
    summed in float32 (float32 products in full precision); returns [..., N] in x's dtype. config: the tiles
    (CONFIG's, block_k fitted to K, by default).

    Taking in the RMS norm before a product or the SiLU gate before the down projection too slowed its reads 1.6x
    and 4x on an H100 (2026-12-07: the math between an activation tile's load and the product); the residual add
    after costs nothing there."""
    N, K = weight.shape
    rows = x.numel() // K
    block_n, block_k, warps, stages = fit(config or CONFIG, K)
    out = torch.empty(rows, N, dtype=x.dtype, device=x.device)
    _gemv[(triton.cdiv(rows, 16), triton.cdiv(N, block_n))](
        x.contiguous(),
        weight,
        bias if bias is not None else weight,  # not read without HAS_BIAS
        residual.contiguous() if residual is not None else out,  # not read without RESIDUAL
        out,
        N,
        rows,
        K=K,
        HAS_BIAS=bias is not None,
        RESIDUAL=residual is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",  # tf32: unused by bf16 and fp16 products
        EVICT="evict_first" if rows <= 16 else "",  # a weight tile read by more than one program stays in L2
        num_warps=warps,
        num_stages=stages,
    )
    return out.view(*x.shape[:-1], N)


def _linear(x: Tensor, weight: Tensor, bias: Optional[Tensor] = None, residual: Optional[Tensor] = None) -> Tensor:
    return gemv(x, weight, bias, residual=residual)


if triton is not None:
    # an opaque op to torch.compile (the compiled blocks call it; inductor does not trace into triton here)
    op = torch.library.custom_op("draftsmith::gemv", _linear, mutates_args=())
    op.register_fake(lambda x, weight, bias=None, residual=None: x.new_empty(*x.shape[:-1], weight.shape[0]))

    # M is not specialized: one compiled kernel for every row count, so that each row's sums are made alike
    @triton.jit(do_not_specialize=["M"])
    def _gemv(
        X,
        W,
        B,
        R,
        Y,
        N,
        M,
        K: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        RESIDUAL: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
        EVICT: tl.constexpr,
    ):
        # rows 16 * program_id(0) .. + 15 of X (those beyond M read as zeros) against BLOCK_N rows of W; the programs
        # that share a weight tile are launched side by side
        m = tl.program_id(0) * 16 + tl.arange(0, 16)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_read = tl.where(n < N, n, 0)  # a last partial block reads row 0 again and stores nothing for it
        acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            cols = k + tl.arange(0, BLOCK_K)
            w = tl.load(W + n_read[:, None] * K + cols[None, :], eviction_policy=EVICT)
            x = tl.load(X + m[:, None] * K + cols[None, :], mask=m[:, None] < M, other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=PRECISION)
        if HAS_BIAS:
            acc += tl.load(B + n_read).to(tl.float32)[None, :]
        keep = (m[:, None] < M) & (n[None, :] < N)
        if RESIDUAL:
            acc += tl.load(R + m[:, None] * N + n[None, :], mask=keep, other=0.0).to(tl.float32)
        tl.store(Y + m[:, None] * N + n[None, :], acc.to(Y.dtype.element_ty), mask=keep)
