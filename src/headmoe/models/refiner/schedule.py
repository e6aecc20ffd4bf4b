"""The refiner's communication schedule (`headmoe.distributed.schedule`): which collectives
one refiner forward issues on a rank, computed from the config, the topology and the SP
token counts only. The model executes and checks it; the planner prices it
(`headmoe.planner.predict.refiner_counters`) with the same byte rule as MAGI-2's.

Per layer with SP > 1: one Ulysses exchange in carrying q, k and v side by side (each
rank's `sp_heads` query heads and `sp_kv_heads` KV heads, D wide) and one back (Hq heads,
D wide); at the end the all-gather of the fp32 video output rows. No MoE.
"""

from __future__ import annotations

from headmoe.distributed.schedule import Collective, Exchange, ForwardSchedule
from headmoe.distributed.sharding import sp_heads, sp_kv_heads
from headmoe.distributed.topology import Coords, Topology
from headmoe.models.refiner.config import Magi2RefinerConfig


def refiner_schedule(
    config: Magi2RefinerConfig, topo: Topology, coords: Coords, counts: tuple[int, ...]
) -> ForwardSchedule:
    """Every collective of one refiner forward on the rank at `coords`, whose SP group
    splits the packed rows as `counts` (SP order)."""
    sp, out = topo.sp, []
    hq, d = config.num_attention_heads, config.head_dim
    fused = sp * (sp_heads(hq, sp)[1] + 2 * sp_kv_heads(hq, config.num_query_groups, sp))

    def over_sp(kind: Exchange, layer: int | None, heads: int, width: int) -> Collective:
        return Collective(kind, "sp", layer, counts, coords.sp, None, heads, width,
                          fp32=kind == Exchange.SP_OUTPUT_GATHER)

    if sp > 1 and sum(counts) > 0:
        for layer in range(config.num_layers):
            out.append(over_sp(Exchange.ULYSSES_IN, layer, fused, d))
            out.append(over_sp(Exchange.ULYSSES_OUT, layer, hq, d))
    if sp > 1:
        out.append(over_sp(Exchange.SP_OUTPUT_GATHER, None, 1, config.video_in_channels))
    return ForwardSchedule(tuple(out), None, 0)
