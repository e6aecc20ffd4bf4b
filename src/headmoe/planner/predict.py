"""Per-rank predictions of one layout: exactly the events `Counters` records at run time.

For a model config, a request shape, a `ParallelConfig` and a rank, `forward_counters`
returns a `Counters` filled with what one transformer forward records on that rank: per
layer the fused Ulysses q/k/v exchange in and the output exchange back ("ulysses_in",
"ulysses_out"; SP > 1), per MoE layer the rows computed and the two MoE exchanges
("moe_scatter", "moe_gather"; EP group of more than one rank), and at the end the gather of
the output shards ("sp_output_gather"; SP > 1). It uses the runtime's own partition
functions (`sp_token_counts`, `HeadLayout`, `replica_token_counts`, the MoE layer's
exchange rule), so a prediction and a measurement can be compared with `==`.

`refiner_counters` does the same for one refiner forward, from the refiner's own
`refiner_schedule` and the same byte rule (`schedule_counters`).

Bytes of an all-to-all follow the counter definition: the blocks a rank sends to and
receives from *other* ranks; a group of one rank, or one holding no tokens, issues no
collective and records nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

import torch

from headmoe.config import ParallelConfig
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.counters import Counters
from headmoe.distributed.exchange import ExchangeWorkspace, HeadLayout, gathered_bytes
from headmoe.distributed.schedule import Collective, Exchange, ForwardSchedule
from headmoe.distributed.sharding import head_shard, sp_token_counts
from headmoe.distributed.topology import AXES, Topology, plan_topology
from headmoe.models.magi2.config import Magi2Config, validate_parallel
from headmoe.models.magi2.model import Magi2Layer, Magi2Transformer, MoEMLP
from headmoe.models.magi2.schedule import forward_schedule
from headmoe.models.refiner.config import Magi2RefinerConfig
from headmoe.models.refiner.config import validate_parallel as validate_refiner_parallel
from headmoe.models.refiner.schedule import refiner_schedule
from headmoe.models.streaming import slot_layout
from headmoe.moe.formats import DEFAULT_EXPERT_FORMAT, expert_format
from headmoe.moe.layer import moe_dispatch
from headmoe.planner.request import RequestShape


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _all_to_all(layout: HeadLayout, heads: int, width: int, nbytes: int,
                to_heads: bool) -> tuple[int, int] | None:
    """(bytes sent, bytes received) of one head exchange of `[tokens, heads, width]` elements
    of `nbytes` each over `layout` (None: no collective is issued). `to_heads`: token shards
    to head shards (scatter); otherwise back (gather)."""
    if layout.world_size == 1 or layout.total_tokens == 0:
        return None
    return layout.moved_bytes(heads // layout.shards * width * nbytes, to_heads)


def sequence_branches(parallel: ParallelConfig, cfg_rank: int) -> tuple[int, ...]:
    """The branches (0 = conditional, 1 = unconditional) an SP group packs: both with
    `cfg_parallel_size=1`, branch `cfg_rank` with 2."""
    return (0, 1) if parallel.cfg_parallel_size == 1 else (cfg_rank,)


def sequence_counts(request: RequestShape, parallel: ParallelConfig,
                    cfg_rank: int) -> tuple[int, ...]:
    """SP token counts of the sequence the SP group of CFG rank `cfg_rank` packs (the
    transformer's `sp_token_counts` of its branches' total length)."""
    length = sum(request.branch_tokens(b) for b in sequence_branches(parallel, cfg_rank))
    return sp_token_counts(length, parallel.ulysses_degree)


@dataclass(frozen=True)
class MoEPlacement:
    """One rank's part in a MoE layer: the dispatch `layout` (over the EP run or, with
    replicas, the SP group), the resolved exchange ("ep_group" / "sp_group"), the padded head
    count of the EP group, and the heads this rank owns (`owned_heads`, of which
    `real_heads` are real; padded heads are not computed)."""

    layout: HeadLayout
    exchange: str
    padded_heads: int
    owned_heads: int
    real_heads: int

    @property
    def rows(self) -> int:
        """(token, real head) rows computed per MoE layer call."""
        return self.layout.owned_tokens * self.real_heads


def moe_placement(model: Magi2Config, topo: Topology, rank: int,
                  counts: tuple[int, ...]) -> MoEPlacement:
    """Where a MoE layer's rows go on `rank`, given the SP token counts `counts` (the MoE
    layer's own `moe_dispatch` and head shard)."""
    c = topo.coords(rank)
    e = topo.expert_parallel_size
    dispatch = moe_dispatch(topo.config, c, e, counts)
    axis, layout = dispatch.axis, dispatch.layout
    shard = head_shard(model.moe_num_heads, e, c.ep)
    return MoEPlacement(layout, f"{axis}_group", shard.padded_heads, shard.per_rank,
                        shard.real_heads)


def forward_counters(model: Magi2Config, request: RequestShape, parallel: ParallelConfig,
                     rank: int, dtype: torch.dtype = torch.float32) -> Counters:
    """The `Counters` one `Magi2Transformer.forward` records on `rank` (moe_rows per MoE
    layer call, exchanges in call order), for a transformer built with `dtype` (the dtype
    of its linears, experts and exchanged activations): the bytes of every collective of
    the model's own `forward_schedule`."""
    topo = layout_topology(model, parallel)
    c = topo.coords(rank)
    counts = sequence_counts(request, parallel, c.cfg)
    schedule = forward_schedule(model, topo, c, counts)
    return schedule_counters(schedule, model.num_layers, model.moe_layer_ids, dtype)


def refiner_counters(config: Magi2RefinerConfig, num_tokens: int, parallel: ParallelConfig,
                     rank: int, dtype: torch.dtype = torch.float32) -> Counters:
    """The `Counters` one `Magi2Refiner.forward` of `num_tokens` packed rows (video and
    text) records on `rank`, for a refiner built with `dtype`: the bytes of every
    collective of its `refiner_schedule` (no MoE rows)."""
    validate_refiner_parallel(config, parallel)
    topo = plan_topology(parallel.world_size, parallel)
    c = topo.coords(rank)
    schedule = refiner_schedule(config, topo, c,
                                sp_token_counts(num_tokens, parallel.ulysses_degree))
    return schedule_counters(schedule, config.num_layers, (), dtype)


def schedule_counters(schedule: ForwardSchedule, num_layers: int,
                      moe_layer_ids: Sequence[int], dtype: torch.dtype) -> Counters:
    """The `Counters` a forward executing `schedule` records: per layer its collectives
    (activations in `dtype`) and, on the layers of `moe_layer_ids`, the schedule's MoE
    rows; then the collectives after the layers (fp32 where the schedule says so)."""
    out = Counters()
    moe_calls = iter(moe_layer_ids)
    next_moe = next(moe_calls, None)
    for layer in range(num_layers):
        for step in (s for s in schedule.collectives if s.layer == layer):
            out.record_exchange(step.kind, *_collective_bytes(step, _element_size(dtype)))
        if layer == next_moe:
            out.record_moe_rows(schedule.moe_rows)
            next_moe = next(moe_calls, None)
    for step in (s for s in schedule.collectives if s.layer is None):
        nbytes = _element_size(torch.float32 if step.fp32 else dtype)
        out.record_exchange(step.kind, *_collective_bytes(step, nbytes))
    return out


def _collective_bytes(step: Collective, nbytes: int) -> tuple[int, int]:
    """(bytes sent, bytes received) of one scheduled collective on its rank."""
    if step.kind == Exchange.SP_OUTPUT_GATHER:  # all-gather of shards padded to the largest
        moved = gathered_bytes(step.token_counts, step.width, nbytes)
        return moved, moved
    layout = step.layout
    to_heads = step.kind in (Exchange.ULYSSES_IN, Exchange.MOE_SCATTER)
    rec = _all_to_all(layout, step.heads, step.width, nbytes, to_heads)
    assert rec is not None, step  # the schedule lists issued collectives only
    return rec


def layout_topology(model: Magi2Config, parallel: ParallelConfig) -> Topology:
    """`plan_topology` of a layout after the model's own checks (`ValueError` naming the
    field)."""
    validate_parallel(model, parallel)
    return plan_topology(parallel.world_size, parallel)


def _context(model: Magi2Config, ep_size: int, ep_rank: int) -> ParallelContext:
    """A group-less context of EP rank `ep_rank` in an SP group of `ep_size` (for shapes)."""
    topo = layout_topology(model, ParallelConfig(ulysses_degree=ep_size))
    return ParallelContext(topology=topo, rank=ep_rank, _groups={a: None for a in AXES})


def _nbytes(module: torch.nn.Module, skip: str | None = None) -> int:
    return sum(t.numel() * t.element_size()
               for name, t in [*module.named_parameters(), *module.named_buffers()]
               if skip is None or skip not in name)


@cache
def _non_expert_bytes(model: Magi2Config, dtype: torch.dtype) -> int:
    with torch.device("meta"):
        net = Magi2Transformer(model, _context(model, 1, 0), dtype=dtype)
    return _nbytes(net, skip=".moe_mlp.")


@cache
def weight_bytes(model: Magi2Config, ep_size: int, ep_rank: int, dtype: torch.dtype,
                 experts: str = DEFAULT_EXPERT_FORMAT) -> tuple[int, int]:
    """(MoE expert bytes, all weight bytes) held by EP rank `ep_rank` of an EP group of
    `ep_size`: the parameters and buffers of the transformer's modules as built for that rank
    (on the meta device: no memory, no process group), the routed experts in the format
    named `experts` (`headmoe.moe.formats.EXPERT_FORMATS`: "fp8" registers 1-byte values
    and fp32 scales per (row, output channel)). Weights depend on the layout only through
    the EP degree and rank. Expert bytes are those of the `moe_mlp` modules (router gate,
    expert weights and scales including zero-padded heads, bias buffers) of every MoE layer."""
    with torch.device("meta"):
        moe = MoEMLP(model, dtype, _context(model, ep_size, ep_rank),
                     experts=expert_format(experts)).moe_mlp
    expert = len(model.moe_layer_ids) * _nbytes(moe)
    return expert, _non_expert_bytes(model, dtype) + expert


@cache
def layer_bytes(model: Magi2Config, ep_size: int, ep_rank: int, dtype: torch.dtype,
                experts: str = DEFAULT_EXPERT_FORMAT) -> tuple[tuple[int, int], ...]:
    """Per layer `(bytes its tensors hold, slot bytes they need)` on EP rank `ep_rank` of an
    EP group of `ep_size`, the routed experts in format `experts` (the modules as built, on
    the meta device; slot bytes by the streamer's own `slot_layout`)."""
    kinds = {}
    for i in range(model.num_layers):
        multimodal = i in model.multimodal_layers
        if multimodal not in kinds:
            with torch.device("meta"):
                layer = Magi2Layer(model, i, dtype, _context(model, ep_size, ep_rank),
                                   ExchangeWorkspace(), expert_format(experts))
            tensors = [(t.shape, t.dtype) for _, t in
                       [*layer.named_parameters(), *layer.named_buffers()]]
            kinds[multimodal] = (_nbytes(layer), slot_layout(tensors)[1])
    return tuple(kinds[i in model.multimodal_layers] for i in range(model.num_layers))


def expert_bytes_per_head(model: Magi2Config, dtype: torch.dtype,
                          experts: str = DEFAULT_EXPERT_FORMAT) -> int:
    """Bytes of one real MoE head's rows in one MoE layer (gate, experts in format
    `experts`, router biases)."""
    return weight_bytes(model, 1, 0, dtype, experts)[0] // max(len(model.moe_layer_ids), 1) // (
        model.moe_num_heads)
