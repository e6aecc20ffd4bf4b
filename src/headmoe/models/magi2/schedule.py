"""The MAGI-2 transformer's communication schedule (`headmoe.distributed.schedule`): which
collectives one forward issues on a rank, computed from the config, the topology and the
SP token counts only. The model executes it; the planner predicts from it."""

from __future__ import annotations

from typing import TypedDict

from headmoe.distributed.schedule import Collective, Exchange, ForwardSchedule
from headmoe.distributed.sharding import DispatchPlan, HeadShard, head_shard
from headmoe.distributed.topology import Coords, Topology
from headmoe.models.magi2.config import Magi2Config
from headmoe.moe.layer import moe_dispatch


class _Group(TypedDict):
    """The `Collective` fields one exchange group shares (its axis, counts and rank)."""

    axis: str
    token_counts: tuple[int, ...]
    rank: int
    replica_counts: tuple[tuple[int, ...], ...] | None


class _MoeGroup(_Group):
    """`_Group` plus the MoE rows' heads and width."""

    heads: int
    width: int


def forward_schedule(
    config: Magi2Config, topo: Topology, coords: Coords, counts: tuple[int, ...]
) -> ForwardSchedule:
    """Every collective of one forward on the rank at `coords`, whose SP group splits the
    packed sequence as `counts` (SP order)."""
    sp, out = topo.sp, list[Collective]()
    uly = _Group(axis="sp", token_counts=counts, rank=coords.sp, replica_counts=None)
    hq, d = config.num_attention_heads, config.head_dim
    e = topo.expert_parallel_size
    shard = head_shard(config.moe_num_heads, e, coords.ep)
    dispatch = None
    if config.moe_layer_ids:
        dispatch = moe_dispatch(topo.config, coords, e, counts)
    moe_group = 1 if dispatch is None else len(dispatch.token_counts)
    moe = _MoeGroup(axis=dispatch.axis if dispatch else "ep",
               token_counts=dispatch.token_counts if dispatch else counts,
               rank=dispatch.rank if dispatch else 0,
               replica_counts=dispatch.replica_counts if dispatch else None,
               heads=shard.padded_heads, width=config.moe_head_dim)
    total, moe_total = sum(counts), sum(moe["token_counts"])
    for layer in range(config.num_layers):
        if sp > 1 and total:
            out.append(Collective(Exchange.ULYSSES_IN, layer=layer, heads=hq, width=3 * d, **uly))
            out.append(Collective(Exchange.ULYSSES_OUT, layer=layer, heads=hq, width=d, **uly))
        if layer in config.moe_layer_ids and moe_group > 1 and moe_total:
            out.append(Collective(Exchange.MOE_SCATTER, layer=layer, **moe))
            out.append(Collective(Exchange.MOE_GATHER, layer=layer, **moe))
    if sp > 1:
        out.append(Collective(Exchange.SP_OUTPUT_GATHER, layer=None, heads=1,
                              width=config.out_width,
                              fp32=True, **uly))
    return ForwardSchedule(tuple(out), dispatch, _moe_rows(dispatch, shard, counts, coords))


def _moe_rows(dispatch: DispatchPlan | None, shard: HeadShard, counts: tuple[int, ...],
              coords: Coords) -> int:
    """(token, real head) rows of one MoE layer call on this rank."""
    if dispatch is None:
        return 0
    if len(counts) == 1:
        return counts[0] * shard.real_heads
    return dispatch.layout.owned_tokens * shard.real_heads
