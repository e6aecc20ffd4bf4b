"""Head <-> token exchanges over caller-owned process groups (MoE EP and Ulysses SP).

Vocabulary (see docs/exchange.md for the replicated layout with a worked example):

    W         ranks in the group (group-rank order)
    R         replicas: each rank's tokens are cut into R contiguous parts (1 without parts)
    shards    W // R: how many ways the head axis is cut
    h         heads per shard, H // shards

Rank r owns head shard `r % shards` of part `r // shards` of every rank's tokens. Without
replicas that is shard r of all tokens: the plain EP (or Ulysses) exchange.

Every function validates all of its input against the group before the one collective it
issues (`torch.distributed.all_to_all_single` on flat buffers with element split sizes), so
bad input raises `ValueError` on every rank instead of leaving the others in a collective.
A world of one rank never touches `torch.distributed` (its group is `None`).

Buffer ownership with an `ExchangeWorkspace`: see that class.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from headmoe.distributed.schedule import Exchange
from headmoe.distributed.sharding import (
    REPLICA_POLICIES,
    HeadLayout,
    check_counts,
    replica_token_counts,
)


class ExchangeCounters(Protocol):
    """What the exchanges record into (`headmoe.distributed.counters.Counters` fits)."""

    def record_exchange(self, kind: str, bytes_sent: int, bytes_received: int) -> None: ...


# ---------------------------------------------------------------------------- workspace
class ExchangeWorkspace:
    """Reusable send/receive buffers for `scatter_heads` and `gather_heads`.

    Ownership rule, for one workspace `ws`:

    - `scatter_heads(..., workspace=ws)` returns a tensor that aliases `ws`. It stays valid
      until the next `scatter_heads` call with `ws`, which overwrites it.
    - `gather_heads(..., workspace=ws)` returns a tensor that aliases `ws`. It stays valid
      until the next `gather_heads` call with `ws`.
    - Scatter and gather use disjoint buffers, so "scatter, compute on the result, gather"
      may keep the scatter result (or pass it, or a view of it, as the gather input) while
      gathering. Inputs are only read. A world of one rank returns the input itself and a
      zero-token exchange a fresh empty tensor; neither aliases `ws`.
    - Buffers grow when a call needs more room (the old storage then stays with the tensors
      returned before), and follow the input's device. A workspace belongs to one thread of
      one rank; use one per layer, or one per context when each result is consumed before
      the next call of the same direction.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, Tensor] = {}

    def buffer(self, role: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """A contiguous 1-D `[numel]` tensor of `dtype` on `device`, aliasing the buffer kept
        for `role` (contents undefined)."""
        nbytes = numel * torch.empty((), dtype=dtype).element_size()
        buf = self._buffers.get(role)
        if buf is None or buf.numel() < nbytes or buf.device != torch.device(device):
            buf = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
            self._buffers[role] = buf
        return buf[:nbytes].view(dtype)

    @property
    def nbytes(self) -> int:
        """Bytes currently held."""
        return sum(b.numel() for b in self._buffers.values())

    def clear(self) -> None:
        """Drop every buffer (tensors returned before keep their own storage)."""
        self._buffers.clear()


def _empty(ws: ExchangeWorkspace | None, role: str, numel: int, like: Tensor) -> Tensor:
    if ws is None:
        return torch.empty(numel, dtype=like.dtype, device=like.device)
    return ws.buffer(role, numel, like.dtype, like.device)


# ---------------------------------------------------------------------------- core
def _check_group(group: ProcessGroup | None, layout: HeadLayout) -> None:
    if group is None:
        if layout.world_size != 1:
            raise ValueError(
                f"group is None, which is only allowed for a world of 1, but the layout has "
                f"world_size={layout.world_size}"
            )
        return
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if size != layout.world_size:
        raise ValueError(
            f"group has {size} ranks but layout.token_counts has {layout.world_size}: "
            f"{layout.token_counts}"
        )
    if rank != layout.rank:
        raise ValueError(f"this rank is rank {rank} of the group but layout.rank={layout.rank}")


def _check_tensor(name: str, t: object, dims: int, rows: int, what: str) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dims, got shape {tuple(t.shape)}")
    if t.shape[0] != rows:
        raise ValueError(f"{name}.shape[0] must equal {what}={rows}, got {t.shape[0]}")
    if any(s == 0 for s in t.shape[1:]):
        raise ValueError(f"{name} must have positive head and dim sizes, got {tuple(t.shape)}")


def _record(counters: ExchangeCounters | None, kind: str, layout: HeadLayout, row: int,
            t: Tensor, to_heads: bool) -> None:
    if counters is not None:
        counters.record_exchange(kind, *layout.moved_bytes(row * t.element_size(), to_heads))


def gathered_bytes(token_counts: tuple[int, ...], width: int, nbytes: int) -> int:
    """Bytes one rank sends (and receives) in `gather_rows`'s all-gather of shards padded to
    the largest: `(ranks - 1) * max(token_counts) * width * nbytes`."""
    return (len(token_counts) - 1) * max(token_counts) * width * nbytes


def _to_heads(
    x: Tensor,
    group: ProcessGroup | None,
    layout: HeadLayout,
    kind: str,
    counters: ExchangeCounters | None,
    ws: ExchangeWorkspace | None,
) -> Tensor:
    """`[local_tokens, A, H, D] -> [owned_tokens, A, H // shards, D]` (validated input)."""
    shards = layout.shards
    _, a, heads, d = x.shape
    h = heads // shards
    row = a * h * d
    send = _empty(ws, "scatter_send", layout.local_tokens * a * heads * d, x)
    start = off = 0
    for n in layout.local_parts:
        # part rows [start, start+n) -> blocks for owners of this part, in shard order
        block = send[off : off + shards * n * row].view(shards, n, a, h, d)
        part = x[start : start + n].unflatten(2, (shards, h))  # type: ignore[no-untyped-call]
        block.copy_(part.permute(2, 0, 1, 3, 4))
        start, off = start + n, off + shards * n * row
    recv = _empty(ws, "scatter_recv", layout.owned_tokens * row, x)
    sent = [n * row for n in layout.send_counts]
    got = [n * row for n in layout.owned_counts]
    dist.all_to_all_single(recv, send, got, sent, group=group)
    _record(counters, kind, layout, row, x, to_heads=True)
    return recv.view(layout.owned_tokens, a, h, d)


def _to_tokens(
    y: Tensor,
    group: ProcessGroup | None,
    layout: HeadLayout,
    kind: str,
    counters: ExchangeCounters | None,
    ws: ExchangeWorkspace | None,
) -> Tensor:
    """`[owned_tokens, A, h, D] -> [local_tokens, A, shards * h, D]` (validated input)."""
    shards = layout.shards
    _, a, h, d = y.shape
    row = a * h * d
    if y.is_contiguous():
        send = y.reshape(-1)
    else:
        send = _empty(ws, "gather_send", y.numel(), y)
        send.view(y.shape).copy_(y)
    recv = _empty(ws, "gather_recv", layout.local_tokens * shards * row, y)
    sent = [n * row for n in layout.owned_counts]
    got = [n * row for n in layout.send_counts]
    dist.all_to_all_single(recv, send, got, sent, group=group)
    _record(counters, kind, layout, row, y, to_heads=False)
    out = _empty(ws, "gather_out", layout.local_tokens * shards * row, y)
    out = out.view(layout.local_tokens, a, shards, h, d)
    start = off = 0
    for n in layout.local_parts:
        block = recv[off : off + shards * n * row].view(shards, n, a, h, d)
        out[start : start + n].permute(2, 0, 1, 3, 4).copy_(block)
        start, off = start + n, off + shards * n * row
    return out.view(layout.local_tokens, a, shards * h, d)


# ---------------------------------------------------------------------------- MoE exchange
def scatter_heads(
    x: Tensor,
    group: ProcessGroup | None,
    layout: HeadLayout,
    *,
    workspace: ExchangeWorkspace | None = None,
    counters: ExchangeCounters | None = None,
) -> Tensor:
    """Send every owner its head shard of this rank's tokens; receive this rank's shard.

    `x`: `[layout.local_tokens, H, D]`, any dtype, any strides; H divisible by
    `layout.shards`. Returns `[layout.owned_tokens, H // shards, D]`, same dtype and device:
    source by source in group-rank order, that source's rows of part `layout.part`, heads
    `[shard*h, (shard+1)*h)`. One `all_to_all_single` over `group` (None only for a world of
    1, where `x` itself is returned); none when the group holds no tokens. Records
    "moe_scatter" into `counters`. With `workspace` the result aliases it (see
    `ExchangeWorkspace`). Raises `ValueError` before any collective on bad input.
    """
    if not isinstance(layout, HeadLayout):
        raise ValueError(f"layout must be a HeadLayout, got {type(layout).__name__}")
    _check_group(group, layout)
    _check_tensor("x", x, 3, layout.local_tokens, "layout.local_tokens")
    if x.shape[1] % layout.shards:
        raise ValueError(
            f"x has {x.shape[1]} heads, not divisible by layout.shards={layout.shards}"
        )
    if layout.world_size == 1:
        return x
    h = x.shape[1] // layout.shards
    if layout.total_tokens == 0:
        return x.new_empty((0, h, x.shape[2]))
    return _to_heads(x.unsqueeze(1), group, layout, Exchange.MOE_SCATTER, counters, workspace)[:, 0]


def gather_heads(
    y: Tensor,
    group: ProcessGroup | None,
    layout: HeadLayout,
    *,
    workspace: ExchangeWorkspace | None = None,
    counters: ExchangeCounters | None = None,
) -> Tensor:
    """The exact inverse of `scatter_heads`: return each source its rows, reassemble heads.

    `y`: `[layout.owned_tokens, h, D]` (rows as `scatter_heads` returned them), any dtype,
    any strides. Returns `[layout.local_tokens, shards * h, D]`, same dtype and device, heads
    in shard order. One `all_to_all_single` (none for a world of 1, which returns `y`, or
    when the group holds no tokens). Records "moe_gather" into `counters`. With `workspace`
    the result aliases it (see `ExchangeWorkspace`). Raises `ValueError` before any
    collective on bad input.
    """
    if not isinstance(layout, HeadLayout):
        raise ValueError(f"layout must be a HeadLayout, got {type(layout).__name__}")
    _check_group(group, layout)
    _check_tensor("y", y, 3, layout.owned_tokens, "layout.owned_tokens")
    if layout.world_size == 1:
        return y
    if layout.total_tokens == 0:
        return y.new_empty((0, layout.shards * y.shape[1], y.shape[2]))
    return _to_tokens(y.unsqueeze(1), group, layout, Exchange.MOE_GATHER, counters, workspace)[:, 0]


# ---------------------------------------------------------------------------- Ulysses
def _ulysses_layout(group: ProcessGroup | None, token_counts: object) -> HeadLayout:
    counts = check_counts("token_counts", token_counts)
    if group is None:
        if len(counts) != 1:
            raise ValueError(
                f"group is None, which is only allowed for a world of 1, but token_counts "
                f"has {len(counts)} ranks: {counts}"
            )
        return HeadLayout(counts, 0)
    layout = HeadLayout(counts, max(dist.get_rank(group), 0))
    _check_group(group, layout)
    return layout


def _seq_to_heads(x: Tensor, group: ProcessGroup | None, token_counts: object,
                  counters: ExchangeCounters | None, fused: bool) -> Tensor:
    layout = _ulysses_layout(group, token_counts)
    name, dims = ("qkv", 4) if fused else ("x", 3)
    _check_tensor(name, x, dims, layout.local_tokens, f"token_counts[{layout.rank}]")
    if fused and x.shape[1] != 3:
        raise ValueError(f"qkv.shape[1] must be 3 (q, k, v), got shape {tuple(x.shape)}")
    heads = x.shape[-2]
    if heads % layout.world_size:
        raise ValueError(
            f"{name} has {heads} heads, not divisible by the SP size {layout.world_size}"
        )
    if layout.world_size == 1:
        return x
    x4 = x if fused else x.unsqueeze(1)
    if layout.total_tokens == 0:
        out = x4.new_empty((0, x4.shape[1], heads // layout.world_size, x4.shape[3]))
    else:
        out = _to_heads(x4, group, layout, Exchange.ULYSSES_IN, counters, None)
    return out if fused else out[:, 0]


def ulysses_seq_to_heads(
    x: Tensor,
    group: ProcessGroup | None,
    token_counts: tuple[int, ...],
    *,
    counters: ExchangeCounters | None = None,
) -> Tensor:
    """Ulysses exchange in: sequence-sharded -> head-sharded.

    `x`: `[token_counts[r], H, D]` on SP rank r = `get_rank(group)`, any dtype, H divisible
    by SP = `len(token_counts)`. Returns a fresh `[sum(token_counts), H // SP, D]` (same
    dtype): all tokens in global sequence order (rank 0's first), heads
    `[r*H/SP, (r+1)*H/SP)`. One `all_to_all_single`; `x` itself for a world of 1 (`group`
    None). Records "ulysses_in". Raises `ValueError` before any collective on bad input.
    """
    return _seq_to_heads(x, group, token_counts, counters, fused=False)


def ulysses_qkv_to_heads(
    qkv: Tensor,
    group: ProcessGroup | None,
    token_counts: tuple[int, ...],
    *,
    counters: ExchangeCounters | None = None,
) -> Tensor:
    """Fused Ulysses exchange in for q, k and v: ONE `all_to_all_single`.

    `qkv`: `[token_counts[r], 3, H, D]`, any dtype. Returns a fresh
    `[sum(token_counts), 3, H // SP, D]`: `out[:, i]` equals
    `ulysses_seq_to_heads(qkv[:, i], ...)`. Records one "ulysses_in".
    """
    return _seq_to_heads(qkv, group, token_counts, counters, fused=True)


def ulysses_heads_to_seq(
    y: Tensor,
    group: ProcessGroup | None,
    token_counts: tuple[int, ...],
    *,
    counters: ExchangeCounters | None = None,
) -> Tensor:
    """Ulysses exchange out, the inverse of `ulysses_seq_to_heads`.

    `y`: `[sum(token_counts), h, D]` on SP rank r (all tokens in sequence order, heads
    `[r*h, (r+1)*h)`), any dtype. Returns a fresh `[token_counts[r], SP * h, D]`. One
    `all_to_all_single`; `y` itself for a world of 1. Records "ulysses_out". Raises
    `ValueError` before any collective on bad input.
    """
    layout = _ulysses_layout(group, token_counts)
    _check_tensor("y", y, 3, layout.total_tokens, "sum(token_counts)")
    if layout.world_size == 1:
        return y
    if layout.total_tokens == 0:
        return y.new_empty((0, layout.world_size * y.shape[1], y.shape[2]))
    return _to_tokens(y.unsqueeze(1), group, layout, Exchange.ULYSSES_OUT, counters, None)[:, 0]


def gather_rows(
    local: Tensor,
    group: ProcessGroup | None,
    token_counts: tuple[int, ...],
    *,
    counters: ExchangeCounters | None = None,
) -> Tensor:
    """All-gather of row shards over an SP group: every rank's `[token_counts[r], P]` rows
    -> the full `[sum(token_counts), P]` in rank order (padded shards, ONE `all_gather`);
    `local` itself for a world of 1. Records "sp_output_gather"."""
    sp = len(token_counts)
    if sp == 1:
        return local
    width, rows = local.shape[1], max(token_counts)
    padded = local.new_zeros((rows, width))
    padded[: local.shape[0]] = local
    parts = [torch.empty_like(padded) for _ in range(sp)]
    dist.all_gather(parts, padded, group=group)
    if counters is not None:
        moved = gathered_bytes(tuple(token_counts), width, padded.element_size())
        counters.record_exchange(Exchange.SP_OUTPUT_GATHER, moved, moved)
    return torch.cat([p[:c] for p, c in zip(parts, token_counts)])


__all__ = [
    "REPLICA_POLICIES",
    "ExchangeCounters",
    "ExchangeWorkspace",
    "HeadLayout",
    "gather_heads",
    "gather_rows",
    "replica_token_counts",
    "scatter_heads",
    "ulysses_heads_to_seq",
    "ulysses_qkv_to_heads",
    "ulysses_seq_to_heads",
]
