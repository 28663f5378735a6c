"""The GPU matrix-vector kernel (serve/gemv.py), run by triton's interpreter on CPU tensors in float32 (the
interpreter must be switched on before triton is imported: a subprocess), against F.linear."""

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from draftsmith.serve import gemv

    torch.manual_seed(0)
    worst = 0.0
    # one row (a plain step at batch 1) to MAX_ROWS (a verification); weight rows not a multiple of BLOCK_N;
    # K of a 16-column block (the tiny SmolLM2's 96), of 64-column ones (the demo target's 576) and of several
    # iterations of the widest block
    for K in (96, 576, 2048):
        for N in (4, 37):
            for M in (1, 3, 8):
                x, w, b = torch.randn(1, M, K), torch.randn(N, K), torch.randn(N)
                assert gemv.block_k(M, K) * triton_pad(M) * gemv.BLOCK_N <= gemv.TILE and K % gemv.block_k(M, K) == 0
                for bias in (None, b):
                    out = gemv.gemv(x, w, bias)
                    assert out.shape == (1, M, N) and out.dtype == x.dtype
                    worst = max(worst, (out - F.linear(x, w, bias)).abs().max().item() / K**0.5)
    print(worst)
""").replace("triton_pad(M)", "gemv.triton.next_power_of_2(M)")


def test_gemv_matches_linear():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert float(done.stdout.strip().splitlines()[-1]) < 1e-5


def test_the_model_keeps_torch_products_where_the_kernel_does_not_run():
    """On a CPU, with the kernel switched on, a model's products are F.linear's: the same logits."""
    import torch

    from draftsmith.serve import gemv, model

    x, w = torch.randn(1, 1, 64), torch.randn(8, 64)
    assert not gemv.runs(x, w)  # a CPU tensor
    layer = model.Linear(64, 8)
    switched, model.USE_GEMV = model.USE_GEMV, True
    try:
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    finally:
        model.USE_GEMV = switched
