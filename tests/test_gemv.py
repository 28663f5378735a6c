"""The GPU kernel for one sequence's products (serve/gemv.py), with the residual add it takes in, run by triton's
interpreter on CPU tensors in float32 (the interpreter must be switched on before triton is imported: a subprocess),
against F.linear. The interpreter's sums are numpy's, so its rows come out bit for bit alike on this project's CPU
machines (CI's) but not under every numpy build (not on the GPU machine's): there tests/test_cuda_graphs.py checks
the kernel's own rows."""

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
    # (the demo target's 576) and of several iterations of the widest; a plain step's row, a verification's, more
    # than one program's 16; the default tiles and others
    for K in (96, 576, 2048):
        for N in (4, 37):
            w, b = torch.randn(N, K), torch.randn(N)
            for rows in (1, 6, 16, 40):
                x = torch.randn(1, rows, K)
                for config in (None, (16, 32, 4, 2)):
                    for bias in (None, b):
                        out = gemv.gemv(x, w, bias, config)
                        assert out.shape == (1, rows, N) and out.dtype == x.dtype
                        worst = max(worst, (out - F.linear(x, w, bias)).abs().max().item() / K**0.5)
                        # each row as it comes out alone, bit for bit: a verified token as its plain step made it
                        for j in {0, rows // 2, rows - 1}:
                            assert torch.equal(gemv.gemv(x[:, j : j + 1], w, bias, config), out[:, j : j + 1]), (K, N, rows, j)
    assert gemv.fit((64, 256, 4, 4), 96) == (64, 32, 4, 4) and gemv.fit(gemv.CONFIG, 4096) == gemv.CONFIG
    # the residual add in the product's kernel (the layers' output and down projections)
    for K, N, rows in ((96, 37, 1), (576, 4, 6), (576, 37, 40)):
        w, x, residual = torch.randn(N, K), torch.randn(1, rows, K), torch.randn(1, rows, N)
        out = gemv.gemv(x, w, residual=residual)
        worst = max(worst, (out - F.linear(x, w) - residual).abs().max().item() / K**0.5)
        assert all(torch.equal(gemv.gemv(x[:, j : j + 1], w, residual=residual[:, j : j + 1]), out[:, j : j + 1]) for j in {0, rows - 1})
    print(worst)
""")


def test_gemv_matches_linear_and_each_row_alone():
    assert interpreted(CHECK) < 1e-5


def test_the_model_keeps_torch_products_where_the_kernel_does_not_run(monkeypatch):
    """On a CPU, for a batch of several sequences, past MAX_ROWS tokens and for weights under MIN_WEIGHT, with the
    kernel switched on, a model's products are F.linear's."""
    import torch

    from draftsmith.serve import gemv, model

    x, w = torch.randn(1, 1, 64), torch.randn(8, 64)
    assert not gemv.runs(x, w)  # a CPU tensor
    if torch.cuda.is_available():
        xc, wc = x.cuda(), w.cuda()
        assert not gemv.runs(xc, wc)  # a small weight
        monkeypatch.setattr(gemv, "MIN_WEIGHT", wc.numel())
        assert gemv.runs(xc, wc) and gemv.runs(xc.expand(1, gemv.MAX_ROWS, 64), wc)
        assert not gemv.runs(xc.expand(2, 1, 64), wc) and not gemv.runs(xc.expand(1, gemv.MAX_ROWS + 1, 64), wc)
    layer = model.Linear(64, 8)
    switched, model.USE_GEMV = model.USE_GEMV, True
    try:
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias), rtol=0, atol=0)
    finally:
        model.USE_GEMV = switched
