"""The fused layer linear (`triton_dense.linear_rows`: casts, gathers, the RMSNorm prologue and
the SwiGLU7 epilogue folded into one GEMM, issue 30) under Triton's interpreter on CPU
tensors (fp32 / fp16; bf16 loads are not in the 3.9.0 interpreter, benchmarks/gpu_check.py
covers them on a device): equal in bits to the unfused kernel sequence it replaces, equal to
the torch definition within rounding, and a row's bits do not change when rows are moved,
the batch is resized or a subset of rows is computed; the layers take it where `use_triton`
says so and keep the torch path on the CPU."""

import pytest
import torch

from headmoe.layers import norms, triton_dense, triton_runtime
from headmoe.layers.activations import swiglu7
from headmoe.layers.linear import Fusion, Linear, ModalityLinear
from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpreted")]

#: K ends mid-step, N mid-tile, M mid-block (masked steps, columns and rows)
M, K, N = 37, 40, 48
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}
#: small tiles so that a call spans several row and column blocks (both dtypes)
TILES = triton_dense.DenseTiles(block_m=16, block_n=16, block_k=16, group_m=2)


def _case(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g)
    w = torch.randn(N, K, generator=g).to(dtype)
    return x, w, torch.randn(N, generator=g), torch.randn(K, generator=g) * 0.1


def _unfused(x, w, bias=None, nw=None):
    """The kernel sequence the fused linear replaces: rms_norm_rows, the cast, the GEMM,
    the widening and the bias add."""
    if nw is not None:
        x = triton_dense.rms_norm_rows(x, nw, 1e-6)
    y = triton_dense.matmul(x.to(w.dtype), w.t(), tiles=TILES).float()
    return y if bias is None else y + bias


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_rows_equal_the_unfused_kernels_and_the_definition(dtype):
    x, w, bias, nw = _case(dtype)
    inv = triton_dense.rms_inv_rows(x, 1e-6)
    norm = triton_dense.RowNorm(inv, nw)
    plain = triton_dense.linear_rows(x, w.t(), bias=bias, tiles=TILES)
    assert plain.dtype == torch.float32 and plain.shape == (M, N)
    assert torch.equal(plain, _unfused(x, w, bias))
    normed = triton_dense.linear_rows(x, w.t(), norm=norm, tiles=TILES)
    assert torch.equal(normed, _unfused(x, w, nw=nw))
    low = triton_dense.linear_rows(x, w.t(), norm=norm, out_dtype=dtype, tiles=TILES)
    assert low.dtype == dtype and torch.equal(low, normed.to(dtype))
    ref = norms.rms_norm_torch(x.double(), nw.double(), 1e-6) @ w.double().t()
    assert torch.allclose(normed.double(), ref, rtol=TOL[dtype], atol=TOL[dtype] * 10)
    act = triton_dense.linear_rows(x, w.t(), norm=norm, swiglu=True, tiles=TILES)
    assert act.shape == (M, N // 2)
    assert torch.allclose(act, swiglu7(normed), rtol=1e-6, atol=1e-5)
    assert torch.allclose(act, swiglu7(ref), rtol=TOL[dtype], atol=TOL[dtype] * 20)


def test_rms_inv_rows_is_the_scale_of_rms_norm_rows():
    x, _, _, nw = _case(torch.float32, 1)
    inv = triton_dense.rms_inv_rows(x, 1e-6)
    assert torch.equal(x * inv[:, None] * (1.0 + nw), triton_dense.rms_norm_rows(x, nw, 1e-6))
    assert torch.equal(triton_dense.rms_inv_rows(x[7:8], 1e-6), inv[7:8])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_linear_rows_are_row_invariant(dtype):
    """Moved rows, resized batches and gathered subsets (rows= with out=, the modality
    linears' form) give every row the bits of the full call; rows not asked stay untouched."""
    x, w, bias, nw = _case(dtype, 2)
    inv = triton_dense.rms_inv_rows(x, 1e-6)
    kw = {"norm": triton_dense.RowNorm(inv, nw), "swiglu": True, "tiles": TILES}
    full = triton_dense.linear_rows(x, w.t(), **kw)
    p = torch.randperm(M, generator=torch.Generator().manual_seed(3))
    moved = triton_dense.linear_rows(x[p], w.t(), norm=triton_dense.RowNorm(inv[p], nw),
                                     swiglu=True, tiles=TILES)  # fmt: skip
    assert torch.equal(moved, full[p])
    for a, b in ((5, 6), (0, 17), (20, M)):
        part = triton_dense.linear_rows(x[a:b], w.t(), norm=triton_dense.RowNorm(inv[a:b], nw),
                                        swiglu=True, tiles=TILES)  # fmt: skip
        assert torch.equal(part, full[a:b])
    rows = p[:19]
    out = torch.full((M, N // 2), -7.0)
    triton_dense.linear_rows(x, w.t(), out=out, rows=rows, **kw)
    assert torch.equal(out[rows], full[rows])
    assert bool((out[p[19:]] == -7.0).all())


def test_gate_prologue_and_add_epilogue_keep_the_bits_of_the_unfused_ops(monkeypatch):
    """The attention gate (`x * s[:, k // width]` in fp32, then the cast) and the residual
    add fold in with the unfused ops' bits, gathered rows included; ModalityLinear with a
    `Fusion` equals its CPU torch path within rounding."""
    x, w, _, _ = _case(torch.float16, 5)
    g = torch.Generator().manual_seed(6)
    s, add = torch.rand(M, 4, generator=g), torch.randn(M, N, generator=g)
    gated = (x.half().float().view(M, 4, -1) * s[:, :, None]).reshape(M, K)
    want = add + _unfused(gated, w)
    gate = triton_dense.ColumnGate(s, K // 4)
    got = triton_dense.linear_rows(x.half(), w.t(), gate=gate, add=add, tiles=TILES)
    assert torch.equal(got, want)
    rows = torch.tensor([30, 2, 17])
    out = torch.zeros(M, N)
    triton_dense.linear_rows(x.half(), w.t(), out=out, rows=rows, gate=gate, add=add,
                             tiles=TILES)  # fmt: skip
    assert torch.equal(out[rows], want[rows])
    mod = ModalityLinear(3, K, N, torch.float16)
    mod.weight.data.copy_(torch.randn(mod.weight.shape, generator=g))
    groups = [torch.arange(0, M, 3), torch.arange(1, M, 3), torch.arange(2, M, 3)]
    fusion = Fusion(gate=s, add=add)
    cpu = mod(x.half(), groups, fusion)
    monkeypatch.setattr(triton_runtime, "use_triton", lambda t: True)
    assert torch.allclose(mod(x.half(), groups, fusion), cpu, rtol=2e-3, atol=2e-3)
    with pytest.raises(ValueError, match="gate must be"):
        triton_dense.linear_rows(x, w.t(), gate=triton_dense.ColumnGate(s, 3))
    with pytest.raises(ValueError, match="add must be"):
        triton_dense.linear_rows(x, w.t(), add=add.half())


def test_layers_take_the_fused_linear_where_use_triton_says(monkeypatch):
    """Linear / ModalityLinear with `FoldedNorm` inputs, swiglu and out_dtype: the Triton
    path equals the unfused kernels in bits and the CPU torch path within rounding; without
    use_triton the CPU path is the torch definition (`folded` returns the fp32 normed rows)."""
    g = torch.Generator().manual_seed(4)
    lin, mod = Linear(K, N, dtype=torch.float16), ModalityLinear(3, K, N, torch.float16)
    norm = norms.ModalityRMSNorm(3, K)
    for p in (lin.weight, mod.weight, norm.weight):
        p.data.copy_(torch.randn(p.shape, generator=g) * (0.1 if p is norm.weight else 1))
    x = torch.randn(M, K, generator=g)
    modality = torch.randint(0, 3, (M,), generator=g)
    groups = [torch.nonzero(modality == m).flatten() for m in range(3)]
    cpu_n = norm.folded(x, modality, groups)
    assert isinstance(cpu_n, torch.Tensor)
    act = Fusion(swiglu=True, out_dtype=torch.float16)
    cpu = (lin(cpu_n, act), mod(cpu_n, groups))
    monkeypatch.setattr(triton_runtime, "use_triton", lambda t: True)
    n = norm.folded(x, modality, groups)
    assert isinstance(n, norms.FoldedNorm)
    gpu = (lin(n, act), mod(n, groups))
    normed = triton_dense.rms_norm_rows(x, norm.weight.view(3, K)[modality], 1e-6)
    want_mod = torch.empty(M, N)
    for m, rows in enumerate(groups):
        want_mod[rows] = triton_dense.matmul(normed[rows].half(), mod.weight[m * N:(m + 1) * N].t()).float()
    assert torch.equal(gpu[1], want_mod)
    want_lin = swiglu7(triton_dense.matmul(normed.half(), lin.weight.t()).float()).half()
    assert gpu[0].dtype == torch.float16
    assert torch.allclose(gpu[0].float(), want_lin.float(), rtol=1e-3, atol=1e-3)
    for got, ref in zip(gpu, cpu):
        assert torch.allclose(got.float(), ref.float(), rtol=5e-3, atol=5e-3)


def test_bad_arguments_name_the_operand():
    x, w, _, _ = _case(torch.float32)
    with pytest.raises(ValueError, match="a must be"):
        triton_dense.linear_rows(x, w)
    with pytest.raises(ValueError, match="N even"):
        triton_dense.linear_rows(x, w.t()[:, :7], swiglu=True)
    with pytest.raises(ValueError, match="out must be"):
        triton_dense.linear_rows(x, w.t(), out=torch.empty(M, N + 1))
    with pytest.raises(ValueError, match="rows must be int64"):
        triton_dense.linear_rows(x, w.t(), out=torch.empty(M, N), rows=torch.zeros(3))
    with pytest.raises(ValueError, match="norm must hold"):
        triton_dense.linear_rows(x, w.t(), norm=triton_dense.RowNorm(torch.ones(3), w[0]))
