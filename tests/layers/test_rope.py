"""3-D rotary embedding: tables, rotate-half convention, relative-position property."""

import math

import torch

from headmoe.layers.rope import apply_rope, rope_tables


def test_tables_match_hand_formula():
    coords = torch.tensor([[2.0, 3.0, 5.0]], dtype=torch.float64)
    cos, sin = rope_tables(coords, bands=2, theta=100.0, axis_scales=(1.0, 0.5, 2.0))
    angles = [2 * 1, 2 * 0.1, 1.5 * 1, 1.5 * 0.1, 10 * 1, 10 * 0.1]  # freqs 100^(-j/2)
    assert torch.allclose(cos[0], torch.tensor([math.cos(a) for a in angles]))
    assert torch.allclose(sin[0], torch.tensor([math.sin(a) for a in angles]))


def test_apply_rope_rotates_pairs_and_keeps_tail():
    x = torch.randn(3, 2, 16)
    coords = torch.tensor([[0.0, 0, 0], [1.0, 2, 3], [4.0, 0, 1]], dtype=torch.float64)
    cos, sin = rope_tables(coords, bands=2)
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[0], x[0])  # zero angles: identity (text tokens)
    assert torch.equal(out[..., 12:], x[..., 12:])
    for i in range(6):  # dim i pairs with dim i + 6
        z = torch.complex(x[..., i], x[..., i + 6]) * torch.polar(
            torch.ones(3, 1), torch.atan2(sin[:, i], cos[:, i])[:, None]
        )
        assert torch.allclose(out[..., i], z.real, atol=1e-6)
        assert torch.allclose(out[..., i + 6], z.imag, atol=1e-6)


def test_scores_depend_on_relative_position():
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)

    def score(pq, pk):
        cq, sq = rope_tables(torch.tensor([pq], dtype=torch.float64), bands=1)
        ck, sk = rope_tables(torch.tensor([pk], dtype=torch.float64), bands=1)
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    a = score([3.0, 1.0, 2.0], [1.0, 4.0, 0.0])
    b = score([5.0, 2.0, 7.0], [3.0, 5.0, 5.0])
    assert torch.allclose(a, b, atol=1e-5)
