"""The parallel seam of one forward: what a block needs to know about the ranks.

A `ParallelPlan` is built once per forward by a model's top-level entry from its
`ParallelContext` (`parallel_plan`) and handed to every block with its input, so blocks
take `(x, plan)` and never see the context: the Ulysses (SP) group, every SP rank's token
count, this rank's coordinates, the MoE head dispatcher (`HeadDispatch`: the exchange and
the group it runs over) and the counters sink the exchanges record into.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from headmoe.config import is_int
from headmoe.distributed.context import ParallelContext
from headmoe.distributed.counters import Counters
from headmoe.distributed.sharding import DispatchPlan, HeadLayout, sp_heads, sp_rows
from headmoe.distributed.topology import Coords


@dataclass(frozen=True)
class HeadDispatch:
    """The MoE head exchange of one forward: `exchange` (axis, layout) over `group` (this
    rank's process group of `exchange.axis`; None for a group of one rank)."""

    exchange: DispatchPlan
    group: dist.ProcessGroup | None

    @property
    def layout(self) -> HeadLayout:
        return self.exchange.layout


@dataclass(frozen=True)
class ParallelPlan:
    """This rank's part in one forward (host-side, identical on every call of the forward).

    counts: the token counts of every rank of this rank's SP group, in SP order; coords:
    this rank's coordinates; sp_group: the Ulysses group (None when SP = 1); dispatch: the
    MoE exchange (None for a model without MoE layers); counters: the sink every exchange
    and MoE layer of the forward records into."""

    counts: tuple[int, ...]
    coords: Coords
    sp_group: dist.ProcessGroup | None
    dispatch: HeadDispatch | None = None
    counters: Counters = field(default_factory=Counters)

    @property
    def sp(self) -> int:
        """The Ulysses degree."""
        return len(self.counts)

    @property
    def rows(self) -> tuple[int, int]:
        """`(lo, hi)`: the global rows this rank holds (`sp_rows`)."""
        return sp_rows(self.counts, self.coords.sp)

    @property
    def local_tokens(self) -> int:
        return self.counts[self.coords.sp]

    def heads(self, num_heads: int) -> tuple[int, int]:
        """`(first, count)` of the `num_heads` attention heads this rank attends after the
        Ulysses exchange (`sp_heads`)."""
        return sp_heads(num_heads, self.sp, self.coords.sp)

    def check_tokens(self, tokens: int) -> None:
        """`ValueError` unless this rank's input holds its `counts` entry of rows."""
        me = self.coords.sp
        if self.counts[me] != tokens:
            raise ValueError(
                f"token_counts[{me}]={self.counts[me]!r} does not match this rank's "
                f"x.shape[0]={tokens}"
            )


def one_rank_plan(tokens: int, counters: Counters | None = None) -> ParallelPlan:
    """The plan of a forward of `tokens` rows on a single rank (no group, no exchange)."""
    return ParallelPlan((tokens,), Coords(0, 0, 0, 0, 0), None, None,
                        Counters() if counters is None else counters)


def parallel_plan(ctx: ParallelContext, counts: tuple[int, ...],
                  dispatch: DispatchPlan | None = None) -> ParallelPlan:
    """This rank's `ParallelPlan` under `ctx` for SP token counts `counts` (host only, no
    collective) and MoE exchange `dispatch`. Raises `ValueError` naming `token_counts` unless
    it holds one non-negative int per SP rank."""
    counts = check_sp_counts(ctx.config.ulysses_degree, counts)
    heads = None if dispatch is None else HeadDispatch(dispatch, ctx.group(dispatch.axis))
    sp_group = ctx.group("sp") if len(counts) > 1 else None
    return ParallelPlan(counts, ctx.coords, sp_group, heads, ctx.counters)


def check_sp_counts(sp: int, counts: object) -> tuple[int, ...]:
    """`counts` as a tuple if it holds one non-negative int per SP rank (`sp`), else
    `ValueError` naming `token_counts`."""
    if not isinstance(counts, tuple | list) or len(counts) != sp or any(
        not is_int(c) or c < 0 for c in counts
    ):
        raise ValueError(
            f"token_counts must be a tuple of {sp} non-negative ints (one per SP rank), "
            f"got {counts!r}"
        )
    return tuple(counts)
