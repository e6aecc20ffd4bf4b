"""The sink attention Triton kernel under Triton's interpreter on CPU tensors (fp32/fp16):
against the torch path within tolerance, GQA, and bitwise invariance of a query row to the
other query rows, heads and segments of its call."""

import pytest
import torch

from headmoe.layers import triton_runtime
from headmoe.layers.attention import segment_attention, sink_attention
from headmoe.layers.triton_attention import (
    AttentionTiles,
    triton_segment_attention,
    triton_sink_attention,
)
from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpreted")]

#: small tiles: 50 rows are four query blocks and four key blocks, the last ones partial
TILES = AttentionTiles(block_m=16, block_n=16)
HQ, HKV, DIM, SCALE = 4, 2, 16, 0.3


def _qkv(length: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(length, HQ, DIM, generator=g)
    k = torch.randn(length, HKV, DIM, generator=g)
    v = torch.randn(length, HKV, DIM, generator=g)
    sinks = torch.randn(HQ, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), sinks


def _expand(t: torch.Tensor) -> torch.Tensor:
    """KV heads repeated for their query heads (query head j reads KV head j // 2)."""
    return t.repeat_interleave(HQ // HKV, dim=1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matches_torch_sink_attention_with_gqa(dtype):
    q, k, v, sinks = _qkv(50, seed=1, dtype=dtype)
    out = triton_sink_attention(q, k, v, sinks, SCALE, tiles=TILES)
    ref = sink_attention(q.float(), _expand(k).float(), _expand(v).float(), sinks, SCALE)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(out.float(), ref, rtol=tol, atol=tol)


def test_sink_takes_its_share_of_the_softmax():
    q, k, v, _ = _qkv(20, seed=2)
    big = torch.full((HQ,), 60.0)  # the sink takes almost all of the weight
    assert triton_sink_attention(q, k, v, big, SCALE, tiles=TILES).abs().max() < 1e-12
    none = torch.full((HQ,), float("-inf"))  # no sink: plain softmax attention
    plain = torch.softmax(torch.einsum("qhd,khd->hqk", q, _expand(k)) * SCALE, dim=-1)
    expected = torch.einsum("hqk,khd->qhd", plain, _expand(v))
    got = triton_sink_attention(q, k, v, none, SCALE, tiles=TILES)
    assert torch.allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_query_rows_are_invariant_to_their_call():
    """Sub-batches of query rows (slices and gathered rows), a subset of heads, and a
    segment packed after another give a row the same bits as the full call."""
    q, k, v, sinks = _qkv(50, seed=3)
    full = triton_sink_attention(q, k, v, sinks, SCALE, tiles=TILES)
    for a, b in ((0, 1), (7, 30), (33, 50)):
        part = triton_sink_attention(q[a:b], k, v, sinks, SCALE, tiles=TILES)
        assert torch.equal(part, full[a:b])
    idx = torch.randperm(50, generator=torch.Generator().manual_seed(4))[:21]
    assert torch.equal(triton_sink_attention(q[idx], k, v, sinks, SCALE, tiles=TILES), full[idx])
    heads = triton_sink_attention(q[:, 2:], k[:, 1:], v[:, 1:], sinks[2:], SCALE, tiles=TILES)
    assert torch.equal(heads, full[:, 2:])
    q0, k0, v0, _ = _qkv(19, seed=5)
    packed = triton_segment_attention(torch.cat([q0, q]), torch.cat([k0, k]), torch.cat([v0, v]),
                                      [(0, 19), (19, 69)], sinks, SCALE, tiles=TILES)  # fmt: skip
    assert torch.equal(packed[19:], full)
    assert torch.equal(packed[:19], triton_sink_attention(q0, k0, v0, sinks, SCALE, tiles=TILES))


def test_segment_attention_matches_torch_segments():
    q, k, v, sinks = _qkv(40, seed=6)
    segments = [(0, 23), (23, 23), (23, 40)]
    out = triton_segment_attention(q, k, v, segments, sinks, SCALE, tiles=TILES)
    qkv = torch.stack([q, _expand(k), _expand(v)], dim=1)
    ref = segment_attention(qkv, segments, sinks, SCALE)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_sink_attention_dispatches_where_use_triton_says(monkeypatch):
    q, k, v, sinks = _qkv(30, seed=8)
    k, v = _expand(k), _expand(v)
    ref = sink_attention(q, k, v, sinks, SCALE)
    odd = [t[..., :12].contiguous() for t in (q, k, v)]  # D=12: not a kernel head dim
    odd_ref = sink_attention(*odd, sinks, SCALE)
    assert not triton_runtime.use_triton(q)  # CPU tensors take SDPA
    calls = []
    monkeypatch.setattr(triton_runtime, "use_triton", lambda t: calls.append(t.shape) or True)
    out = sink_attention(q, k, v, sinks, SCALE)
    assert calls == [(30, HQ, DIM)]
    assert torch.equal(out, triton_sink_attention(q, k, v, sinks, SCALE))
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(sink_attention(*odd, sinks, SCALE), odd_ref)  # fell back to SDPA


def test_bad_arguments_raise_value_errors_naming_the_field():
    q, k, v, sinks = _qkv(8, seed=7)
    with pytest.raises(ValueError, match="q heads"):
        triton_sink_attention(q[:, :3], k, v, sinks[:3], SCALE)
    with pytest.raises(ValueError, match="k and v must be"):
        triton_sink_attention(q, k.half(), v, sinks, SCALE)
    with pytest.raises(ValueError, match="sinks"):
        triton_sink_attention(q, k, v, sinks.double(), SCALE)
    with pytest.raises(ValueError, match="head dim"):
        triton_sink_attention(q[..., :12], k[..., :12], v[..., :12], sinks, SCALE)
    with pytest.raises(ValueError, match="out must be"):
        triton_sink_attention(q, k, v, sinks, SCALE, out=torch.empty(8, HQ, DIM).half())
    with pytest.raises(ValueError, match="segments"):
        triton_segment_attention(q, k, v, [(0, 5)], sinks, SCALE)
    with pytest.raises(ValueError, match="block_n"):
        AttentionTiles(block_n=8)
