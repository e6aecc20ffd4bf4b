"""The skeleton the MAGI-2 transformer and the refiner share: the per-forward plan of this
rank's rows, the embedding of its rows, and one forward (plan, embed, layers in order,
post-adapter, gather over SP, schedule check).

A model subclasses `PlannedModel` and implements `plan` (its `RowPlan` subclass, built
with `row_plan_fields`), `_embed`, `_post`, `_layers` and the two trace hooks; each layer is
a module called as `layer(state, plan)`, so a streamed layer's forward hooks bind its
weights while it runs (`headmoe.models.streaming`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypedDict, TypeVar

import torch
from torch import nn

from headmoe.distributed.context import ParallelContext
from headmoe.distributed.exchange import gather_rows
from headmoe.distributed.forward_plan import ParallelPlan, parallel_plan
from headmoe.distributed.schedule import ForwardSchedule
from headmoe.distributed.sharding import DispatchPlan, sp_rows, sp_token_counts
from headmoe.layers.linear import Linear
from headmoe.layers.rope import rope_table, split_table
from headmoe.models.magi2.config import MODALITIES


def modality_groups(modality: torch.Tensor) -> list[torch.Tensor]:
    """`groups[m]`: the rows (int64, on modality's device) of `modality` `[N]` equal to m."""
    return [torch.nonzero(modality == m).flatten() for m in range(len(MODALITIES))]


@dataclass(frozen=True)
class RowPlan:
    """Host-side facts of one forward on this rank, shared by every layer: the parallel
    seam `parallel` (SP counts, groups, dispatcher, counters), `modality` `[T_local]` int64
    and `groups[m]` (local rows of modality m) on the model's device, rotary cos/sin
    `[T_local, 3B]` fp32 (on the model's device) and the forward's collective `schedule`."""

    parallel: ParallelPlan
    modality: torch.Tensor
    groups: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    schedule: ForwardSchedule

    @property
    def counts(self) -> tuple[int, ...]:
        """SP token counts, in SP order."""
        return self.parallel.counts

    @property
    def lo(self) -> int:
        return self.parallel.rows[0]

    @property
    def hi(self) -> int:
        return self.parallel.rows[1]

    @property
    def local_tokens(self) -> int:
        return self.parallel.local_tokens


class RowPlanFields(TypedDict):
    """The keyword arguments of `RowPlan` (what `row_plan_fields` returns)."""

    parallel: ParallelPlan
    modality: torch.Tensor
    groups: list[torch.Tensor]
    cos: torch.Tensor
    sin: torch.Tensor
    schedule: ForwardSchedule


def sp_counts(ctx: ParallelContext, num_tokens: int) -> tuple[int, ...]:
    """SP token counts of a packed sequence of `num_tokens` rows under `ctx`."""
    return sp_token_counts(num_tokens, ctx.config.ulysses_degree)


def row_plan_fields(
    ctx: ParallelContext, counts: tuple[int, ...], modality: torch.Tensor,
    coords: torch.Tensor, bands: torch.Tensor, device: torch.device,
    schedule: ForwardSchedule, dispatch: DispatchPlan | None = None,
) -> RowPlanFields:
    """The `RowPlan` fields of this rank for packed `modality` `[T]` int64 and rotary
    `coords` `[T, 3]` (host tensors), `bands` `[B]` fp32 (host only, no collective)."""
    lo, hi = sp_rows(counts, ctx.coords.sp)
    host = modality[lo:hi]
    groups = [g.to(device) for g in modality_groups(host)]  # on the host: no device sync
    cos, sin = split_table(rope_table(coords[lo:hi], bands.cpu()))
    return RowPlanFields(parallel=parallel_plan(ctx, counts, dispatch),
                         modality=host.to(device), groups=groups, cos=cos.to(device),
                         sin=sin.to(device), schedule=schedule)


def embed_rows(embedders: Sequence[Linear], x: torch.Tensor, groups: list[torch.Tensor],
               width: int) -> torch.Tensor:
    """`[T_local, width]` fp32: each modality's rows of `x` `[T_local, Cx]` (on the
    embedders' device) through its embedder (modality order, reading its input columns)."""
    out = torch.zeros(x.shape[0], width, device=x.device)
    for m, embedder in enumerate(embedders):
        rows = groups[m]
        if rows.numel():
            out[rows] = embedder(x[rows, : embedder.weight.shape[1]])
    return out


P = TypeVar("P", bound=RowPlan)
K = TypeVar("K")
L = TypeVar("L", torch.Tensor, tuple[torch.Tensor, torch.Tensor])


class PlannedModel(nn.Module, Generic[P, K, L]):
    """A transformer whose forward is `run_planned`: plan -> embed -> layers -> post ->
    gather over SP -> check the executed collectives against the plan's schedule. `P` is
    its `RowPlan` type, `K` the type of its packed inputs, `L` what its layers return (the
state, or the state and a traced tensor)."""

    context: ParallelContext

    def plan(self, packed: K) -> P:
        raise NotImplementedError

    def _embed(self, packed: K, plan: P) -> torch.Tensor:
        raise NotImplementedError

    def _post(self, state: torch.Tensor, plan: P) -> torch.Tensor:
        raise NotImplementedError

    def _layers(self) -> Iterable[nn.Module]:
        raise NotImplementedError

    def _trace_in(self, trace: dict[str, torch.Tensor], state: torch.Tensor, plan: P) -> None:
        raise NotImplementedError

    def _trace_layer(self, trace: dict[str, torch.Tensor], i: int, out: L, plan: P) -> None:
        raise NotImplementedError

    def run_planned(self, packed: K, trace: dict[str, torch.Tensor] | None) -> torch.Tensor:
        """One forward on packed inputs (identical on every SP rank): the full `[T, P]` fp32
        output rows (`_post`'s columns) on every SP rank."""
        plan = self.plan(packed)
        counters = plan.parallel.counters
        issued = len(counters.exchanges)
        state = self._embed(packed, plan)
        if trace is not None:
            self._trace_in(trace, state, plan)
        for i, layer in enumerate(self._layers()):
            out: L = layer(state, plan)
            state = out[0] if isinstance(out, tuple) else out
            if trace is not None:
                self._trace_layer(trace, i, out, plan)
        result = gather_rows(self._post(state, plan), plan.parallel.sp_group, plan.counts,
                             counters=counters)
        plan.schedule.check_executed(counters.exchanges[issued:])
        return result
