"""The sharding rules (headmoe.distributed.sharding): golden tables and the construction
check that a MoE layer's loaded head shard is the one its exchanges deliver."""

import pytest

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext, plan_topology
from headmoe.distributed.sharding import (
    dispatch_plan,
    ep_coords,
    head_shard,
    sp_rows,
    sp_token_counts,
)
from headmoe.moe import MoEConfig, MultiHeadMoE


def test_sp_split_and_rows():
    assert sp_token_counts(10, 4) == (3, 3, 2, 2)
    assert [sp_rows((3, 3, 2, 2), r) for r in range(4)] == [(0, 3), (3, 6), (6, 8), (8, 10)]


def test_head_shards_golden():
    # SP8 EP8: 12 heads pad to 16, 2 per rank, ranks 6 and 7 padding only
    shards = [head_shard(12, 8, r) for r in range(8)]
    assert [(s.first, s.stop) for s in shards] == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10),
                                                   (10, 12), (12, 12), (12, 12)]
    assert shards[6].real_heads == 0 and shards[6].padded_heads == 16
    assert shards[6].describe() == "EP rank 6/8: padding only"
    # SP8 EP4: 3 heads per rank, no padding; rows are head * experts + expert
    assert head_shard(12, 4, 1).rows(256) == (768, 1536, 768)
    assert [ep_coords(s, 4) for s in (0, 3, 4, 5, 7)] == [(0, 0), (3, 0), (0, 1), (1, 1), (3, 1)]
    with pytest.raises(ValueError, match="ep_rank must be an int in \\[0, 4\\), got 4"):
        head_shard(12, 4, 4)


def test_dispatch_plan_delivers_the_ep_rank_shard():
    counts = (5, 4, 4, 4)
    for mode in ("ep_group", "sp_group"):
        for s in range(4):
            plan = dispatch_plan(mode, counts, s, 2, batch_invariant=True)
            assert plan.delivered_shard == ep_coords(s, 2)[0]
            assert plan.axis == ("ep" if mode == "ep_group" else "sp")
    assert dispatch_plan("ep_group", counts, 3, 2, True).token_counts == (4, 4)


def _moe(parallel, rank, shard=None):
    topo = plan_topology(parallel.world_size, parallel)
    ctx = ParallelContext(topology=topo, rank=rank)
    cfg = MoEConfig(hidden_size=48, num_heads=12, num_experts=4, top_k=2,
                    expert_intermediate_size=8)
    return MultiHeadMoE(cfg, ctx, shard=shard)


@pytest.mark.parametrize("exchange", ["ep_group", "sp_group"])
def test_wrong_ownership_fails_at_construction(exchange):
    pc = ParallelConfig(ulysses_degree=4, enable_expert_parallel=True, expert_parallel_size=2,
                        moe_exchange=exchange)
    assert _moe(pc, 0).shard == head_shard(12, 2, 0)
    assert _moe(pc, 3).shard == head_shard(12, 2, 1)
    with pytest.raises(ValueError) as err:
        _moe(pc, 0, shard=head_shard(12, 2, 1))  # EP rank 1's rows on SP rank 0
    msg = str(err.value)
    assert "would hold EP rank 1/2: heads 6..11" in msg
    assert "deliver EP rank 0/2: heads 0..5" in msg
