"""The FP8 E4M3 rule (`headmoe.moe.fp8`) and the CPU FP8 experts path
(`headmoe.moe.fp8_experts`): rounding and saturation as measured, exact re-quantization,
refusals by name, against a float64 oracle of the dequantized weights, bit equality with
the bf16 path given those weights, and bitwise batch invariance."""

import pytest
import torch

from headmoe.layers.matmul import MIN_ROWS
from headmoe.moe import MoEConfig, experts_grouped, route
from headmoe.moe.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    Fp8Weight,
    channel_scales,
    check_fp8_bytes,
    dequantize,
    quantize,
)
from headmoe.moe.fp8_experts import experts_fp8
from tests.moe.common import full_state, oracle

CFG = MoEConfig(hidden_size=64, num_heads=4, num_experts=8, top_k=2,
                expert_intermediate_size=32, route_scale=2.5)  # fmt: skip
ODD = MoEConfig(
    hidden_size=24, num_heads=4, num_experts=5, top_k=3, expert_intermediate_size=10
)  # fmt: skip  (d=6, f=10: padded features)
NAMES = ("W_gate", "W_up", "W_down")


def _fp8_state(cfg, seed):
    """A random checkpoint, its experts quantized, and the state with the dequantized ones."""
    state = full_state(cfg, seed=seed)
    fp8 = {n: quantize(n, state[n]) for n in NAMES}
    deq = dict(state, **{n: fp8[n].dequantize() for n in NAMES})
    return fp8, deq


def _moe(cfg, state, fp8, x):
    z = x.view(x.shape[0], cfg.num_heads, cfg.head_dim)
    ids, w = route(z, state["gate"], state["router.expert_bias"], cfg.top_k, cfg.route_scale)
    return experts_fp8(z, ids, w, *(fp8[n] for n in NAMES)).reshape(x.shape)


def test_torch_rounds_to_nearest_even_and_saturates():
    """What `quantize` relies on, measured on this torch (docs/fp8.md)."""
    x = torch.tensor([1 + 1 / 16, 1 + 3 / 16, 1 + 5 / 16, 2**-10, 3 * 2**-10, 449.0, 480.0,
                      1e4, -1e4, float("inf")])  # fmt: skip
    got = x.to(FP8_DTYPE).float().tolist()
    assert got == [1.0, 1.25, 1.25, 0.0, 2**-8, 448.0, 448.0, 448.0, -448.0, 448.0]
    assert FP8_MAX == 448.0


def test_scales_are_channel_amax_over_448_and_one_for_zero_channels():
    g = torch.Generator().manual_seed(1)
    w = torch.randn(3, 5, 4, generator=g).bfloat16()
    w[1, :, 2] = 0
    q = quantize("W_up", w)
    amax = w.float().abs().amax(dim=1)
    expected = torch.where(amax > 0, amax / 448.0, 1.0)
    assert torch.equal(q.scale, expected) and q.scale.dtype == torch.float32
    assert q.data.dtype == FP8_DTYPE and q.data.shape == w.shape
    assert float(q.scale[1, 2]) == 1.0 and not q.data[1, :, 2].float().any()
    # every channel's amax element maps to +-448 exactly
    assert torch.equal(q.data.float().abs().amax(dim=1)[amax > 0],
                       torch.full_like(amax[amax > 0], 448.0))  # fmt: skip
    # the per-channel error of round-to-nearest: at most half an E4M3 step (2**-4 relative)
    err = (q.dequantize() - w.float()).abs()
    assert bool((err <= w.float().abs() * 2**-4 + q.scale[:, None, :] * 2**-10).all())


def test_quantize_in_row_blocks_equals_the_whole_tensor_at_once(monkeypatch):
    """Rows quantize independently: any block size gives the same bytes (so does a head
    shard quantized alone)."""
    from headmoe.moe import fp8

    w = torch.randn(37, 8, 12, generator=torch.Generator().manual_seed(20)).bfloat16()
    whole = quantize("W_gate", w)
    for rows in (1, 5, 64):
        monkeypatch.setattr(fp8, "QUANTIZE_ROWS", rows)
        part = quantize("W_gate", w)
        assert torch.equal(part.data.view(torch.uint8), whole.data.view(torch.uint8))
        assert torch.equal(part.scale, whole.scale)
    shard = quantize("W_gate", w[10:20])
    assert torch.equal(shard.data.view(torch.uint8), whole.data[10:20].view(torch.uint8))


def test_quantizing_dequantized_values_gives_the_same_bytes_and_scales():
    g = torch.Generator().manual_seed(2)
    for w in (torch.randn(6, 64, 48, generator=g) * 3,
              torch.randn(4, 16, 8, generator=g).bfloat16() * 1e-3,
              torch.randn(4, 16, 8, generator=g).half() * 100):  # fmt: skip
        q = quantize("W_gate", w)
        again = quantize("W_gate", q.dequantize())
        assert torch.equal(again.data.view(torch.uint8), q.data.view(torch.uint8))
        assert torch.equal(again.scale, q.scale)


def test_dequantize_equals_torchs_float8_conversion_for_every_byte():
    """`dequantize` goes through fp16 bits; for all 254 non-NaN bytes (subnormals, -0,
    +-448) and scales across the fp32 range it gives `data.to(fp32) * scale` bit for bit."""
    data = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    data = data[(data & 0x7F) != 0x7F].view(torch.float8_e4m3fn)  # no NaN bytes
    scales = torch.tensor([1.0, 3.1e-5, 7.7e35, 1.2e-36, 0.123456789, 2.0**-20])
    q = data.view(1, -1, 1).expand(scales.numel(), -1, 1).contiguous()
    s = scales.view(-1, 1)
    got = dequantize(q, s)
    expected = q.to(torch.float32) * s[:, None, :]
    assert torch.equal(got, expected) and got.dtype == torch.float32
    assert torch.equal(got.signbit(), expected.signbit())


def test_scales_survive_re_quantization_for_every_fp32_amax_mantissa():
    """scale = amax/448; its channel's dequantized amax is 448*scale; (448*scale)/448
    must give scale back, for all 2**23 mantissas of one binade (powers of two scale the
    rest of the normal range exactly)."""
    amax = ((127 << 23) | torch.arange(1 << 23, dtype=torch.int32)).view(torch.float32)
    scale = amax / FP8_MAX
    assert torch.equal((FP8_MAX * scale) / FP8_MAX, scale)
    assert bool(((amax / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).float() == 448).all())


def test_nan_inf_and_bad_tensors_are_refused_by_name():
    w = torch.randn(2, 3, 4)
    w[1, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"layers\.5\.W_down: 1 NaN/Inf .*\(1, 2, 3\)"):
        quantize("layers.5.W_down", w)
    w[1, 2, 3] = float("-inf")
    with pytest.raises(ValueError, match=r"W_up: 1 NaN/Inf"):
        quantize("W_up", w)
    big = torch.randn(40, 3, 4)
    big[37, 1, 2] = float("inf")  # in the third block of QUANTIZE_ROWS rows
    with pytest.raises(
        ValueError, match=r"W_up: 1 NaN/Inf value\(s\) \(the first at index \(37, 1, 2\): inf"
    ):
        quantize("W_up", big)
    with pytest.raises(ValueError, match="W_gate: expected a 3-d tensor"):
        quantize("W_gate", torch.randn(3, 4))
    with pytest.raises(ValueError, match="W_gate: expected"):
        quantize("W_gate", torch.randn(2, 3, 4, dtype=torch.float64))
    tiny = torch.zeros(1, 2, 2)
    tiny[0, 0, 1] = 1e-40
    with pytest.raises(ValueError, match="W_up: row 0 channel 1 has amax"):
        channel_scales("W_up", tiny)
    q = quantize("W", torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="scale must be fp32 \\[2, 4\\]"):
        Fp8Weight(q.data, q.scale[:, :3])
    with pytest.raises(ValueError, match="data must be a 3-d"):
        Fp8Weight(q.data.float(), q.scale)
    with pytest.raises(ValueError, match="dequantize: scale"):
        dequantize(q.data, q.scale.double())
    nan = q.data.clone()
    nan.view(torch.uint8)[1, 0, 2] = 0xFF  # E4M3's NaN (it has no Inf)
    with pytest.raises(ValueError, match=r"W_up: 1 NaN byte\(s\) in FP8 data, the first at "
                       r"index \(1, 0, 2\)"):  # fmt: skip
        check_fp8_bytes("W_up", nan)
    check_fp8_bytes("W_up", q.data)  # quantize never writes one


@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["aligned", "padded"])
def test_fp8_experts_match_a_float64_oracle_of_the_dequantized_weights(cfg):
    fp8, deq = _fp8_state(cfg, seed=3)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    expected, _ = oracle(cfg, deq, x, "router.expert_bias")
    out = _moe(cfg, deq, fp8, x)
    rel = (out.double() - expected).norm() / expected.norm()
    assert float(rel) <= 1e-5
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["aligned", "padded"])
def test_fp8_experts_give_the_bits_of_the_grouped_path_on_dequantized_weights(cfg, dtype):
    fp8, deq = _fp8_state(cfg, seed=5)
    g = torch.Generator().manual_seed(6)
    z = torch.randn(300, cfg.num_heads, cfg.head_dim, generator=g).to(dtype)
    ids, w = route(z, deq["gate"], deq["router.expert_bias"], cfg.top_k, cfg.route_scale)
    out = experts_fp8(z, ids, w, *(fp8[n] for n in NAMES))
    assert out.dtype == dtype and out.shape == z.shape
    assert torch.equal(out, experts_grouped(z, ids, w, *(deq[n] for n in NAMES)))


@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["aligned", "padded"])
def test_fp8_rows_do_not_depend_on_the_batch(cfg):
    """The style of tests/moe/test_routing_experts.py: random sub-batches (sizes 1..24
    and more), a permutation and a concatenation give every token the same bits."""
    fp8, deq = _fp8_state(cfg, seed=8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(96, cfg.hidden_size, generator=g)
    other = torch.randn(50, cfg.hidden_size, generator=g)
    full = _moe(cfg, deq, fp8, x)
    sizes = set()
    for size in [*range(1, 25), 40, 63, 95]:
        idx = torch.randperm(96, generator=g)[:size]
        assert torch.equal(_moe(cfg, deq, fp8, x[idx]), full[idx]), size
        z = x[idx].view(size, cfg.num_heads, cfg.head_dim)
        ids, _ = route(z, deq["gate"], deq["router.expert_bias"], cfg.top_k, 1.0)
        heads = torch.arange(cfg.num_heads).view(1, -1, 1) * cfg.num_experts
        sizes |= set(torch.bincount((ids + heads).flatten()).tolist())
    assert set(range(1, MIN_ROWS)) <= sizes  # groups of every size 1..15 were seen
    perm = torch.randperm(96, generator=g)
    assert torch.equal(_moe(cfg, deq, fp8, x[perm]), full[perm])
    both = _moe(cfg, deq, fp8, torch.cat([other, x]))
    assert torch.equal(both[50:], full)
    assert _moe(cfg, deq, fp8, x[:0]).shape == (0, cfg.hidden_size)


def test_only_routed_blocks_are_dequantized_one_at_a_time(monkeypatch):
    fp8, deq = _fp8_state(CFG, seed=10)
    calls = []
    real = Fp8Weight.dequantize

    def spy(self, start=0, stop=None):
        calls.append(stop - start)
        return real(self, start, stop)

    monkeypatch.setattr(Fp8Weight, "dequantize", spy)
    x = torch.randn(3, CFG.hidden_size, generator=torch.Generator().manual_seed(11))
    _moe(CFG, deq, fp8, x)
    z = x.view(3, CFG.num_heads, CFG.head_dim)
    ids, _ = route(z, deq["gate"], deq["router.expert_bias"], CFG.top_k, 1.0)
    groups = len(set((ids + torch.arange(4).view(1, -1, 1) * 8).flatten().tolist()))
    assert calls == [1] * (3 * groups) and groups < CFG.num_heads * CFG.num_experts


def test_bad_fp8_expert_arguments_name_the_weight():
    fp8, deq = _fp8_state(CFG, seed=12)
    z = torch.randn(4, CFG.num_heads, CFG.head_dim)
    ids, w = route(z, deq["gate"], deq["router.expert_bias"], CFG.top_k, 1.0)
    wg, wu, wd = (fp8[n] for n in NAMES)
    with pytest.raises(ValueError, match="w_up must be an Fp8Weight"):
        experts_fp8(z, ids, w, wg, deq["W_up"], wd)
    with pytest.raises(ValueError, match="w_down must be FP8"):
        experts_fp8(z, ids, w, wg, wu, wu)


def test_the_fp8_format_plugs_into_the_layer_with_the_grouped_paths_bits():
    """`MultiHeadMoE(experts=Fp8Experts())` loaded with quantized tensors (full rows, as a
    checkpoint holds them) equals the bf16-format layer loaded with the dequantized ones."""
    from headmoe.moe import MultiHeadMoE
    from headmoe.moe.fp8_format import SCALE_SUFFIX, Fp8Experts

    cfg = MoEConfig(hidden_size=48, num_heads=3, num_experts=4, top_k=2,
                    expert_intermediate_size=32, route_scale=2.5)  # fmt: skip
    state = full_state(cfg, seed=21)
    fp8 = {n: quantize(n, state[n]) for n in NAMES}
    layer = MultiHeadMoE(cfg, experts=Fp8Experts())
    assert layer.W_gate.dtype == FP8_DTYPE and layer.W_down_scale.shape == (12, 16)
    q_state = dict(state, **{n: fp8[n].data for n in NAMES},
                   **{n + SCALE_SUFFIX: fp8[n].scale for n in NAMES})  # fmt: skip
    layer.load_state_dict(q_state)
    ref = MultiHeadMoE(cfg)
    ref.load_state_dict(dict(state, **{n: fp8[n].dequantize() for n in NAMES}))
    x = torch.randn(30, 48, generator=torch.Generator().manual_seed(22))
    assert torch.equal(layer(x), ref(x))
