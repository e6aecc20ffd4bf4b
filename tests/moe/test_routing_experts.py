"""Routing and expert compute on one rank: against an independent float64 oracle, the
reference loop against the fast path, and bitwise batch invariance."""

import pytest
import torch

from headmoe.layers.matmul import MIN_ROWS
from headmoe.moe import MoEConfig, experts_grouped, experts_reference, route
from headmoe.moe.gemm import grouped_mm, grouped_mm_loop
from tests.moe.common import full_state, oracle

CFG = MoEConfig(hidden_size=64, num_heads=4, num_experts=8, top_k=2,
                expert_intermediate_size=32, route_scale=2.5)
ODD = MoEConfig(hidden_size=24, num_heads=4, num_experts=5, top_k=3,
                expert_intermediate_size=10)  # d=6, f=10: not multiples of 4 -> Python loop


def _weights(cfg, state, dtype):
    return [state[n].to(dtype) for n in ("W_gate", "W_up", "W_down")]


def _moe(cfg, state, x, experts_fn=experts_grouped):
    """Route + experts of every head: x `[T, hidden]` -> `[T, hidden]`."""
    z = x.view(x.shape[0], cfg.num_heads, cfg.head_dim)
    ids, w = route(z, state["gate"], state["router.expert_bias"], cfg.top_k, cfg.route_scale)
    return experts_fn(z, ids, w, *_weights(cfg, state, x.dtype)).reshape(x.shape)


def test_route_matches_oracle_and_breaks_ties_to_lowest_id():
    state = full_state(CFG, seed=1)
    x = torch.randn(20, CFG.hidden_size, generator=torch.Generator().manual_seed(2))
    ids, w = route(x.view(20, 4, 16), state["gate"], state["router.expert_bias"], 2, 2.5)
    _, expected = oracle(CFG, state, x, "router.expert_bias")
    assert torch.equal(ids, expected)
    assert torch.allclose(w.sum(-1), torch.full((20, 4), 2.5), rtol=1e-6)
    # ties: experts 1, 4, 6 of every head get the same gate row, so equal scores
    gate = state["gate"].clone().view(4, 8, 16)
    gate[:, 4] = gate[:, 6] = gate[:, 1] = gate[:, 1] * 0 + 10.0
    ids, _ = route(x.view(20, 4, 16).abs(), gate.view(32, 16), torch.zeros(32), 2, 1.0)
    assert torch.equal(ids, torch.tensor([1, 4]).expand(20, 4, 2))
    # the bias steers selection only: a huge bias on expert 7 picks it, weights stay unbiased
    bias = torch.zeros(32)
    bias.view(4, 8)[:, 7] = 100.0
    ids, w = route(x.view(20, 4, 16).abs(), gate.view(32, 16), bias, 2, 1.0)
    assert torch.equal(ids, torch.tensor([1, 7]).expand(20, 4, 2))
    s1 = torch.sigmoid((x.view(20, 4, 16).abs() * 10.0).sum(-1).double())
    s7 = torch.sigmoid(torch.einsum("thd,hd->th", x.view(20, 4, 16).abs().double(),
                                    gate[:, 7].double()))
    assert torch.allclose(w[..., 1].double(), s7 / (s1 + s7), rtol=1e-5)


@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["grouped", "loop"])
@pytest.mark.parametrize("fn", [experts_grouped, experts_reference], ids=["fast", "reference"])
def test_experts_match_float64_oracle(cfg, fn):
    state = full_state(cfg, seed=3)
    x = torch.randn(37, cfg.hidden_size, generator=torch.Generator().manual_seed(4))
    expected, _ = oracle(cfg, state, x, "router.expert_bias")
    out = _moe(cfg, state, x, fn)
    assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["grouped", "loop"])
def test_fast_path_equals_reference_loop(cfg, dtype):
    state = full_state(cfg, seed=5)
    x = torch.randn(300, cfg.hidden_size, generator=torch.Generator().manual_seed(6)).to(dtype)
    fast = _moe(cfg, state, x).float()
    ref = _moe(cfg, state, x, experts_reference).float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert torch.allclose(fast, ref, rtol=tol, atol=tol)


def test_grouped_mm_loop_equals_grouped_mm_bitwise():
    g = torch.Generator().manual_seed(7)
    a, b = torch.randn(90, 16, generator=g), torch.randn(5, 16, 24, generator=g)
    ends = torch.tensor([16, 16, 50, 74, 90], dtype=torch.int32)
    out = grouped_mm(a, b, ends)
    assert torch.equal(out, grouped_mm_loop(a, b, ends))
    assert torch.equal(out[16:50], a[16:50] @ b[2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["grouped", "loop"])
@pytest.mark.parametrize("fn", [experts_grouped, experts_reference], ids=["fast", "reference"])
def test_rows_do_not_depend_on_the_batch(cfg, fn, dtype):
    state = full_state(cfg, seed=8)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(96, cfg.hidden_size, generator=g).to(dtype)
    other = torch.randn(50, cfg.hidden_size, generator=g).to(dtype)
    full = _moe(cfg, state, x, fn)
    small_groups = set()
    for size in [*range(1, 25), 40, 63, 95]:
        idx = torch.randperm(96, generator=g)[:size]
        assert torch.equal(_moe(cfg, state, x[idx], fn), full[idx]), size
        z = x[idx].view(size, cfg.num_heads, cfg.head_dim)
        ids, _ = route(z, state["gate"], state["router.expert_bias"], cfg.top_k, 1.0)
        heads = torch.arange(cfg.num_heads).view(1, -1, 1) * cfg.num_experts
        small_groups |= set(torch.bincount((ids + heads).flatten()).tolist())  # group sizes
    assert set(range(1, MIN_ROWS)) <= small_groups  # experts saw every size 1..15
    perm = torch.randperm(96, generator=g)
    assert torch.equal(_moe(cfg, state, x[perm], fn), full[perm])
    both = _moe(cfg, state, torch.cat([other, x]), fn)
    assert torch.equal(both[50:], full)
    assert _moe(cfg, state, x[:0], fn).shape == (0, cfg.hidden_size)


def test_chunked_grouped_gemms_give_the_same_bits(monkeypatch):
    import headmoe.moe.experts as experts_mod

    state = full_state(CFG, seed=10)
    x = torch.randn(200, CFG.hidden_size, generator=torch.Generator().manual_seed(11))
    whole = _moe(CFG, state, x)  # one chunk
    for elements in (1, 32 * 40, 32 * 100):  # one group per chunk, a few groups, more
        monkeypatch.setattr(experts_mod, "CHUNK_ELEMENTS", elements)
        assert torch.equal(_moe(CFG, state, x), whole), elements


@pytest.mark.parametrize("cfg", [CFG, ODD], ids=["grouped", "loop"])
@pytest.mark.parametrize("fn", [experts_grouped, experts_reference], ids=["fast", "reference"])
def test_every_tensor_follows_the_input_device(cfg, fn):
    """On a GPU a tensor made without `device=` lands on the CPU and meets CUDA inputs.
    Simulated here: with "meta" as the default device such a tensor meets the CPU inputs
    and raises; tensors made on the inputs' device give the same bits as before."""
    state = full_state(cfg, seed=12)
    x = torch.randn(40, cfg.hidden_size, generator=torch.Generator().manual_seed(13))
    expected = _moe(cfg, state, x, fn)
    with torch.device("meta"):
        out = _moe(cfg, state, x, fn)
    assert out.device.type == "cpu" and torch.equal(out, expected)
