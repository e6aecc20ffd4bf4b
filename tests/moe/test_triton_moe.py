"""The MoE Triton kernels under Triton's interpreter on CPU tensors (fp32/fp16: the 3.9.0
interpreter mis-reads bf16, which benchmarks/gpu_check.py covers on a device): against the
torch paths within tolerance, and bitwise batch invariance of every (token, head) row."""

import dataclasses

import pytest
import torch

from headmoe.layers import triton_runtime
from headmoe.moe import MoEConfig, MultiHeadMoE, experts_reference, route
from headmoe.moe.triton_moe import (
    MoETiles,
    experts_triton,
    group_schedule,
    route_triton,
)
from tests.triton_interp import interpreted  # noqa: F401  (sets TRITON_INTERPRET first)

pytestmark = [pytest.mark.triton, pytest.mark.usefixtures("interpreted")]

#: small tiles: groups of 1..70 rows span one to five tiles; f=48 and d=48 end mid-block
TILES = MoETiles(block_m=16, gate_n=32, gate_k=16, down_n=32, down_k=16, combine_m=16,
                 combine_d=32)  # fmt: skip
H, E, D, F, K = 2, 8, 48, 48, 2


def _weights(seed: int, dtype=torch.float32, h=H, e=E, d=D, f=F):
    g = torch.Generator().manual_seed(seed)
    wg = torch.randn(h * e, d, f, generator=g) / d**0.5
    wu = torch.randn(h * e, d, f, generator=g) / d**0.5
    wd = torch.randn(h * e, f, d, generator=g) / f**0.5
    return [w.to(dtype) for w in (wg, wu, wd)]


def _routed(n: int, seed: int, dtype=torch.float32):
    """z `[n, H, D]` and its routes; a skewed bias makes group sizes range widely."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, H, D, generator=g).to(dtype)
    gate = torch.randn(H * E, D, generator=g) / D**0.5
    bias = torch.linspace(0.6, -0.6, E).repeat(H)
    ids, w = route(z, gate, bias, K, 2.5)
    return z, ids, w


def _group_sizes(ids: torch.Tensor) -> set[int]:
    groups = (ids + torch.arange(ids.shape[1]).view(1, -1, 1) * E).reshape(-1)
    return {int(c) for c in torch.bincount(groups, minlength=H * E) if c}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_route_matches_torch_route(dtype):
    g = torch.Generator().manual_seed(1)
    h, e, d = 3, 20, 24  # E, d not multiples of the kernel blocks: masked columns and steps
    z = torch.randn(45, h, d, generator=g).to(dtype)
    gate, bias = torch.randn(h * e, d, generator=g) / 5, torch.randn(h * e, generator=g) * 0.1
    ids, w = route_triton(z, gate, bias, 3, 1.7)
    ref_ids, ref_w = route(z, gate, bias, 3, 1.7)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, ref_w, rtol=1e-6, atol=1e-7)


def test_route_ties_go_to_the_lowest_id_and_bias_selects_only():
    g = torch.Generator().manual_seed(2)
    z = torch.randn(20, 2, 16, generator=g).abs()
    gate = torch.randn(2, 8, 16, generator=g)
    gate[:, [1, 4, 6]] = 10.0  # equal rows: equal scores, the top three
    ids, _ = route_triton(z, gate.reshape(16, 16), torch.zeros(16), 2, 1.0)
    assert torch.equal(ids, torch.tensor([1, 4]).expand(20, 2, 2))
    bias = torch.zeros(2, 8)
    bias[:, 7] = 100.0
    ids, w = route_triton(z, gate.reshape(16, 16), bias.reshape(16), 2, 1.0)
    assert torch.equal(ids, torch.tensor([1, 7]).expand(20, 2, 2))
    s1 = torch.sigmoid((z * 10.0).sum(-1).double())
    s7 = torch.sigmoid(torch.einsum("thd,hd->th", z.double(), gate[:, 7].double()))
    assert torch.allclose(w[..., 1].double(), s7 / (s1 + s7), rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_experts_match_reference_loop(dtype):
    z, ids, w = _routed(90, seed=3, dtype=dtype)
    weights = _weights(4, dtype)
    out = experts_triton(z, ids, w, *weights, tiles=TILES)
    ref = experts_reference(z, ids, w, *weights)
    assert out.dtype == dtype and out.shape == z.shape
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert torch.allclose(out.float(), ref.float(), rtol=tol, atol=tol * ref.abs().max())


def test_experts_rows_are_batch_invariant():
    """Random sub-batches (in random order), a concatenation of two batches and the full
    batch give every row the same bits; the sub-batches give groups of 1 to >= 65 rows."""
    z, ids, w = _routed(140, seed=5)
    weights = _weights(6)
    full = experts_triton(z, ids, w, *weights, tiles=TILES)
    g = torch.Generator().manual_seed(7)
    sizes: set[int] = set()
    for n in (1, 3, 17, 40, 77, 110):
        idx = torch.randperm(140, generator=g)[:n]
        sizes |= _group_sizes(ids[idx])
        assert torch.equal(experts_triton(z[idx], ids[idx], w[idx], *weights, tiles=TILES),
                           full[idx])  # fmt: skip
    z2, ids2, w2 = _routed(30, seed=8)
    both = experts_triton(torch.cat([z2, z]), torch.cat([ids2, ids]), torch.cat([w2, w]),
                          *weights, tiles=TILES)  # fmt: skip
    assert torch.equal(both[30:], full)
    assert torch.equal(both[:30], experts_triton(z2, ids2, w2, *weights, tiles=TILES))
    assert 1 in sizes and max(sizes) >= 65 and len(sizes & {15, 16, 17, 32, 33}) >= 2


def test_experts_of_strided_heads_and_empty_batches():
    z, ids, w = _routed(25, seed=9)
    weights = _weights(10)
    wide = torch.cat([z, torch.randn(25, 1, D)], dim=1)[:, :H]  # strided like the EP owner
    assert not wide.is_contiguous()
    assert torch.equal(experts_triton(wide, ids, w, *weights, tiles=TILES),
                       experts_triton(z, ids, w, *weights, tiles=TILES))  # fmt: skip
    empty = experts_triton(z[:0], ids[:0], w[:0], *weights, tiles=TILES)
    assert empty.shape == (0, H, D)


def test_group_schedule_lays_groups_out_in_whole_tiles():
    route_group = torch.tensor([3, 0, 3, 3, 1, 3, 0, 3])  # groups 0: 2, 1: 1, 2: 0, 3: 5 routes
    tile_group, tile_rows, order, row = group_schedule(route_group, groups=4, block_m=2)
    assert tile_group.numel() == min(8, 4 + 4)  # the upper bound, not the 5 tiles used
    assert tile_group.tolist() == [0, 1, 3, 3, 3, 4, 4, 4]
    assert tile_rows.tolist() == [2, 1, 2, 2, 1, 0, 0, 0]
    assert order.tolist() == [1, 6, 4, 0, 2, 3, 5, 7]
    assert row.tolist() == [0, 1, 2, 4, 5, 6, 7, 8]


def test_layer_takes_the_triton_path_where_use_triton_says(monkeypatch):
    cfg = MoEConfig(hidden_size=128, num_heads=2, num_experts=4, top_k=2,
                    expert_intermediate_size=64, route_scale=2.5)  # d=64: the default tiles
    moe = MultiHeadMoE(cfg)
    g = torch.Generator().manual_seed(11)
    for p in (moe.gate, moe.W_gate, moe.W_up, moe.W_down):
        p.copy_(torch.randn(p.shape, generator=g) / 8)
    x = torch.randn(20, 128, generator=g)
    ref = moe(x)
    real = triton_runtime.use_triton
    assert not real(x)  # CPU tensors take the torch paths
    calls = []
    monkeypatch.setattr(triton_runtime, "use_triton", lambda t: calls.append(t.shape) or True)
    out = moe(x)
    assert calls == [(20, 2, 64)]
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_bad_arguments_raise_value_errors_naming_the_field():
    z, ids, w = _routed(5, seed=12)
    wg, wu, wd = _weights(13)
    with pytest.raises(ValueError, match="experts"):
        experts_triton(z, ids.int(), w, wg, wu, wd, tiles=TILES)
    with pytest.raises(ValueError, match="weights"):
        experts_triton(z, ids, w.double(), wg, wu, wd, tiles=TILES)
    with pytest.raises(ValueError, match="w_down"):
        experts_triton(z, ids, w, wg, wu, wd[:, :, :8], tiles=TILES)
    with pytest.raises(ValueError, match="w_up"):
        experts_triton(z, ids, w, wg, wu.half(), wd, tiles=TILES)
    with pytest.raises(ValueError, match="gate_k"):
        experts_triton(z, ids, w, wg, wu, wd, tiles=MoETiles(gate_k=32))
    with pytest.raises(ValueError, match="block_m"):
        MoETiles(block_m=24)
    with pytest.raises(ValueError, match="top_k"):
        route_triton(z, torch.zeros(H * E, D), torch.zeros(H * E), E + 1, 1.0)
    with pytest.raises(ValueError, match="expert_bias"):
        route_triton(z, torch.zeros(H * E, D), torch.zeros(E), 2, 1.0)
    with pytest.raises(ValueError, match="z must be on meta"):
        triton_runtime.check_tensors(object(), w=torch.zeros(1, device="meta"), z=z)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_runtime.check_tensors(object(), z=z)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_row_gather_gives_the_bits_of_the_offset_gather(dtype):
    """The gate/up kernel's two gathers (rows at `head*stride_h + token*stride_t`, and the
    former element offsets loaded from memory) read the same elements: equal bits, for a
    contiguous z and for heads strided inside a wider buffer (the EP owner's layout)."""
    z, ids, w = _routed(70, seed=14, dtype=dtype)
    weights = _weights(15, dtype)
    wide = torch.cat([z, torch.randn(70, 1, D).to(dtype)], dim=1)[:, :H]
    offsets = dataclasses.replace(TILES, row_gather=False)
    for zz in (z, wide):
        rows = experts_triton(zz, ids, w, *weights, tiles=TILES)
        assert torch.equal(rows, experts_triton(zz, ids, w, *weights, tiles=offsets))


def test_nan_rows_route_to_valid_experts_on_every_head():
    """A (token, head) whose router input is NaN gets experts 0..k-1 (torch `route` gives
    the same: NaN sorts first), never the out-of-range id E; on the last head that id
    would index past the group schedule. Every head, the last included, has a NaN row;
    the other rows keep their bits and the NaN rows come out NaN."""
    h, e, d, f, k = 3, 8, 32, 32, 2
    g = torch.Generator().manual_seed(16)
    z = torch.randn(20, h, d, generator=g)
    for t in range(h):
        z[t, t] = float("nan")  # one NaN row per head
    z[h] = float("nan")  # a token NaN on every head
    gate, bias = torch.randn(h * e, d, generator=g) / d**0.5, torch.linspace(0.5, -0.5, h * e)
    ids, w = route_triton(z, gate, bias, k, 2.5)
    assert int(ids.min()) >= 0 and int(ids.max()) < e
    assert torch.equal(ids, route(z, gate, bias, k, 2.5)[0])
    nan = torch.isnan(z).any(-1)  # [20, h]
    assert torch.equal(ids[nan], torch.arange(k).expand(int(nan.sum()), k))
    assert bool(torch.isnan(w[nan]).all()) and not bool(torch.isnan(w[~nan]).any())
    weights = _weights(17, h=h, e=e, d=d, f=f)
    tiles = MoETiles(block_m=16, gate_n=32, gate_k=16, down_n=32, down_k=16, combine_d=32)
    out = experts_triton(z, ids, w, *weights, tiles=tiles)
    assert bool(torch.isnan(out[nan]).all()) and not bool(torch.isnan(out[~nan]).any())
    clean = experts_triton(z[h + 1 :], ids[h + 1 :], w[h + 1 :], *weights, tiles=tiles)
    assert torch.equal(out[h + 1 :], clean)


def test_fused_expert_tile_equals_the_two_kernel_path():
    """The fused expert tile (gate, up, SwiGLU7 and down per tile, no hidden rows written)
    gives the two-kernel path's bits (same sums in the same order: d_expert chunks of
    down_k), whatever its tile height; its rows are invariant to moves and batch size."""
    z, ids, w = _routed(40, 40, torch.float16)
    weights = _weights(41, torch.float16)
    fused = dataclasses.replace(TILES, fused=True, fused_m=32)
    two = experts_triton(z, ids, w, *weights, tiles=dataclasses.replace(TILES, fused=False))
    got = experts_triton(z, ids, w, *weights, tiles=fused)
    assert torch.equal(got, two)
    p = torch.randperm(40, generator=torch.Generator().manual_seed(42))
    assert torch.equal(experts_triton(z[p], ids[p], w[p], *weights, tiles=fused), got[p])
    assert torch.equal(experts_triton(z[9:12], ids[9:12], w[9:12], *weights, tiles=fused),
                       got[9:12])  # fmt: skip
