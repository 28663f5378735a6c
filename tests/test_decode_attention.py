"""The GPU decode-attention kernel (serve/decode_attention.py), run by triton's interpreter on CPU tensors
in float32 (the interpreter must be switched on before triton is imported: a subprocess), against torch's
attention under the mask that CachedModel.place builds."""

import textwrap

import pytest

from tests.conftest import interpreted

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from draftsmith.serve import decode_attention as kernel

    def reference(q, keys, values, slots, max_seq_len, read, window=0, softcap=0.0, scale=None):
        B, T = slots.shape
        rows = read if read is not None else torch.arange(B)
        ids = torch.arange(keys.shape[2])
        seen = torch.where(slots < max_seq_len, slots, 0)  # padding queries: slot 0 only
        mask = ids.view(1, 1, 1, -1) <= seen.view(B, 1, T, 1)
        if window:  # a sliding window: the last `window` slots up to the query's own
            mask &= (ids.view(1, 1, 1, -1) > (seen - window).view(B, 1, T, 1)) | (slots >= max_seq_len).view(B, 1, T, 1)
        groups = q.shape[2] // keys.shape[1]
        k, v = keys[rows].repeat_interleave(groups, 1), values[rows].repeat_interleave(groups, 1)
        scores = (q.transpose(1, 2) @ k.transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
        if softcap:
            scores = torch.tanh(scores / softcap) * softcap
        return (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(1, 2)

    torch.manual_seed(0)
    max_seq_len, heads, kv_heads, head_dim = 150, 6, 2, 16
    keys = torch.randn(5, kv_heads, max_seq_len + 1, head_dim)
    values = torch.randn(5, kv_heads, max_seq_len + 1, head_dim)
    worst = 0.0
    # one pass over the slots; then the slots split in three parts of 64 (a part that a row has not reached,
    # and queries of one row that see none of a part that its other queries see)
    for min_split_blocks, splits in ((4, 1), (1, 3)):
        kernel.MIN_SPLIT_BLOCKS = min_split_blocks
        assert kernel.num_splits(5, kv_heads, max_seq_len + 1) == splits  # the 5 rows below
        for T in (1, 3, 5):
            # a row near the start, one whose queries cross a 64-slot block, a long one, and a padding row
            # (at the spare slot: it sees slot 0 only), and a row whose last queries are padding
            starts = [0, 62, 140, max_seq_len, max_seq_len - 2]
            slots = torch.tensor([[min(s + t, max_seq_len) for t in range(T)] for s in starts])
            q = torch.randn(len(starts), T, heads, head_dim)
            for read in (None, torch.tensor([4, 0, 2, 1, 3])):
                # as it is, and as Gemma attends: a sliding window (across a block's edge), soft-capped scores, a scale
                for options in ({}, {"window": 70, "softcap": 2.0, "scale": 0.4}):
                    out = kernel.decode_attention(q, keys, values, slots, max_seq_len, read, **options)
                    assert out.shape == q.shape and out.dtype == q.dtype and out.isfinite().all()
                    expected = reference(q, keys, values, slots, max_seq_len, read, **options)
                    worst = max(worst, (out - expected).abs().max().item())
    print(worst)
""")


def test_decode_attention_matches_masked_attention():
    assert interpreted(CHECK) < 1e-5
