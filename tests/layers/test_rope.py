"""MAGI-2 rotary embedding: the coordinate rules of MAGI2.md 3.1, rotate-half convention,
relative-position property. (The golden `trace.rope` tables are checked bit for bit in
tests/models/test_magi2_golden.py.)"""

import math

import torch

from headmoe.layers.rope import apply_rope, default_bands, rope_table, split_table


def _coords(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_table_follows_the_coordinate_rules():
    bands = torch.tensor([1.0, 0.5])
    # video token (1, 2, 0) of a 3 x 4 x 5 grid with reference 5 x 4 x 9: t scaled by
    # (5-1)/(3-1) = 2, h centred at 1.5 (scale 1), w centred at 2, scale (9-1)/(5-1) = 2
    t = rope_table(_coords([1, 2, 0, 3, 4, 5, 5, 4, 9]), bands)
    p = [2 * 1, 2 * 0.5, 0.5 * 1, 0.5 * 0.5, -4 * 1, -4 * 0.5]
    want = torch.tensor([math.sin(a) for a in p] + [math.cos(a) for a in p])
    assert torch.allclose(t[0], want, atol=1e-6)
    # multi-token text (scale 0): no rotation; a one-token text sits at -1
    text = rope_table(_coords([-3, 0, 0, 3, 1, 1, 1, 1, 1], [-1, 0, 0, 1, 1, 1, 1, 1, 1]), bands)
    assert torch.equal(text[0], torch.tensor([0.0] * 6 + [1.0] * 6))
    assert text[1, 0] == math.sin(-1.0) and text[1, 2] == 0.0
    # audio token 12 of 25: compressed onto (25-1)//8 + 1 = 4 positions: 12 * 3/24 = 1.5
    audio = rope_table(_coords([12, 0, 0, 25, 1, 1, 4, 1, 1]), bands)
    assert torch.allclose(audio[0, :2], torch.tensor([math.sin(1.5), math.sin(0.75)]))


def test_default_bands():
    assert torch.allclose(default_bands(2), torch.tensor([1.0, 0.01]))
    assert default_bands(16).shape == (16,) and default_bands(16)[0] == 1.0


def test_apply_rope_rotates_pairs_and_keeps_tail():
    x = torch.randn(3, 2, 16)
    coords = _coords([0, 0, 0, 1, 1, 1, 1, 1, 1], [1, 2, 3, 4, 5, 6, 4, 5, 6],
                     [3, 0, 1, 4, 5, 6, 4, 5, 6])
    cos, sin = split_table(rope_table(coords, default_bands(2)))
    out = apply_rope(x, cos, sin)
    assert torch.equal(out[..., 12:], x[..., 12:])
    for i in range(6):  # dim i pairs with dim i + 6
        z = torch.complex(x[..., i], x[..., i + 6]) * torch.polar(
            torch.ones(3, 1), torch.atan2(sin[:, i], cos[:, i])[:, None]
        )
        assert torch.allclose(out[..., i], z.real, atol=1e-6)
        assert torch.allclose(out[..., i + 6], z.imag, atol=1e-6)


def test_scores_depend_on_relative_position():
    q, k = torch.randn(1, 1, 8), torch.randn(1, 1, 8)
    bands = default_bands(1)

    def score(pq, pk):
        cq, sq = split_table(rope_table(_coords(pq), bands))
        ck, sk = split_table(rope_table(_coords(pk), bands))
        return (apply_rope(q, cq, sq) * apply_rope(k, ck, sk)).sum()

    # scale 1 on every axis (size = reference), so only the difference of positions counts
    size = [9, 9, 9, 9, 9, 9]
    a = score([3.0, 1.0, 2.0, *size], [1.0, 4.0, 0.0, *size])
    b = score([5.0, 2.0, 7.0, *size], [3.0, 5.0, 5.0, *size])
    assert torch.allclose(a, b, atol=1e-5)
