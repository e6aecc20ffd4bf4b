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


def test_sink_from_the_lse_equals_the_sink_definition():
    """`out * sigmoid(lse - s)` on attention without the sink (SDPA math backend, and the
    LSE of the CPU flash kernel) equals `sink_attention` (the sink as an extra key)."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from headmoe.layers.attention import apply_sink, sink_attention

    g = torch.Generator().manual_seed(30)
    length, h, d = 37, 3, 16
    q, k, v = (torch.randn(length, h, d, generator=g) for _ in range(3))
    sinks = torch.randn(h, generator=g) * 3
    scale = d**-0.5
    want = sink_attention(q, k, v, sinks, scale)
    qh, kh, vh = (x.transpose(0, 1).unsqueeze(0).double() for x in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        plain = F.scaled_dot_product_attention(qh, kh, vh, scale=scale)[0].transpose(0, 1)
    lse = torch.logsumexp(qh[0] @ kh[0].transpose(1, 2) * scale, dim=-1).transpose(0, 1)
    got = apply_sink(plain, lse, sinks)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    out, lse32 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        *(x.float() for x in (qh, kh, vh)), scale=scale)
    got32 = apply_sink(out[0].transpose(0, 1), lse32[0].transpose(0, 1), sinks)
    assert torch.allclose(got32, want, rtol=1e-5, atol=1e-6)
