"""Multi-head MoE (MAGI-2 semantics): routing, batch-invariant experts, head-sharded EP."""

from headmoe.distributed.sharding import resolve_exchange
from headmoe.moe.checkpoint import moe_row_slice, read_moe_rows
from headmoe.moe.config import MoEConfig
from headmoe.moe.experts import experts_grouped, experts_reference
from headmoe.moe.layer import MultiHeadMoE, plan_dispatch
from headmoe.moe.routing import route

__all__ = [
    "MoEConfig",
    "MultiHeadMoE",
    "experts_grouped",
    "experts_reference",
    "moe_row_slice",
    "plan_dispatch",
    "read_moe_rows",
    "resolve_exchange",
    "route",
]
