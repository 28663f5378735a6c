"""Attention for decode steps on a GPU: a few query tokens a row over the static KV cache, reading only
the slots each row has filled.

torch's fused kernel takes the whole cache and a [B, 1, T, S] mask, so its cost follows the cache's size,
not the rows' lengths, and over 2+ query tokens it ran a slow cuDNN kernel: on an H200 at batch 16 and
401 slots, 36.7 us a layer for a K = 3 verification, 58% of the demo target's forward
(benchmarks/profile_step.py). This kernel gives each (row, KV head) one program that holds the head's G
query heads x T tokens as the rows of one tile and walks the cache in blocks up to the row's last
position, with an online softmax (flash attention's recurrence) in float32.

A query at cache slot s sees slots 0..s (serve.model.CachedModel.place builds the same rule as a mask). A
padding query, at the spare slot max_seq_len that takes padding writes (an idle row of the batch, a row
that pads a prefill to its graph's batch), sees slot 0 only: its output is dropped, and under the mask
rule it read the whole cache, as much work as the longest real row. Needs triton; its interpreter
(TRITON_INTERPRET=1) runs it on CPU tensors in float32, which is how the suite tests it.
"""

from typing import Optional

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only install: the model uses torch's attention
    triton = None

MAX_QUERY_ROWS = 64  # G x T rows of one program's tile at most; longer forwards (prefills) use torch's kernel
BLOCK_N = 64  # cache slots a loop iteration reads
PROGRAMS = 256  # programs that keep an H200's 132 SMs busy: small batches split the cache's slots among more
MIN_SPLIT_BLOCKS = 4  # blocks of slots a split reads at least


def runs(q: Tensor, kv_heads: int) -> bool:
    """Whether decode_attention runs for queries q [B, T, H, D] on a GPU: a dtype and head size tl.dot
    takes, and at most MAX_QUERY_ROWS query rows a KV head."""
    B, T, H, D = q.shape
    return (
        triton is not None
        and q.device.type == "cuda"
        and q.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and D in (16, 32, 64, 128, 256)
        and H // kv_heads * T <= MAX_QUERY_ROWS
    )


def num_splits(batch: int, kv_heads: int, slots: int) -> int:
    """How many parts of the cache's slots the programs of one (row, KV head) share: enough programs to
    fill the GPU at small batches, each part at least MIN_SPLIT_BLOCKS blocks of slots."""
    return max(1, min(triton.cdiv(PROGRAMS, batch * kv_heads), triton.cdiv(slots, BLOCK_N) // MIN_SPLIT_BLOCKS))


def decode_attention(
    q: Tensor,
    keys: Tensor,
    values: Tensor,
    slots: Tensor,
    max_seq_len: int,
    read: Optional[Tensor] = None,
    window: int = 0,
    softcap: float = 0.0,
    scale: float = 0.0,
) -> Tensor:
    """softmax(q k^T x scale) v over each row's filled slots. q [B, T, H, D]; keys, values [R, H_kv, S, D]
    (the whole cache, S = max_seq_len + 1); slots [B, T]: each query's cache slot (clamped position); read
    [B]: the cache row of each batch row (None: row b); window: a query at slot s sees only slots after
    s - window (0: every slot up to s); softcap: scores become softcap x tanh(score / softcap) (Gemma 2; 0:
    none); scale: 0 is 1 / sqrt(D). Returns [B, T, H, D] in q's dtype.

    With several splits (num_splits), each program attends over its part of the slots and leaves its
    normalised output and log-sum-exp in float32; a second kernel weighs the parts together."""
    B, T, H, D = q.shape
    kv_heads, S = keys.shape[1], keys.shape[2]
    groups = H // kv_heads
    block_m = max(16, triton.next_power_of_2(groups * T))
    if block_m > MAX_QUERY_ROWS:
        raise ValueError(f"{groups * T} query rows a KV head exceed decode_attention's {MAX_QUERY_ROWS}")
    splits = num_splits(B, kv_heads, S)
    chunk = triton.cdiv(triton.cdiv(S, BLOCK_N), splits) * BLOCK_N
    out = torch.empty_like(q)
    if splits > 1:
        parts = torch.empty(B, kv_heads, splits, block_m, D, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, kv_heads, splits, block_m, dtype=torch.float32, device=q.device)
    else:
        parts = lse = out  # not read: the kernel writes the output itself
    rows = read if read is not None else slots  # any tensor when READ_ROWS is off: the kernel reads it only then
    _decode_attention[(B, kv_heads, splits)](
        q,
        keys,
        values,
        out,
        parts,
        lse,
        slots,
        rows,
        *q.stride(),
        *keys.stride(),
        *values.stride(),
        *out.stride(),
        *slots.stride(),
        scale or D**-0.5,
        max_seq_len,
        chunk,
        window,
        softcap,
        T=T,
        G=groups,
        D=D,
        BLOCK_M=block_m,
        BLOCK_N=BLOCK_N,
        SPLITS=splits,
        READ_ROWS=read is not None,
        SOFTCAP=softcap > 0,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # float32 products exactly, not in tf32
        num_warps=4,
        num_stages=2,
    )
    if splits > 1:
        _combine[(B, kv_heads)](parts, lse, out, *out.stride(), T=T, G=groups, D=D, BLOCK_M=block_m, SPLITS=splits)
    return out


if triton is not None:
    # an opaque op to torch.compile (the compiled blocks call it; inductor does not trace into triton here)
    op = torch.library.custom_op("draftsmith::decode_attention", decode_attention, mutates_args=())
    op.register_fake(lambda q, keys, values, slots, max_seq_len, read=None, window=0, softcap=0.0, scale=0.0: torch.empty_like(q))

    # the kernel's pointers and strides as the launch passes them
    # fmt: off
    @triton.jit
    def _decode_attention(Q, K, V, O, Parts, Lse, Slots, Rows,
                          sqb, sqt, sqh, sqd, skb, skh, sks, skd, svb, svh, svs, svd, sob, sot, soh, sod, ssb, sst,
                          scale, max_seq_len, chunk, window, softcap,
                          T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          SPLITS: tl.constexpr, READ_ROWS: tl.constexpr, SOFTCAP: tl.constexpr, PRECISION: tl.constexpr):
        # fmt: on
        b = tl.program_id(0)
        h = tl.program_id(1)  # the KV head; it serves query heads h*G .. h*G+G-1
        split = tl.program_id(2)
        row = tl.load(Rows + b) if READ_ROWS else b
        m = tl.arange(0, BLOCK_M)  # tile row m: query head h*G + m // T, token m % T
        real = m < G * T
        head = h * G + m // T
        t = m % T
        d = tl.arange(0, D)
        q = tl.load(Q + b * sqb + t[:, None] * sqt + head[:, None] * sqh + d[None, :] * sqd, mask=real[:, None], other=0.0)
        # a query at slot s sees slots 0..s; padding (s = max_seq_len) slot 0 only
        slot = tl.load(Slots + b * ssb + t * sst, mask=real, other=0)
        seen = tl.where(slot < max_seq_len, slot + 1, 1)  # [BLOCK_M]
        first = tl.where((window > 0) & (slot < max_seq_len), slot - window + 1, 0)  # a sliding window's first slot
        end = 1
        for i in tl.static_range(T):  # the last slot any of the row's queries sees
            last = tl.load(Slots + b * ssb + i * sst)
            end = tl.maximum(end, tl.where(last < max_seq_len, last + 1, 1))
        best = tl.full([BLOCK_M], float("-inf"), tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        k_base = K + row * skb + h * skh
        v_base = V + row * svb + h * svh
        for start in range(split * chunk, tl.minimum(split * chunk + chunk, end), BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            inside = n < end
            k = tl.load(k_base + n[None, :] * sks + d[:, None] * skd, mask=inside[None, :], other=0.0)  # [D, N]
            s = tl.dot(q, k, input_precision=PRECISION) * scale  # [M, N] in float32
            if SOFTCAP:  # softcap x tanh(s / softcap), tanh written with exp: 1 - 2 / (e^2x + 1)
                s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
            s = tl.where((n[None, :] < seen[:, None]) & (n[None, :] >= first[:, None]), s, float("-inf"))
            new_best = tl.maximum(best, tl.max(s, axis=1))
            safe = tl.where(new_best == float("-inf"), 0.0, new_best)  # a query that sees nothing of this part yet
            p = tl.exp(s - safe[:, None])
            fade = tl.exp(best - safe)
            total = total * fade + tl.sum(p, axis=1)
            v = tl.load(v_base + n[:, None] * svs + d[None, :] * svd, mask=inside[:, None], other=0.0)  # [N, D]
            acc = acc * fade[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            best = new_best
        if SPLITS == 1:
            out = acc / total[:, None]
            tl.store(
                O + b * sob + t[:, None] * sot + head[:, None] * soh + d[None, :] * sod, out.to(O.dtype.element_ty), mask=real[:, None]
            )
        else:  # this part's output and log-sum-exp (-inf, output 0, where a query saw none of its slots)
            part = (b * tl.num_programs(1) + h) * SPLITS + split
            tl.store(Parts + (part * BLOCK_M + m[:, None]) * D + d[None, :], acc / tl.maximum(total, 1e-30)[:, None])
            tl.store(Lse + part * BLOCK_M + m, best + tl.log(total))

    @triton.jit
    def _combine(
        Parts, Lse, O, sob, sot, soh, sod, T: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr
    ):
        b = tl.program_id(0)
        h = tl.program_id(1)
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        first = (b * tl.num_programs(1) + h) * SPLITS
        top = tl.full([BLOCK_M], float("-inf"), tl.float32)
        for i in tl.static_range(SPLITS):
            top = tl.maximum(top, tl.load(Lse + (first + i) * BLOCK_M + m))
        acc = tl.zeros([BLOCK_M, D], tl.float32)
        weights = tl.zeros([BLOCK_M], tl.float32)
        for i in tl.static_range(SPLITS):
            w = tl.exp(tl.load(Lse + (first + i) * BLOCK_M + m) - top)
            acc += w[:, None] * tl.load(Parts + ((first + i) * BLOCK_M + m[:, None]) * D + d[None, :])
            weights += w
        real = m < G * T
        head = h * G + m // T
        t = m % T
        tl.store(
            O + b * sob + t[:, None] * sot + head[:, None] * soh + d[None, :] * sod,
            (acc / weights[:, None]).to(O.dtype.element_ty),
            mask=real[:, None],
        )
