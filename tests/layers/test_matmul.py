"""Batch invariance of the matmul helpers, checked bitwise on this machine's kernels."""

import pytest
import torch
import torch.nn.functional as F

from headmoe.layers.matmul import bi_bmm, bi_linear, bi_matmul

ROWS = [*range(1, 40), 63, 64, 65, 255, 256, 257, 700]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_bi_linear_rows_do_not_depend_on_batch(dtype, threads):
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(700, 384, generator=g).to(dtype)
        w = torch.randn(96, 384, generator=g).to(dtype)
        b = torch.randn(96, generator=g).to(dtype)
        full = bi_linear(x, w, b)
        for m in ROWS:
            assert torch.equal(bi_linear(x[:m], w, b), full[:m]), m
        for off in (1, 7, 33):
            assert torch.equal(bi_linear(x[off : off + 5], w, b), full[off : off + 5]), off
        # a permutation moves rows but does not change their bits
        perm = torch.randperm(700, generator=g)
        assert torch.equal(bi_linear(x[perm], w, b), full[perm])
        assert torch.equal(bi_matmul(x[:9], w.t()), bi_matmul(x, w.t())[:9])
    finally:
        torch.set_num_threads(old)


def test_bi_linear_matches_linear_and_handles_shapes():
    x = torch.randn(2, 3, 8)
    w = torch.randn(5, 8)
    assert torch.allclose(bi_linear(x, w), F.linear(x, w), rtol=1e-6, atol=1e-6)
    assert bi_linear(x, w).shape == (2, 3, 5)
    assert bi_linear(x[:0], w).shape == (0, 3, 5)
    assert bi_matmul(torch.empty(0, 8), w.t()).shape == (0, 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_bi_bmm_rows_do_not_depend_on_batch(dtype):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(4, 48, 32, generator=g).to(dtype)
    b = torch.randn(4, 32, 64, generator=g).to(dtype)
    full = bi_bmm(a, b)
    for m in range(1, 48):
        assert torch.equal(bi_bmm(a[:, :m], b), full[:, :m]), m
    for i in range(4):
        assert torch.equal(bi_matmul(a[i], b[i]), full[i])


# shapes whose plain torch products gave other bits at 1, 2 and 3 threads on an Intel Xeon
# (fp32: oneMKL without its strict mode; bf16: oneDNN), see headmoe.numerics / .layers.matmul
THREAD_SHAPES = [(298, 1536, 24), (298, 1536, 64), (16, 3072, 16), (300, 2048, 512)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", THREAD_SHAPES)
def test_products_do_not_depend_on_the_thread_count(dtype, shape):
    m, k, n = shape
    g = torch.Generator().manual_seed(2)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    a3, b3 = x.view(2, m // 2, k), torch.stack([w.t(), w.t().flip(0)])
    old, outs = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            outs.append((bi_linear(x, w), bi_matmul(x, w.t()), bi_bmm(a3, b3)))
    finally:
        torch.set_num_threads(old)
    for other in outs[1:]:
        for ref, got in zip(outs[0], other):
            assert got.dtype == dtype and torch.equal(ref, got)
