"""Sink attention: the formula, head and segment independence."""

import torch

from headmoe.layers.attention import segment_attention, sink_attention


def _reference(q, k, v, sinks, scale):
    s = torch.einsum("qhd,khd->hqk", q.double(), k.double()) * scale
    lse = torch.logsumexp(s, dim=-1, keepdim=True)
    out = torch.einsum("hqk,khd->qhd", torch.softmax(s, dim=-1), v.double())
    sig = sinks.double()[:, None, None]
    factor = torch.exp(lse - torch.logaddexp(lse, sig)).permute(1, 0, 2)
    return out * factor


def test_sink_matches_lse_formula():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(37, 6, 16, generator=g) for _ in range(3))
    sinks = torch.randn(6, generator=g) * 3
    out = sink_attention(q, k, v, sinks, 0.25)
    assert torch.allclose(out.double(), _reference(q, k, v, sinks, 0.25), atol=1e-5)
    # a very negative sink is no sink
    plain = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), scale=0.25
    ).transpose(0, 1)
    assert torch.allclose(sink_attention(q, k, v, torch.full((6,), -1e4), 0.25), plain,
                          atol=1e-6)


def test_head_subsets_and_segments_are_bit_identical():
    g = torch.Generator().manual_seed(1)
    for dtype in (torch.float32, torch.bfloat16):
        qkv = torch.randn(90, 3, 8, 16, generator=g).to(dtype)
        sinks = torch.randn(8, generator=g)
        segs = [(0, 61), (61, 90)]
        full = segment_attention(qkv, segs, sinks, 0.25)
        for a, b in ((0, 4), (4, 8), (2, 3)):
            assert torch.equal(segment_attention(qkv[:, :, a:b], segs, sinks[a:b], 0.25),
                               full[:, a:b])
        alone = segment_attention(qkv[61:], [(0, 29)], sinks, 0.25)
        assert torch.equal(alone, full[61:])
        # and the segments do not see each other
        joined = segment_attention(qkv, [(0, 90)], sinks, 0.25)
        assert not torch.allclose(joined[61:].float(), full[61:].float(), atol=1e-3)
