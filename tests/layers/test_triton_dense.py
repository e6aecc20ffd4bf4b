"""The batch-invariant dense kernels (GEMM, RMSNorm) under Triton's interpreter on CPU tensors
(fp32/fp16; the 3.9.0 interpreter mis-reads bf16, which benchmarks/gpu_check.py covers on a
device): a row's bits do not change with the number of rows in the call (M in 1, 7, 16,
3709, 3710, 14836) nor with its position; results agree with torch within rounding; the
layers route to the kernels where `use_triton` says so."""

import pytest
import torch

from headmoe.layers import matmul as bi
from headmoe.layers import norms, triton_dense, triton_runtime
from headmoe.layers.linear import Linear
from headmoe.layers.mhc import mhc_mix
from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpreted")]

#: the row counts of issue 21 (3709 / 3710: an SP8 shard of 29,672 tokens and one more;
#: 14836: a 272p segment)
ROW_COUNTS = (1, 7, 16, 3709, 3710, 14836)
#: small K / N that end mid-tile (masked K steps and columns); C for RMSNorm likewise
K, N, C = 40, 24, 40
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _rows(m: int, cols: int, seed: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(m, cols, generator=g).to(dtype)


def _probe_batches(probe: torch.Tensor, seed: int):
    """(M, batch, positions): for every M of ROW_COUNTS a batch of M random rows with the
    probe rows placed at first, middle and last positions (as many as fit)."""
    for m in ROW_COUNTS:
        batch = _rows(m, probe.shape[1], seed + m, probe.dtype)
        spots = sorted({0, m // 2, m - 1, min(m - 1, 63), min(m - 1, 64)})[: probe.shape[0]]
        for j, p in enumerate(spots):
            batch[p] = probe[j]
        yield m, batch, spots


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_gemm_rows_do_not_depend_on_row_count_or_position(dtype):
    w = _rows(N, K, 1, dtype)
    bias = torch.randn(N, generator=torch.Generator().manual_seed(2))
    probe = _rows(5, K, 3, dtype)
    alone = [triton_dense.matmul(probe[j : j + 1], w.t(), bias) for j in range(5)]
    for m, batch, spots in _probe_batches(probe, seed=4):
        out = triton_dense.matmul(batch, w.t(), bias)
        assert out.shape == (m, N) and out.dtype == dtype
        for j, p in enumerate(spots):
            assert torch.equal(out[p : p + 1], alone[j]), (m, p)
    ref = (probe.double() @ w.double().t() + bias.double()).to(dtype)
    got = torch.cat(alone)
    assert torch.allclose(got.double(), ref.double(), rtol=TOL[dtype], atol=TOL[dtype])


def test_gemm_sub_batches_and_groups_equal_the_full_call():
    """Every row of slices at odd offsets equals the full call's row; the batched form
    (`[G, M, K] @ [G, K, N]`, bi_bmm's shape) equals per-group calls."""
    x, w = _rows(300, K, 5, torch.float32), _rows(K, N, 6, torch.float32)
    full = triton_dense.matmul(x, w)
    for a, b in ((0, 1), (3, 70), (129, 300), (17, 18)):
        assert torch.equal(triton_dense.matmul(x[a:b], w), full[a:b])
    xs, ws = x[:90].view(3, 30, K), torch.stack([w, w * 2, -w])
    grouped = triton_dense.matmul(xs, ws)
    for gi in range(3):
        assert torch.equal(grouped[gi], triton_dense.matmul(xs[gi], ws[gi]))
        assert torch.equal(grouped[gi, 4:5], triton_dense.matmul(xs[gi, 4:5], ws[gi]))
    assert torch.allclose(grouped, torch.bmm(xs, ws), rtol=1e-5, atol=1e-5)


def test_gemm_tile_order_covers_every_tile_and_keeps_the_bits():
    """`group_m` (the order programs take tiles in) writes every tile exactly as the
    row-major order does: 12 x 6 tiles of 16, so groups of 5 and 8 end with a partial one."""
    x, w = _rows(16 * 11 + 3, 40, 7, torch.float32), _rows(40, 16 * 5 + 1, 8, torch.float32)
    outs = [triton_dense.matmul(x, w, tiles=triton_dense.DenseTiles(
        block_m=16, block_n=16, block_k=16, group_m=g)) for g in (1, 3, 5, 8, 64)]
    for out in outs[1:]:
        assert torch.equal(out, outs[0])
    assert torch.allclose(outs[0].double(), x.double() @ w.double(), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="DenseTiles.group_m must be a positive int, got 0"):
        triton_dense.DenseTiles(group_m=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_rms_norm_rows_do_not_depend_on_row_count_or_position(dtype):
    weight = torch.randn(C, generator=torch.Generator().manual_seed(7)) * 0.1
    probe = _rows(5, C, 8, dtype)
    alone = [triton_dense.rms_norm_rows(probe[j : j + 1], weight, 1e-6) for j in range(5)]
    for m, batch, spots in _probe_batches(probe, seed=9):
        out = triton_dense.rms_norm_rows(batch, weight, 1e-6)
        assert out.dtype == torch.float32 and out.shape == (m, C)
        for j, p in enumerate(spots):
            assert torch.equal(out[p : p + 1], alone[j]), (m, p)
    ref = norms.rms_norm(probe.double(), weight.double(), 1e-6)
    assert torch.allclose(torch.cat(alone).double(), ref, rtol=1e-5, atol=1e-6)


def test_rms_norm_rows_take_per_token_weights_and_long_rows():
    """`[T, C]` and `[T, 1, C]` weights (ModalityRMSNorm, q/k norms); C over one block."""
    g = torch.Generator().manual_seed(10)
    x = torch.randn(6, 3, C, generator=g)
    w = torch.randn(6, 1, C, generator=g) * 0.1
    out = triton_dense.rms_norm_rows(x, w, 1e-6)
    assert torch.allclose(out, norms.rms_norm(x.double(), w.double()).float(), atol=1e-6)
    assert torch.equal(out[2:4], triton_dense.rms_norm_rows(x[2:4], w[2:4], 1e-6))
    long = torch.randn(3, triton_dense.NORM_BLOCK + 40, generator=g)
    lw = torch.randn(long.shape[1], generator=g) * 0.1
    got = triton_dense.rms_norm_rows(long, lw, 1e-6)
    assert torch.allclose(got, norms.rms_norm(long.double(), lw.double()).float(), atol=1e-6)
    assert torch.equal(got[1:2], triton_dense.rms_norm_rows(long[1:2], lw, 1e-6))


def test_layers_route_to_the_kernels_where_use_triton_says(monkeypatch):
    """bi_linear, bi_matmul, bi_bmm and rms_norm (so Linear, the mHC products, the router's
    logits and every RMSNorm) take the Triton kernels on CUDA; CPU tensors keep the torch
    paths and their own guarantee (tests/layers/test_matmul.py)."""
    g = torch.Generator().manual_seed(11)
    lin = Linear(20, 24)  # in=20: padded to ALIGN on both operands
    lin.weight.data.copy_(torch.randn(24, 20, generator=g))
    x = torch.randn(9, 20, generator=g)
    a, b = torch.randn(9, K, generator=g), torch.randn(K, N, generator=g)
    a3, b3 = torch.randn(2, 9, K, generator=g), torch.randn(2, K, N, generator=g)
    nw = torch.randn(K, generator=g) * 0.1
    cpu = (lin(x), bi.bi_matmul(a, b), bi.bi_bmm(a3, b3), norms.rms_norm(a, nw))
    assert not triton_runtime.use_triton(x)
    calls = []
    monkeypatch.setattr(triton_runtime, "use_triton", lambda t: calls.append(t.shape) or True)
    gpu = (lin(x), bi.bi_matmul(a, b), bi.bi_bmm(a3, b3), norms.rms_norm(a, nw))
    assert len(calls) == 4
    assert torch.equal(gpu[0], triton_dense.matmul(torch.nn.functional.pad(x, (0, 12)),
                                                   torch.nn.functional.pad(lin.weight, (0, 12)).t()))
    assert torch.equal(gpu[1], triton_dense.matmul(a, b))
    assert torch.equal(gpu[2], triton_dense.matmul(a3, b3))
    assert torch.equal(gpu[3], triton_dense.rms_norm_rows(a, nw, 1e-6))
    for got, want in zip(gpu, cpu):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mhc_mix_rows_are_invariant_on_the_triton_path(monkeypatch):
    """mhc_mix (RMSNorm + bi_matmul + row-local maths) through the kernels: a token's
    coefficients have the same bits alone and inside a batch."""
    monkeypatch.setattr(triton_runtime, "use_triton", lambda t: True)
    g = torch.Generator().manual_seed(12)
    n, c, t = 4, 8, 37
    state = torch.randn(t, n, c, generator=g)
    args = (torch.randn(n * c, generator=g) * 0.1, torch.randn(n * c, 2 * n + n * n, generator=g),
            tuple(torch.rand(1, generator=g) for _ in range(3)),
            (torch.randn(n, generator=g), torch.randn(n, generator=g), torch.randn(n * n, generator=g)))  # fmt: skip
    full = mhc_mix(state, *args, iters=5, eps=1e-6, norm_eps=1e-6)
    part = mhc_mix(state[20:21], *args, iters=5, eps=1e-6, norm_eps=1e-6)
    for name in ("h_pre", "h_post", "h_res"):
        assert torch.equal(getattr(part, name), getattr(full, name)[20:21])


def test_bad_arguments_name_the_operand():
    x = torch.zeros(3, 8)
    with pytest.raises(ValueError, match="b must be"):
        triton_dense.matmul(x, torch.zeros(7, 4))
    with pytest.raises(ValueError, match="b must be"):
        triton_dense.matmul(x, torch.zeros(8, 4, dtype=torch.float16))
    with pytest.raises(ValueError, match="bias must be"):
        triton_dense.matmul(x, torch.zeros(8, 4), torch.zeros(5))
    with pytest.raises(ValueError, match="a and b"):
        triton_dense.matmul(x.long(), torch.zeros(8, 4).long())
    with pytest.raises(ValueError, match="block_k"):
        triton_dense.DenseTiles(block_k=24)


def test_rms_norm_matmul_equals_the_two_steps_and_is_row_invariant():
    """The mHC logit GEMM with the RMSNorm folded in as a per-row scale: equal to
    rms_norm then matmul within rounding (shared and per-token weights, K over several
    steps ending mid-step), a row's bits the same moved, alone, or in resized batches."""
    g = torch.Generator().manual_seed(13)
    m, k, n = 70, 136, 24
    x = torch.randn(m, k, generator=g)
    phi = torch.randn(k, n, generator=g)
    for w in (torch.randn(k, generator=g) * 0.1, torch.randn(m, k, generator=g) * 0.1):
        got = triton_dense.rms_norm_matmul(x, w, phi, 1e-6)
        want = norms.rms_norm(x.double(), w.double(), 1e-6) @ phi.double()
        assert got.dtype == torch.float32 and got.shape == (m, n)
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-4)
        p = torch.randperm(m, generator=g)
        wp = w if w.dim() == 1 else w[p]
        assert torch.equal(triton_dense.rms_norm_matmul(x[p], wp, phi, 1e-6), got[p])
        for a, b in ((5, 6), (3, 70), (64, 69)):
            wa = w if w.dim() == 1 else w[a:b]
            assert torch.equal(triton_dense.rms_norm_matmul(x[a:b], wa, phi, 1e-6), got[a:b])
    with pytest.raises(ValueError, match="weight must be"):
        triton_dense.rms_norm_matmul(x, torch.zeros(3, k), phi, 1e-6)
