"""MoEConfig, checkpoint slicing and the single-rank MultiHeadMoE layer."""

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.forward_plan import parallel_plan
from headmoe.distributed.topology import plan_topology
from headmoe.moe import (
    MoEConfig,
    MultiHeadMoE,
    moe_row_slice,
    plan_dispatch,
    read_moe_rows,
    resolve_exchange,
)
from headmoe.moe.experts import experts_reference
from tests.moe.common import full_state, oracle

CFG = MoEConfig(hidden_size=48, num_heads=3, num_experts=4, top_k=2,
                expert_intermediate_size=32, route_scale=4.9)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_size": 50}, "hidden_size=50"),
        ({"top_k": 5}, "top_k=5"),
        ({"num_experts": True}, "num_experts"),
        ({"route_scale": 0.0}, "route_scale"),
        ({"dtype": torch.float16}, "dtype"),
        ({"bias_from_ema": 1}, "bias_from_ema"),
    ],
)
def test_config_rejects_bad_fields_by_name(kwargs, field):
    base = {"hidden_size": 48, "num_heads": 3, "num_experts": 4, "top_k": 2,
            "expert_intermediate_size": 32}
    with pytest.raises(ValueError, match=field):
        MoEConfig(**{**base, **kwargs})
    assert CFG.head_dim == 16


def test_row_slices_match_the_issue_examples_and_tile_the_rows():
    assert moe_row_slice(3, 2, 1, 0) == (0, 6, 6)
    assert moe_row_slice(3, 2, 2, 0) == (0, 4, 4)
    assert moe_row_slice(3, 2, 2, 1) == (4, 6, 4)  # rows 4, 5 + two zero rows
    assert moe_row_slice(3, 2, 4, 0) == (0, 2, 2)
    assert moe_row_slice(3, 2, 4, 3) == (6, 6, 2)  # all zeros
    for heads, ep in [(12, 8), (6, 4), (12, 5), (7, 7)]:
        slices = [moe_row_slice(heads, 3, ep, r) for r in range(ep)]
        assert [s[0] for s in slices[1:]] == [s[1] for s in slices[:-1]]
        assert slices[0][0] == 0 and slices[-1][1] == heads * 3
        assert {s[2] for s in slices} == {-(-heads // ep) * 3}
    with pytest.raises(ValueError, match="ep_rank"):
        moe_row_slice(3, 2, 2, 2)


def _ep_layer(cfg, sp, ep, sp_rank):
    """A layer built for SP rank `sp_rank` of an SP`sp` x EP`ep` layout (no process groups:
    construction and loading are local)."""
    pc = ParallelConfig(ulysses_degree=sp, enable_expert_parallel=True, expert_parallel_size=ep)
    return MultiHeadMoE(cfg, ParallelContext(topology=plan_topology(sp, pc), rank=sp_rank))


@pytest.mark.parametrize("bias_from_ema", [True, False])
def test_full_checkpoint_loads_sliced_with_zero_rows_for_padded_heads(tmp_path, bias_from_ema):
    cfg = MoEConfig(hidden_size=48, num_heads=3, num_experts=2, top_k=1,
                    expert_intermediate_size=16, bias_from_ema=bias_from_ema)
    state = full_state(cfg, seed=1)
    bias = "router.expert_bias_ema" if bias_from_ema else "router.expert_bias"
    expected = {  # (sp, ep, rank) -> full rows, then zero rows
        (2, 2, 1): ([4, 5], 2), (4, 4, 0): ([0, 1], 0), (4, 4, 3): ([], 2), (4, 2, 2): ([0, 1, 2, 3], 0),
    }
    save_file({k: v.contiguous() for k, v in state.items()}, str(tmp_path / "moe.safetensors"))
    for (sp, ep, rank), (rows, zeros) in expected.items():
        layer = _ep_layer(cfg, sp, ep, rank)
        layer.load_state_dict(state)
        with safe_open(str(tmp_path / "moe.safetensors"), "pt") as f:
            read = {n: read_moe_rows(f, n, 3, 2, ep, rank % ep) for n in state}
        for name, full in state.items():
            src = bias if name == "router.expert_bias" else name
            want = torch.cat([state[src][rows], torch.zeros(zeros, *full.shape[1:])])
            got = layer.state_dict()[name]
            assert torch.equal(got.float(), want), (sp, ep, rank, name)
            assert torch.equal(read[name], torch.cat([full[rows], want[len(rows):]]))
        local = _ep_layer(cfg, sp, ep, rank)
        local.load_state_dict(read)  # local-shaped tensors load unchanged
        assert torch.equal(local.W_down, layer.W_down)
    with pytest.raises(ValueError, match=r"W_up has shape \(5, 16, 16\)"):
        _ep_layer(cfg, 2, 2, 0).load_state_dict({**state, "W_up": state["W_up"][:5]})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_single_rank_layer_matches_oracle_and_reference(dtype):
    cfg = MoEConfig(**{**CFG.__dict__, "dtype": dtype})
    state = full_state(cfg, seed=2)
    layer = MultiHeadMoE(cfg)
    layer.load_state_dict(state)
    assert layer.W_gate.dtype == dtype and layer.gate.dtype == torch.float32
    x = torch.randn(40, 48, generator=torch.Generator().manual_seed(3))
    out = layer(x.to(dtype))
    assert out.dtype == dtype and out.shape == (40, 48)
    if dtype == torch.float32:  # bias_from_ema: routing uses the EMA bias
        expected, _ = oracle(cfg, state, x, "router.expert_bias_ema")
        assert torch.allclose(out.double(), expected, rtol=1e-5, atol=1e-5)
    layer.expert_compute = experts_reference
    assert torch.allclose(layer(x.to(dtype)).float(), out.float(), rtol=1e-5, atol=1e-5)


def test_forward_validates_input_and_counts_rows():
    ctx = ParallelContext.single()
    layer = MultiHeadMoE(CFG, ctx)
    layer.load_state_dict(full_state(CFG))
    x = torch.randn(5, 48)
    assert torch.equal(layer(x, parallel_plan(ctx, (5,))), layer(x, parallel_plan(ctx, (5,))))
    assert ctx.counters.moe_rows == [15, 15]
    assert layer(x[:0]).shape == (0, 48)
    with pytest.raises(ValueError, match=r"token_counts\[0\]=4"):
        layer(x, parallel_plan(ctx, (4,)))
    with pytest.raises(ValueError, match="token_counts must be a tuple of 1"):
        layer(x, parallel_plan(ctx, (5, 0)))
    with pytest.raises(ValueError, match=r"x must have shape \[T, 48\]"):
        layer(x[:, :40])
    with pytest.raises(ValueError, match="x.dtype"):
        layer(x.bfloat16())


def test_exchange_rule_and_dispatch_plans():
    assert resolve_exchange("sp_group", 4, 4) == "ep_group"  # no replicas: same group
    assert resolve_exchange("sp_group", 4, 2) == "sp_group"
    assert resolve_exchange("auto", 4, 2) == "ep_group"
    assert resolve_exchange("auto", 4, 1) == "ep_group"
    assert plan_dispatch("auto", (7, 6, 5, 6), 3, 2, True)[0] == "ep"
    with pytest.raises(ValueError, match="moe_exchange"):
        resolve_exchange("ring", 4, 2)
    axis, layout = plan_dispatch("ep_group", (7, 6, 5, 6), 3, 2, True)
    assert (axis, layout.token_counts, layout.rank) == ("ep", (5, 6), 1)
    axis, layout = plan_dispatch("sp_group", (3, 0, 1, 6), 2, 2, True)
    assert axis == "sp" and layout.replicas == 2 and layout.owned_tokens == 5  # balanced 5 + 5
    # not batch-invariant: run totals (3 vs 7 differ -> back to the EP group; 6 and 6 stay)
    assert plan_dispatch("sp_group", (3, 0, 1, 6), 2, 2, False)[0] == "ep"
    axis, layout = plan_dispatch("sp_group", (3, 3, 1, 5), 0, 2, False)
    assert axis == "sp" and layout.owned_tokens == 6
