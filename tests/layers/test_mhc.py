"""mHC: Sinkhorn, the stream update against einsum, row independence."""

import math

import torch

from headmoe.layers.mhc import mhc_input, mhc_mix, mhc_update, sinkhorn
from headmoe.layers.norms import rms_norm


def _params(n, c, g):
    phi = torch.randn(n * c, 2 * n + n * n, generator=g)
    alpha = tuple(torch.full((1,), a) for a in (0.7, 0.4, 0.9))
    bias = (torch.randn(n, generator=g), torch.randn(n, generator=g),
            torch.randn(n * n, generator=g))
    return torch.randn(n * c, generator=g) * 0.1, phi, alpha, bias


def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(50, 4, 4, generator=torch.Generator().manual_seed(0))
    p = sinkhorn(logits, iters=60, eps=1e-12)
    assert torch.allclose(p.sum(-1), torch.ones(50, 4), atol=1e-5)
    assert torch.allclose(p.sum(-2), torch.ones(50, 4), atol=1e-3)


def test_mix_and_update_match_einsum_reference():
    g = torch.Generator().manual_seed(0)
    n, c = 4, 32
    state = torch.randn(9, n, c, generator=g)
    norm_w, phi, alpha, bias = _params(n, c, g)
    mix = mhc_mix(state, norm_w, phi, alpha, bias, iters=20, eps=1e-12, norm_eps=1e-6)
    logits = rms_norm(state.reshape(9, -1), norm_w) @ phi / math.sqrt(n * c)
    assert torch.allclose(mix.h_pre, torch.sigmoid(0.7 * logits[:, :n] + bias[0]), atol=1e-6)
    assert torch.allclose(mix.h_post, 2 * torch.sigmoid(0.4 * logits[:, n : 2 * n] + bias[1]),
                          atol=1e-6)
    y = torch.randn(9, c, generator=g)
    u = mhc_input(state, mix)
    assert torch.allclose(u, torch.einsum("ti,tic->tc", mix.h_pre, state), atol=1e-5)
    new = mhc_update(state, mix, y)
    ref = torch.einsum("tij,tjc->tic", mix.h_res, state) + mix.h_post[:, :, None] * y[:, None]
    assert torch.allclose(new, ref, atol=1e-5)


def test_rows_are_independent_bitwise():
    g = torch.Generator().manual_seed(2)
    n, c = 4, 48
    state = torch.randn(203, n, c, generator=g)
    y = torch.randn(203, c, generator=g)
    params = _params(n, c, g)

    def run(s, yy):
        mix = mhc_mix(s, *params, iters=20, eps=1e-12, norm_eps=1e-6)
        return mhc_input(s, mix), mhc_update(s, mix, yy)

    full_u, full_s = run(state, y)
    for a, b in ((0, 1), (5, 8), (100, 111), (7, 203)):
        u, s = run(state[a:b], y[a:b])
        assert torch.equal(u, full_u[a:b]) and torch.equal(s, full_s[a:b]), (a, b)
