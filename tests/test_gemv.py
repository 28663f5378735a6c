"""The GPU matrix-vector kernel (serve/gemv.py), run by triton's interpreter on CPU tensors in float32 (the
interpreter must be switched on before triton is imported: a subprocess), against F.linear."""

import textwrap

import pytest

from tests.conftest import interpreted

pytest.importorskip("triton")

CHECK = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from draftsmith.serve import gemv

    torch.manual_seed(0)
    worst = 0.0
    # weight rows not a multiple of a program's; K of 16-column blocks (the tiny SmolLM2's 96), of 64-column ones
    # (the demo target's 576) and of several iterations of the widest; the default tiles and others
    for K in (96, 576, 2048):
        for N in (4, 37):
            x, w, b = torch.randn(1, 1, K), torch.randn(N, K), torch.randn(N)
            block_k = gemv.default_config(K)[1]
            assert K % block_k == 0 and block_k == min(1024, K & -K)
            for config in (None, (8, 32, 4, 2)):
                for bias in (None, b):
                    out = gemv.gemv(x, w, bias, config)
                    assert out.shape == (1, 1, N) and out.dtype == x.dtype
                    worst = max(worst, (out - F.linear(x, w, bias)).abs().max().item() / K**0.5)
    print(worst)
""")


def test_gemv_matches_linear():
    assert interpreted(CHECK) < 1e-5


def test_the_model_keeps_torch_products_where_the_kernel_does_not_run():
    """On a CPU, and over more than one row, with the kernel switched on, a model's products are F.linear's."""
    import torch

    from draftsmith.serve import gemv, model

    x, w = torch.randn(1, 1, 64), torch.randn(8, 64)
    assert not gemv.runs(x, w)  # a CPU tensor
    if torch.cuda.is_available():
        assert gemv.runs(x.cuda(), w.cuda()) and not gemv.runs(torch.randn(1, 2, 64).cuda(), w.cuda())
    layer = model.Linear(64, 8)
    switched, model.USE_GEMV = model.USE_GEMV, True
    try:
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    finally:
        model.USE_GEMV = switched
