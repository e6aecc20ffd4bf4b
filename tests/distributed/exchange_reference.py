"""One-process reference model of every exchange: all ranks simulated with plain indexing.

Written independently of `headmoe.distributed.exchange` (no shared helpers): each function
takes every rank's input and returns every rank's output, following the contract in
ARCHITECTURE.md section 4 literally.
"""

from __future__ import annotations

import io

import torch
from torch import Tensor


def part_bounds(n_parts: list[int]) -> list[tuple[int, int]]:
    """Row ranges [start, end) of contiguous parts with the given sizes."""
    bounds, start = [], 0
    for n in n_parts:
        bounds.append((start, start + n))
        start += n
    return bounds


def _parts(counts: tuple[int, ...], replica_counts) -> list[list[int]]:
    return [list(p) for p in replica_counts] if replica_counts else [[n] for n in counts]


def owner_of(world: int, replicas: int, part: int, head: int, heads: int) -> int:
    """The rank that computes head `head` of part `part`'s tokens."""
    shards = world // replicas
    return part * shards + head // (heads // shards)


def scatter(xs: list[Tensor], counts, replica_counts=None) -> list[Tensor]:
    """Every rank's `scatter_heads` output from every rank's `[n_r, H, D]` input."""
    world = len(counts)
    parts = _parts(counts, replica_counts)
    replicas = len(parts[0])
    shards = world // replicas
    heads = xs[0].shape[1]
    h = heads // shards
    outs = []
    for owner in range(world):
        p, s = owner // shards, owner % shards
        rows = []
        for src in range(world):
            a, b = part_bounds(parts[src])[p]
            for t in range(a, b):
                rows.append(xs[src][t, s * h : (s + 1) * h])
        outs.append(torch.stack(rows) if rows else xs[0].new_empty((0, h, xs[0].shape[2])))
    return outs


def gather(ys: list[Tensor], counts, replica_counts=None) -> list[Tensor]:
    """Every rank's `gather_heads` output from every owner's `[owned, h, D]` input."""
    world = len(counts)
    parts = _parts(counts, replica_counts)
    replicas = len(parts[0])
    shards = world // replicas
    h, d = ys[0].shape[1], ys[0].shape[2]
    outs = [ys[0].new_zeros((counts[r], shards * h, d)) for r in range(world)]
    for owner in range(world):
        p, s = owner // shards, owner % shards
        i = 0
        for src in range(world):
            a, b = part_bounds(parts[src])[p]
            for t in range(a, b):
                outs[src][t, s * h : (s + 1) * h] = ys[owner][i]
                i += 1
        assert i == ys[owner].shape[0]
    return outs


def seq_to_heads(xs: list[Tensor]) -> list[Tensor]:
    """Ulysses in: rank r gets heads [r*h, (r+1)*h) of the whole sequence (`[..., H, D]`
    inputs; extra middle dims, like the fused q/k/v axis, ride along)."""
    world = len(xs)
    full = torch.cat(xs)
    h = full.shape[-2] // world
    return [full[..., r * h : (r + 1) * h, :].clone() for r in range(world)]


def heads_to_seq(ys: list[Tensor], counts) -> list[Tensor]:
    """Ulysses out: concatenate every rank's head block, cut the sequence by `counts`."""
    full = torch.cat(ys, dim=-2)
    return [c.clone() for c in torch.split(full, list(counts))]


# ---------------------------------------------------------------------------- test support
COLLECTIVES = (
    "all_to_all_single",
    "all_to_all",
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "monitored_barrier",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
)


class CollectiveRecorder:
    """Context manager that wraps every `torch.distributed` collective: each call is
    appended to `calls` as `(name, kwargs-and-args summary)` and then forwarded (or, with
    `forward=False`, not issued at all)."""

    def __init__(self, forward: bool = True):
        self.forward = forward
        self.calls: list[tuple[str, tuple, dict]] = []
        self._saved: dict[str, object] = {}

    def __enter__(self) -> CollectiveRecorder:
        import torch.distributed as dist

        for name in COLLECTIVES:
            orig = getattr(dist, name)
            self._saved[name] = orig

            def wrapper(*args, _name=name, _orig=orig, **kwargs):
                self.calls.append((_name, args, kwargs))
                return _orig(*args, **kwargs) if self.forward else None

            setattr(dist, name, wrapper)
        return self

    def __exit__(self, *exc) -> None:
        import torch.distributed as dist

        for name, orig in self._saved.items():
            setattr(dist, name, orig)


def make_input(shape: tuple[int, ...], src: int, dtype: torch.dtype, seed: int) -> Tensor:
    """Deterministic input of rank `src`. Integer and fp32 values encode the source rank and
    the element's position exactly (`src * 10**5 + flat index`); bf16 cannot hold such codes,
    so it gets seeded random values."""
    if dtype == torch.bfloat16:
        g = torch.Generator().manual_seed(seed * 1000 + src)
        return torch.randn(shape, generator=g).to(dtype)
    n = 1
    for s in shape:
        n *= s
    assert n < 10**5
    return (torch.arange(n, dtype=torch.int64) + src * 10**5).reshape(shape).to(dtype)


def to_bytes(obj) -> bytes:
    """Serialize a result holding tensors for the trip back from a spawned rank (tensors sent
    through a multiprocessing queue share memory with a process that is about to exit)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def from_bytes(data: bytes):
    return torch.load(io.BytesIO(data), weights_only=True)
