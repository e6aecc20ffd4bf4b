"""Summaries of every layout of a world for one request, and the recommended one."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

import torch

from headmoe.config import GIB, ParallelConfig, is_int
from headmoe.distributed.counters import Counters
from headmoe.distributed.sharding import sp_heads
from headmoe.models.magi2.config import Magi2Config
from headmoe.moe.formats import DEFAULT_EXPERT_FORMAT
from headmoe.planner.components import ComponentBytes, component_bytes_per_rank
from headmoe.planner.layouts import enumerate_layouts, layout_name
from headmoe.planner.memory import (
    DEFAULT_H2D_GBPS,
    MemoryEstimate,
    StreamEstimate,
    StreamSettings,
    busiest_stream,
    estimate_memory,
    stream_host_bytes,
)
from headmoe.planner.predict import (
    forward_counters,
    layout_topology,
    moe_placement,
    sequence_counts,
    weight_bytes,
)
from headmoe.planner.request import RequestShape


@dataclass(frozen=True)
class StreamReport:
    """`--offload-layers` on one layout (the busiest rank): the weights' `estimate`, the
    device bytes the admission check counts (`estimate_memory` with the stream: weights,
    activations, exchange workspace), the host bytes of the busiest node, the assumed
    host-to-device GB/s, and the most resident layers that fit the memory budget (None: no
    budget)."""

    estimate: StreamEstimate
    device_bytes: int
    activation_bytes: int
    """Activations and exchange workspace (the rest of `device_bytes` beyond the weights is
    the loader's host batch)."""
    host_bytes_per_node: int
    h2d_gbps: float
    max_resident_layers: int | None

    @property
    def step_time_s(self) -> float:
        return self.estimate.step_time_s(self.h2d_gbps)

    def to_dict(self) -> dict[str, Any]:
        e = self.estimate
        return {
            "slots": e.slots, "resident_layers": e.resident_layers,
            "streamed_layers": e.streamed_layers, "non_layer_bytes": e.non_layer_bytes,
            "resident_layer_bytes": e.resident_bytes, "in_flight_bytes": e.in_flight_bytes,
            "activation_bytes": self.activation_bytes,
            "device_bytes_per_rank": self.device_bytes,
            "host_bytes_per_node": self.host_bytes_per_node,
            "pinned_bytes_per_rank": e.pinned_bytes, "bytes_per_step": e.bytes_per_step,
            "h2d_gbps": self.h2d_gbps, "step_time_lower_bound_s": self.step_time_s,
            "max_resident_layers": self.max_resident_layers,
        }


def stream_report(model: Magi2Config, request: RequestShape, parallel: ParallelConfig,
                  dtype: torch.dtype, settings: StreamSettings, ranks_per_node: int,
                  h2d_gbps: float = DEFAULT_H2D_GBPS,
                  memory_bytes: int | None = None,
                  experts: str = DEFAULT_EXPERT_FORMAT) -> StreamReport:
    """The `StreamReport` of one layout (the numbers `generate`'s admission check uses;
    `experts`: the routed experts' format)."""
    def device(s: StreamSettings) -> MemoryEstimate:
        return estimate_memory(model, request, parallel, dtype, stream=s, experts=experts)

    best = None
    if memory_bytes is not None:
        fit = [n for n in range(model.num_layers + 1)
               if device(StreamSettings(n, settings.slots)).total <= memory_bytes]
        best = max(fit, default=None)
    est = device(settings)
    return StreamReport(busiest_stream(model, parallel, dtype, settings, experts), est.total,
                        est.activations + est.workspace,
                        stream_host_bytes(model, parallel, dtype, settings, ranks_per_node,
                                          experts),
                        h2d_gbps, best)


def _sent(c: Counters, *kinds: str) -> int:
    return sum(r.bytes_sent for r in c.exchanges if r.kind in kinds)


@dataclass(frozen=True)
class LayoutPlan:
    """Predicted per-rank quantities of one layout (the busiest rank's where they differ).

    Per-layer byte counts are per MoE layer (MoE) or per layer (Ulysses, q/k/v in plus
    output back); `bytes_sent_per_forward` adds every exchange of one forward."""

    parallel: ParallelConfig
    name: str
    moe_exchange: str
    """The exchange the MoE layer uses ("ep_group" / "sp_group")."""
    auto_exchange: str
    """The exchange "auto" would pick for the same SP, EP and request."""
    expert_parallel_size: int
    attention_heads_per_rank: int
    moe_heads_per_rank: int
    padded_moe_heads: int
    """Zero heads added to each EP group (`ceil(H/E)*E - H`)."""
    busiest_moe_rows: int
    moe_rows_per_rank: tuple[int, ...]
    moe_bytes_sent_per_rank: int
    ulysses_bytes_sent_per_rank: int
    bytes_sent_per_forward: int
    moe_peers: int
    ulysses_peers: int
    expert_weight_bytes_per_rank: int
    weight_bytes_per_rank: int
    recommended: bool = False
    text_encoder_bytes: int = 0
    """Device bytes of the text encoder on each node's first rank (0: none counted)."""
    decoder_bytes: int = 0
    """Device bytes of the video + audio decoders on each output rank."""
    device_bytes_per_rank: tuple[int, ...] = ()
    """Transformer + components on each rank (`headmoe.planner.components`)."""
    streaming: StreamReport | None = None
    """With `--offload-layers`: the streamed layout's device, host and copy numbers."""
    expert_format: str = DEFAULT_EXPERT_FORMAT
    """The routed experts' format the weight bytes count (`headmoe.moe.formats`)."""

    @property
    def fit_bytes(self) -> int:
        """What must fit the memory budget: the transformer weights, or with streaming the
        streamed device estimate (weights in flight, resident, activations)."""
        return self.weight_bytes_per_rank if self.streaming is None else (
            self.streaming.device_bytes)

    @property
    def busiest_rank_bytes(self) -> int:
        """The most device bytes any rank holds (transformer and components)."""
        return max(self.device_bytes_per_rank, default=self.weight_bytes_per_rank)

    def to_dict(self) -> dict[str, Any]:
        p = self.parallel
        return {
            "layout": self.name,
            "ulysses_degree": p.ulysses_degree,
            "cfg_parallel_size": p.cfg_parallel_size,
            "data_parallel_size": p.data_parallel_size,
            "expert_parallel_size": self.expert_parallel_size,
            "moe_exchange": self.moe_exchange,
            "auto_picks_this_exchange": self.moe_exchange == self.auto_exchange,
            "attention_heads_per_rank": self.attention_heads_per_rank,
            "moe_heads_per_rank": self.moe_heads_per_rank,
            "padded_moe_heads": self.padded_moe_heads,
            "busiest_moe_rows": self.busiest_moe_rows,
            "moe_rows_per_rank": list(self.moe_rows_per_rank),
            "moe_bytes_sent_per_rank": self.moe_bytes_sent_per_rank,
            "ulysses_bytes_sent_per_rank": self.ulysses_bytes_sent_per_rank,
            "bytes_sent_per_forward": self.bytes_sent_per_forward,
            "moe_all_to_all_peers": self.moe_peers,
            "ulysses_all_to_all_peers": self.ulysses_peers,
            "expert_format": self.expert_format,
            "expert_weight_bytes_per_rank": self.expert_weight_bytes_per_rank,
            "weight_bytes_per_rank": self.weight_bytes_per_rank,
            "text_encoder_bytes": self.text_encoder_bytes,
            "decoder_bytes": self.decoder_bytes,
            "device_bytes_per_rank": list(self.device_bytes_per_rank),
            "busiest_rank_bytes": self.busiest_rank_bytes,
            "recommended": self.recommended,
            "streaming": None if self.streaming is None else self.streaming.to_dict(),
        }


def plan_layout(model: Magi2Config, request: RequestShape, parallel: ParallelConfig,
                dtype: torch.dtype = torch.bfloat16, components: ComponentBytes | None = None,
                ranks_per_node: int | None = None, offload: bool = False,
                stream: StreamSettings | None = None, h2d_gbps: float = DEFAULT_H2D_GBPS,
                memory_bytes: int | None = None,
                experts: str = DEFAULT_EXPERT_FORMAT) -> LayoutPlan:
    """Predict one layout for one request (see `LayoutPlan`); `dtype` is the transformer's
    dtype (linears, experts and the activations they exchange). With `components` the
    text encoder and decoders are placed as the pipeline places them
    (`component_bytes_per_rank`; `ranks_per_node` defaults to the whole world). With
    `stream` the layers stream (`stream_report`, at `h2d_gbps` and `memory_bytes`).
    `experts`: the routed experts' format (`headmoe.moe.formats.EXPERT_FORMATS`; "fp8"
    about halves the weight bytes)."""
    topo = layout_topology(model, parallel)
    moe_layers = len(model.moe_layer_ids)
    e = topo.expert_parallel_size
    rows, moe_sent, uly_sent, total_sent, places = [], [], [], [], []
    # ranks of DP group k repeat those of group 0 (rank r + k * span): predict group 0 only
    span = topo.world_size // topo.dp
    for rank in range(span):
        c = forward_counters(model, request, parallel, rank, dtype)
        rows.append(max(c.moe_rows, default=0))
        moe_sent.append(_sent(c, "moe_scatter", "moe_gather") // max(moe_layers, 1))
        uly_sent.append(_sent(c, "ulysses_in", "ulysses_out") // model.num_layers)
        total_sent.append(_sent(c, *{r.kind for r in c.exchanges}))
        counts = sequence_counts(request, parallel, topo.coords(rank).cfg)
        places.append(moe_placement(model, topo, rank, counts))
    placement = places[0]
    auto = moe_placement(model, layout_topology(model, replace(parallel, moe_exchange="auto")),
                         0, sequence_counts(request, parallel, 0))
    weights = [weight_bytes(model, e, ep, dtype, experts) for ep in range(e)]
    parts = components or ComponentBytes(0, 0, 0)
    node = ranks_per_node or topo.world_size
    held = component_bytes_per_rank(topo, parts, node, offload)
    streaming = None if stream is None else stream_report(
        model, request, parallel, dtype, stream, node, h2d_gbps, memory_bytes, experts)
    on_device = [w[1] for w in weights] if streaming is None else [
        streaming.estimate.device_weight_bytes] * e
    device = tuple(on_device[topo.coords(r).ep] + held[r] for r in range(topo.world_size))
    return LayoutPlan(
        parallel=parallel,
        name=layout_name(parallel),
        moe_exchange=placement.exchange,
        auto_exchange=auto.exchange,
        expert_parallel_size=e,
        attention_heads_per_rank=sp_heads(model.num_attention_heads, topo.sp)[1],
        moe_heads_per_rank=placement.owned_heads,
        padded_moe_heads=placement.padded_heads - model.moe_num_heads,
        busiest_moe_rows=max(rows),
        moe_rows_per_rank=tuple(rows) * topo.dp,
        moe_bytes_sent_per_rank=max(moe_sent),
        ulysses_bytes_sent_per_rank=max(uly_sent),
        bytes_sent_per_forward=max(total_sent),
        moe_peers=max(p.layout.world_size - 1 for p in places),
        ulysses_peers=topo.sp - 1,
        expert_weight_bytes_per_rank=max(w[0] for w in weights),
        weight_bytes_per_rank=max(w[1] for w in weights),
        text_encoder_bytes=0 if offload else parts.text_encoder,
        decoder_bytes=0 if offload else parts.decoders,
        device_bytes_per_rank=device,
        streaming=streaming,
        expert_format=experts,
    )


def _streamed(p: LayoutPlan) -> int:
    """Weight bytes one rank streams per step (0 without `--offload-layers`)."""
    return 0 if p.streaming is None else p.streaming.estimate.bytes_per_step


def _ranked_rows(plans: list[LayoutPlan]) -> list[int]:
    """Each plan's busiest MoE rows as `recommend` ranks them. An ``sp_group`` layout whose
    ``ep_group`` twin (same SP, CFG, DP and EP) has at most ``E x heads per rank`` more rows
    ranks with its twin's rows: the guide's rule (``auto`` is ``ep_group``: fewer bytes to
    fewer peers, and the balanced SP split keeps the EP runs within E tokens of each other),
    so ``sp_group`` is picked only for a larger saving than that split's slack."""
    def key(p: LayoutPlan) -> tuple[int, int, int, int]:
        par = p.parallel
        return (par.ulysses_degree, par.cfg_parallel_size, par.data_parallel_size,
                p.expert_parallel_size)

    ep_rows = {key(p): p.busiest_moe_rows for p in plans if p.moe_exchange == "ep_group"}
    ranked = []
    for p in plans:
        twin = ep_rows.get(key(p)) if p.moe_exchange == "sp_group" else None
        slack = p.expert_parallel_size * p.moe_heads_per_rank
        ranked.append(twin if twin is not None and twin - p.busiest_moe_rows <= slack
                      else p.busiest_moe_rows)
    return ranked


def recommend(plans: list[LayoutPlan], memory_bytes: int | None) -> tuple[int, str]:
    """Index of the recommended plan and a one-line reason: among layouts whose transformer
    weights (streamed: `LayoutPlan.fit_bytes`) fit `memory_bytes` per rank (all when None),
    with streaming first the fewest bytes streamed per rank per step, then the fewest
    busiest-rank MoE rows (the MoE compute of the slowest rank; an ``sp_group`` saving within
    the SP split's slack counts as none, `_ranked_rows`), then the fewest bytes sent per rank per forward,
    then the fewest expert bytes per rank. Raises `ValueError` when no layout fits. (The
    components' bytes are reported, `LayoutPlan.busiest_rank_bytes`, not filtered on: they
    can be offloaded.)"""
    fits = [i for i, p in enumerate(plans)
            if memory_bytes is None or p.fit_bytes <= memory_bytes]
    if not fits:
        least = min(p.fit_bytes for p in plans) / GIB
        what = "of weights" if plans[0].streaming is None else "streamed (--offload-layers)"
        raise ValueError(
            f"memory budget {memory_bytes / GIB:.1f} GiB per rank fits no layout (the smallest "
            f"needs {least:.1f} GiB {what}), pass --memory-gib {math.ceil(least)} or more, "
            "or a larger --world-size"
            + ("" if plans[0].streaming is not None else ", or --offload-layers (stream each "
               "rank's layers from the checkpoint: docs/guide.md section 9)")
        )
    rows = _ranked_rows(plans)
    best = min(fits, key=lambda i: (_streamed(plans[i]), rows[i],
                                    plans[i].bytes_sent_per_forward,
                                    plans[i].expert_weight_bytes_per_rank))
    b = plans[best]
    tied = [plans[i].name for i in fits if i != best and (
        _streamed(plans[i]), rows[i]) == (_streamed(b), rows[best])]
    reason = f"fewest busiest-rank MoE rows ({b.busiest_moe_rows:,} per layer)"
    if b.streaming is not None:  # copying the layers dominates a streamed step
        reason = (f"fewest weight bytes streamed per rank per step ({_streamed(b) / 1e9:,.1f} "
                  f"GB), then {reason}")
    if memory_bytes is not None:
        what = "weights" if b.streaming is None else "streamed device estimate"
        reason += f" among layouts whose {what} fit {memory_bytes / GIB:g} GiB/rank"
    if tied:
        mib = b.bytes_sent_per_forward / 2**20
        reason += (f", then fewest bytes sent per rank per forward ({mib:,.1f} MiB; same rows: "
                   f"{', '.join(tied)})")
    return best, reason


def plan_world(model: Magi2Config, request: RequestShape, world_size: int,
               dtype: torch.dtype = torch.bfloat16,
               memory_bytes: int | None = None, components: ComponentBytes | None = None,
               ranks_per_node: int | None = None, offload: bool = False,
               stream: StreamSettings | None = None,
               h2d_gbps: float = DEFAULT_H2D_GBPS,
               experts: str = DEFAULT_EXPERT_FORMAT) -> tuple[list[LayoutPlan], str]:
    """Every valid layout of `world_size` ranks (`enumerate_layouts`) planned for `request`
    (components placed, layers streamed and experts in format `experts` as in
    `plan_layout`), the recommended one
    flagged, and the reason."""
    if not is_int(world_size) or world_size < 1:
        raise ValueError(f"world_size must be a positive int (ranks in the world), got "
                         f"{world_size!r}, e.g. 8")
    layouts = enumerate_layouts(model, world_size)
    if not layouts:
        raise ValueError(f"world_size={world_size} has no layout model {model.name!r} can run")
    plans = [plan_layout(model, request, p, dtype, components, ranks_per_node, offload,
                         stream, h2d_gbps, memory_bytes, experts) for p in layouts]
    best, reason = recommend(plans, memory_bytes)
    plans[best] = replace(plans[best], recommended=True)
    return plans, reason
