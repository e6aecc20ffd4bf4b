"""The block-sparse range attention's CPU path and plan: a plan without text rows (the
release omits the tail rectangles), bad plans named, pair counts, and the CPU path equal to
one dense masked softmax."""

import pytest
import torch
import torch.nn.functional as F

from headmoe.layers.range_attention import RangePlan, range_attention_reference
from headmoe.models.refiner import Magi2RefinerConfig, attention_plan, pack_refiner

CONFIG = Magi2RefinerConfig(name="t", num_layers=1, multimodal_layers=(), hidden_size=64,
                            head_dim=16, num_query_groups=2, text_in_channels=8)


def _mask(plan: RangePlan) -> torch.Tensor:
    n = plan.num_tokens
    covered = torch.zeros(n, n, dtype=torch.int32)
    for r, (a, b) in enumerate(plan.q_tiles.tolist()):
        for ka, kb in plan.keys_of(r):
            covered[a:b, ka:kb] += 1
    assert int(covered.max()) == 1  # no cell twice
    return covered.bool()


def test_plan_without_text_is_the_block_rule():
    packed = pack_refiner(torch.zeros(48, 17, 9, 22), torch.zeros(0, 8), CONFIG)
    plan = attention_plan(packed)
    plan.validate()
    block = torch.zeros(packed.num_tokens, dtype=torch.int64)
    for b, (a, e) in enumerate(packed.block_ranges.tolist()):
        block[a:e] = b
    want = packed.grid.block_visible()[block][:, block]
    assert torch.equal(_mask(plan), want)
    assert plan.pairs() == int(want.sum())
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(packed.num_tokens, h, 16, generator=g) for h in (4, 2, 2))
    got = range_attention_reference(q, k, v, plan, 0.25)
    ref = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
        v.repeat_interleave(2, 1).transpose(0, 1), attn_mask=want, scale=0.25).transpose(0, 1)
    assert (got - ref).abs().max().item() <= 1e-6


def test_bad_plans_are_named():
    one = torch.tensor([[0, 4]])
    with pytest.raises(ValueError, match="q_tiles must cover"):
        RangePlan(torch.tensor([[0, 3]]), torch.tensor([0, 1]), one, 4).validate()
    with pytest.raises(ValueError, match="k_ranges must be non-empty ranges inside"):
        RangePlan(one, torch.tensor([0, 1]), torch.tensor([[2, 9]]), 4).validate()
    with pytest.raises(ValueError, match="k_offsets must rise"):
        RangePlan(one, torch.tensor([0, 0]), one, 4).validate()
