"""The communication schedule of one transformer forward, declared once (pure arithmetic).

`Exchange` names every collective kind headmoe issues; the exchanges record their counters
under these names. A `ForwardSchedule` lists, for one rank and one forward, every
collective in call order (kind, process-group axis, layer, layout, heads and width per
token) plus the MoE dispatch every MoE layer uses. The transformer builds its schedule
once per forward, takes its layouts from it, and checks after the forward that the
collectives it recorded are exactly the scheduled ones (`check_executed`); the planner
derives its byte and row predictions from the same schedule (`headmoe.planner.predict`).
So a collective cannot be added to the model without the schedule knowing it.

Rules (which collective runs when; MAGI-2's, `headmoe.models.magi2.schedule`; the
refiner's `headmoe.models.refiner.schedule` has the Ulysses rows, q/k/v fused with its KV
heads, and the gather, no MoE):

| kind | group | when | per token of the layout |
|---|---|---|---|
| ulysses_in | sp | every layer, SP > 1 | 3 (q, k, v) x Hq heads x D |
| ulysses_out | sp | every layer, SP > 1 | Hq heads x D |
| moe_scatter / moe_gather | ep or sp (`dispatch_plan`) | every MoE layer, group > 1 rank | padded MoE heads x d_head |
| sp_output_gather | sp | once, SP > 1 (all-gather of fp32 rows) | output width |
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum

from headmoe.distributed.counters import ExchangeRecord
from headmoe.distributed.sharding import DispatchPlan, HeadLayout


class Exchange(StrEnum):
    """Collective kinds (the `kind` of `headmoe.distributed.counters.ExchangeRecord`)."""

    ULYSSES_IN = "ulysses_in"
    ULYSSES_OUT = "ulysses_out"
    MOE_SCATTER = "moe_scatter"
    MOE_GATHER = "moe_gather"
    SP_OUTPUT_GATHER = "sp_output_gather"


@dataclass(frozen=True)
class Collective:
    """One scheduled collective on this rank.

    `token_counts` / `rank` / `replica_counts` are the layout over the `axis` group (for
    the all-gather: every member's rows); `heads` x `width` elements travel per token
    (`heads` = 1 for the all-gather); `fp32` marks a collective that moves fp32 whatever the
    model dtype."""

    kind: Exchange
    axis: str
    layer: int | None
    token_counts: tuple[int, ...]
    rank: int
    replica_counts: tuple[tuple[int, ...], ...] | None
    heads: int
    width: int
    fp32: bool = False

    @property
    def layout(self) -> HeadLayout:
        """The layout as a `HeadLayout` (validated)."""
        return HeadLayout(self.token_counts, self.rank, self.replica_counts)


@dataclass(frozen=True)
class ForwardSchedule:
    """Every collective of one forward on one rank, in call order, and the MoE dispatch.

    `moe_dispatch` is None without MoE layers; `moe_rows` the (token, real head) rows this
    rank computes per MoE layer call."""

    collectives: tuple[Collective, ...]
    moe_dispatch: DispatchPlan | None
    moe_rows: int

    def find(self, kind: Exchange, layer: int | None) -> Collective | None:
        """The scheduled collective of `kind` at `layer` (None: not issued on this rank)."""
        for c in self.collectives:
            if c.kind == kind and c.layer == layer:
                return c
        return None

    def check_executed(self, records: Sequence[ExchangeRecord]) -> None:
        """Raise `RuntimeError` unless `records` (the `ExchangeRecord`s a forward added) are
        exactly the scheduled collectives, kind by kind, in order."""
        done = [str(r.kind) for r in records]
        want = [str(c.kind) for c in self.collectives]
        if done != want:
            i = next((i for i, (a, b) in enumerate(zip(done, want)) if a != b),
                     min(len(done), len(want)))
            raise RuntimeError(
                f"the forward issued collectives {done[i:i + 3]} at position {i} where the "
                f"schedule has {want[i:i + 3]} ({len(done)} issued, {len(want)} scheduled)"
            )
