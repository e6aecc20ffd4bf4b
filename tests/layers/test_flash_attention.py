"""The flash path's maths on CPU: the sink from the LSE (`out * sigmoid(lse - s)`) against the
sink definition (one more key with logit s and a zero value), the wrapper with stand-in
backends (the math definition, and one that pads its LSE per segment as some backends do),
and the `--attention` rule with its proof record."""

import pytest
import torch

from headmoe.layers import flash_attention as fa
from headmoe.layers.attention import segment_attention


def _sink_definition(qkv, segments, sinks, scale):
    """fp64: the sink as an extra key with logit `sinks[h]` and a zero value, per segment."""
    outs = []
    for a, b in segments:
        if b == a:
            continue
        q, k, v = (qkv[a:b, i].double() for i in range(3))
        s = torch.einsum("qhd,khd->hqk", q, k) * scale
        s = torch.cat([s, sinks.double()[:, None, None].expand(-1, b - a, 1)], dim=-1)
        p = torch.softmax(s, dim=-1)[..., :-1]
        outs.append(torch.einsum("hqk,khd->qhd", p, v))
    return torch.cat(outs)


def _random_case(seed):
    g = torch.Generator().manual_seed(seed)
    h = int(torch.randint(1, 5, (1,), generator=g))
    d = int(torch.randint(1, 5, (1,), generator=g)) * 8
    lengths = torch.randint(0, 23, (int(torch.randint(1, 5, (1,), generator=g)),), generator=g)
    lengths[0] = max(int(lengths[0]), 1)  # at least one non-empty segment
    bounds = [0, *torch.cumsum(lengths, 0).tolist()]
    segments = list(zip(bounds, bounds[1:]))
    qkv = torch.randn(bounds[-1], 3, h, d, generator=g, dtype=torch.float64) * 2
    sinks = (torch.randn(h, generator=g) * 4).float()
    return qkv, segments, sinks, d**-0.5


@pytest.mark.parametrize("seed", range(12))
def test_sink_from_the_lse_equals_the_definition_fp64(seed):
    qkv, segments, sinks, scale = _random_case(seed)
    want = _sink_definition(qkv, segments, sinks, scale)
    got = fa.flash_segment_attention(qkv, segments, sinks, scale, backend=fa.math_backend)
    assert got.dtype == torch.float64  # apply_sink is fp32: agreement at fp32 rounding
    assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("seed", range(12, 18))
def test_sink_from_the_lse_fp32_against_the_torch_path(seed):
    """fp32 through the stand-in backend against `segment_attention`'s CPU path (the sink as a
    zero key under SDPA's math), and both against the fp64 definition."""
    qkv, segments, sinks, scale = _random_case(seed)
    qkv32 = qkv.float()
    want = _sink_definition(qkv32, segments, sinks, scale)
    got = fa.flash_segment_attention(qkv32, segments, sinks, scale, backend=fa.math_backend)
    ref = segment_attention(qkv32, segments, sinks, scale)
    assert got.dtype == torch.float32 and got.shape == ref.shape
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5)
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5)


def _padded_lse_backend(q, k, v, bounds, scale):
    """The math backend, its LSE returned `[S, h, max_len, 1]`, zero-padded (a padded
    backend's layout): the wrapper must cut each segment's rows back out."""
    out, lse = fa.math_backend(q, k, v, bounds, scale)
    lens = [b - a for a, b in zip(bounds, bounds[1:])]
    padded = lse.new_zeros((len(lens), lse.shape[0], max(lens), 1))
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        padded[i, :, : b - a, 0] = lse[:, a:b]
    return out, padded


def test_a_padded_lse_gives_the_same_bits():
    qkv, segments, sinks, scale = _random_case(3)
    flat = fa.flash_segment_attention(qkv, segments, sinks, scale, backend=fa.math_backend)
    padded = fa.flash_segment_attention(qkv, segments, sinks, scale, backend=_padded_lse_backend)
    assert torch.equal(flat, padded)


def test_head_subsets_and_segments_through_the_wrapper():
    """Rows of a head subset, or of a segment alone, through the stand-in backend equal the
    rows of the whole call (the wrapper takes each head's sink and each segment's keys).
    At fp32 rounding, not bits: CPU sigmoid's bits depend on the vector tail a value falls
    in; bits over head subsets are the device probe's (benchmarks/gpu_check.py section d)."""
    scale = 0.25
    qkv = torch.randn(40, 3, 4, 16, dtype=torch.float64)
    sinks = torch.randn(4)
    segs = [(0, 25), (25, 25), (25, 40)]
    full = fa.flash_segment_attention(qkv, segs, sinks, scale, backend=fa.math_backend)
    sub = fa.flash_segment_attention(qkv[:, :, 1:3], segs, sinks[1:3], scale,
                                     backend=fa.math_backend)
    assert torch.allclose(sub, full[:, 1:3], rtol=1e-6, atol=0)
    alone = fa.flash_segment_attention(qkv[25:], [(0, 15)], sinks, scale, backend=fa.math_backend)
    assert torch.allclose(alone, full[25:], rtol=1e-6, atol=0)


def test_flash_path_on_cpu_is_the_torch_path():
    """`path="flash"` where the backends do not run (CPU tensors) is the default path."""
    qkv, segments, sinks, scale = _random_case(7)
    qkv = qkv.float()
    assert not fa.flash_supported(qkv[:, 0])
    assert torch.equal(segment_attention(qkv, segments, sinks, scale, path="flash"),
                       segment_attention(qkv, segments, sinks, scale))


def test_segments_must_cover_the_sequence():
    qkv = torch.zeros(10, 3, 1, 8)
    for bad in ([(0, 4)], [(0, 4), (5, 10)], [(0, 6), (4, 10)]):
        with pytest.raises(ValueError, match="segments must cover"):
            fa.flash_segment_attention(qkv, bad, torch.zeros(1), 1.0, backend=fa.math_backend)
    assert fa.segment_bounds([(0, 0), (0, 4), (4, 10)], 10) == [0, 4, 10]


def test_attention_choice_and_the_proof_record(tmp_path):
    assert fa.resolve_attention("auto", "cpu", tmp_path) == "triton"
    assert fa.resolve_attention("triton", "cuda", tmp_path) == "triton"
    assert fa.resolve_attention("flash", "cuda", tmp_path) == "flash"
    with pytest.raises(ValueError, match="attention=flash needs CUDA ranks"):
        fa.resolve_attention("flash", "cpu", tmp_path)
    with pytest.raises(ValueError, match="attention must be one of"):
        fa.resolve_attention("fast", "cuda", tmp_path)
    key = fa.proof_key()
    assert fa.resolve_attention("auto", "cuda", tmp_path) == "triton"  # no record yet
    fa.write_proof(tmp_path, "another device | flash", True, "")
    assert fa.resolve_attention("auto", "cuda", tmp_path) == "triton"  # not this stack
    fa.write_proof(tmp_path, key, False, "3 rows differ")
    assert fa.resolve_attention("auto", "cuda", tmp_path) == "triton"  # probe failed
    fa.write_proof(tmp_path, key, True, "0 rows differ")
    assert fa.resolve_attention("auto", "cuda", tmp_path) == "flash"
    assert fa.read_proof(tmp_path, "another device | flash")  # other keys kept
    fa.proof_path(tmp_path).write_text("{not json")
    assert fa.resolve_attention("auto", "cuda", tmp_path) == "triton"


@pytest.mark.parametrize("name", fa.FLASH_BACKENDS)
def test_the_backends_calls_fit_torchs_schemas(name):
    """The flash backends' torch ops called on meta tensors (their meta kernels check the
    arguments and give the output shapes): out `[L, h, D]` bf16, LSE read as `[h, L]` fp32,
    through the wrapper too."""
    qkv = torch.empty(100, 3, 3, 128, device="meta", dtype=torch.bfloat16)
    q = qkv[:, 0]
    out, lse = fa.BACKENDS[name](q, q, q, [0, 60, 100], 0.1)
    assert out.shape == (100, 3, 128) and out.dtype == torch.bfloat16
    assert fa._lse_rows(lse, [0, 60, 100]).shape == (3, 100)
    sinks = torch.empty(3, device="meta")
    got = fa.flash_segment_attention(qkv, [(0, 60), (60, 100)], sinks, 0.1, fa.BACKENDS[name])
    assert got.shape == (100, 3, 128) and got.dtype == torch.bfloat16
