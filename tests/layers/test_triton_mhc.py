"""The fused mHC kernels (headmoe.layers.triton_mhc) under Triton's interpreter on CPU
tensors (fp32/fp16; bf16 is covered on a device by benchmarks/gpu_check.py): each equals
the torch definition (headmoe.layers.mhc) within rounding, and a token's bits do not change
when its rows are moved or the batch is resized; the layer functions route to them where
`use_triton` says so."""

import math

import pytest
import torch

from headmoe.layers import mhc, triton_mhc, triton_runtime
from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpreted")]

#: released streams; C ends mid-block (masked channels); T ends mid-block too
N, C, T = 4, 136, 37
TOL = {torch.float32: 1e-5, torch.float16: 2e-3}


def _coeff_args(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, 2 * N + N * N, generator=g) * 30
    alpha = tuple(torch.rand(1, generator=g) for _ in range(3))
    bias = (torch.randn(N, generator=g), torch.randn(N, generator=g),
            torch.randn(N * N, generator=g))  # fmt: skip
    return logits, alpha, bias


def _torch_coeffs(logits, alpha, bias, scale, iters, eps):
    l_pre, l_post, l_res = logits[:, :N], logits[:, N : 2 * N], logits[:, 2 * N :]
    return (torch.sigmoid(alpha[0] * scale * l_pre + bias[0]),
            2.0 * torch.sigmoid(alpha[1] * scale * l_post + bias[1]),
            mhc.sinkhorn((alpha[2] * scale * l_res + bias[2]).reshape(-1, N, N), iters, eps))


def _perm(t: int) -> torch.Tensor:
    return torch.randperm(t, generator=torch.Generator().manual_seed(t))


def test_coeffs_equal_the_definition_and_are_row_invariant():
    logits, alpha, bias = _coeff_args(1)
    scale = 1.0 / math.sqrt(N * 3072)
    got = triton_mhc.mhc_coeffs(logits, alpha, bias, N, scale, 20, 1e-12)
    want = _torch_coeffs(logits.double(), [a.double() for a in alpha],
                         [b.double() for b in bias], scale, 20, 1e-12)  # fmt: skip
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        assert torch.allclose(g.double(), w, rtol=1e-5, atol=1e-6)
    p = _perm(T)
    moved = triton_mhc.mhc_coeffs(logits[p], alpha, bias, N, scale, 20, 1e-12)
    alone = triton_mhc.mhc_coeffs(logits[5:6], alpha, bias, N, scale, 20, 1e-12)
    for full, m, a in zip(got, moved, alone):
        assert torch.equal(m, full[p])
        assert torch.equal(a, full[5:6])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_input_and_update_equal_the_definition_and_are_row_invariant(dtype):
    g = torch.Generator().manual_seed(2)
    state = torch.randn(T, N, C, generator=g).to(dtype)
    y = torch.randn(T, C, generator=g).to(dtype)
    mix = mhc.MHCMix(torch.rand(T, N, generator=g), 2 * torch.rand(T, N, generator=g),
                     torch.rand(T, N, N, generator=g))  # fmt: skip
    u = triton_mhc.mhc_input(state, mix.h_pre, dtype)
    s = triton_mhc.mhc_update(state, mix.h_res, mix.h_post, y, dtype)
    assert u.dtype == dtype and s.dtype == dtype and s.shape == state.shape
    want_u = mhc.mhc_input(state.float(), mix)
    want_s = mhc.mhc_update(state.float(), mix, y.float())
    assert torch.allclose(u.float(), want_u, rtol=TOL[dtype], atol=TOL[dtype])
    assert torch.allclose(s.float(), want_s, rtol=TOL[dtype], atol=TOL[dtype])
    p = _perm(T)
    pm = mhc.MHCMix(mix.h_pre[p], mix.h_post[p], mix.h_res[p])
    assert torch.equal(triton_mhc.mhc_input(state[p], pm.h_pre, dtype), u[p])
    assert torch.equal(triton_mhc.mhc_update(state[p], pm.h_res, pm.h_post, y[p], dtype), s[p])
    for a, b in ((3, 4), (16, 37), (1, 20)):  # batches resized, rows at other offsets
        assert torch.equal(triton_mhc.mhc_input(state[a:b], mix.h_pre[a:b], dtype), u[a:b])
        got = triton_mhc.mhc_update(state[a:b], mix.h_res[a:b], mix.h_post[a:b], y[a:b], dtype)
        assert torch.equal(got, s[a:b])


def test_layer_functions_route_to_the_kernels_where_use_triton_says(monkeypatch):
    """mhc_mix / mhc_input / mhc_update take the kernels on CUDA; CPU keeps the definition."""
    g = torch.Generator().manual_seed(3)
    state = torch.randn(9, N, 16, generator=g)
    args = (torch.randn(N * 16, generator=g) * 0.1, torch.randn(N * 16, 2 * N + N * N, generator=g),
            tuple(torch.rand(1, generator=g) for _ in range(3)),
            (torch.randn(N, generator=g), torch.randn(N, generator=g), torch.randn(N * N, generator=g)))  # fmt: skip
    y = torch.randn(9, 16, generator=g)
    cpu_mix = mhc.mhc_mix(state, *args, iters=20, eps=1e-12, norm_eps=1e-6)
    cpu = (mhc.mhc_input(state, cpu_mix), mhc.mhc_update(state, cpu_mix, y))
    monkeypatch.setattr(triton_runtime, "use_triton", lambda t: True)
    mix = mhc.mhc_mix(state, *args, iters=20, eps=1e-12, norm_eps=1e-6)
    gpu = (mhc.mhc_input(state, mix), mhc.mhc_update(state, mix, y))
    assert torch.equal(gpu[0], triton_mhc.mhc_input(state, mix.h_pre, torch.float32))
    assert torch.equal(gpu[1], triton_mhc.mhc_update(state, mix.h_res, mix.h_post, y,
                                                     torch.float32))  # fmt: skip
    for name in ("h_pre", "h_post", "h_res"):
        assert torch.allclose(getattr(mix, name), getattr(cpu_mix, name), rtol=1e-4, atol=1e-5)
    for got, want in zip(gpu, cpu):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)
