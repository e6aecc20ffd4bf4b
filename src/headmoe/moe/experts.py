"""Expert compute: SwiGLU7 per (head, expert), combined over the k routes.

Arithmetic (every path, see docs/moe.md): the GEMMs take operands in the expert dtype and
accumulate and return fp32 (bf16 operands are widened exactly to fp32 first, which on CPUs
without bf16 GEMM units is also ~10x faster than torch's bf16 GEMM); the activation runs
in fp32 and is rounded to the expert dtype before the down projection; the k routes are
combined in fp32 in ascending expert order; the result is rounded to the expert dtype.

Batch invariance: each group's GEMM sees at least `MIN_ROWS` rows (short groups are padded
with zero rows) with 64-byte aligned rows (`kernels.pad_features`), which on the measured
kernels makes a row's bits independent of the group's size and place; everything else is
elementwise or a fixed-order sum.
"""

from __future__ import annotations

import bisect

import torch

from headmoe.layers.activations import swiglu7_
from headmoe.layers.matmul import MIN_ROWS, bi_matmul
from headmoe.moe.gemm import aligned, grouped_mm, pad_features
from headmoe.moe.routing import route_groups

#: the fast path runs its GEMMs and activation over chunks of about this many activations
CHUNK_ELEMENTS = 1 << 20


def combine(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Weighted sum over the routes in their stored (ascending expert) order.

    y: `[N, h, k, d]` fp32 route outputs; weights: `[N, h, k]` fp32; returns `[N, h, d]` fp32."""
    out = y[:, :, 0] * weights[:, :, 0, None]
    for j in range(1, y.shape[2]):
        out += y[:, :, j] * weights[:, :, j, None]
    return out


def _gemm_weights(*weights: torch.Tensor) -> list[torch.Tensor]:
    """fp32 copies (views when already fp32 and aligned) with aligned feature dims."""
    return [pad_features(w.float(), dims=2) for w in weights]


def experts_reference(
    z: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The plain oracle: a Python loop over every (head, expert).

    z: `[N, h, d]` in the expert dtype; experts / weights: `[N, h, k]` (int64 ascending /
    fp32) from `route`; w_gate, w_up: `[h*E, d, f]`, w_down: `[h*E, f, d]` in the expert
    dtype. Returns `[N, h, d]` in z's dtype."""
    n, h, d = z.shape
    e_count = w_gate.shape[0] // h
    wg, wu, wd = _gemm_weights(w_gate, w_up, w_down)
    y = z.new_zeros((n, h, experts.shape[2], d), dtype=torch.float32)
    for head in range(h):
        for e in range(e_count):
            tok, slot = (experts[:, head] == e).nonzero(as_tuple=True)
            if tok.numel() == 0:
                continue
            r = head * e_count + e
            x = pad_features(z[tok, head].float())
            act = swiglu7_(bi_matmul(x, wg[r]), bi_matmul(x, wu[r])).to(z.dtype).float()
            y[tok, head, slot] = bi_matmul(act, wd[r])[:, :d]
    return combine(y, weights).to(z.dtype)


def experts_grouped(
    z: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
) -> torch.Tensor:
    """The fast CPU path: sort the routes by (head, expert), lay every non-empty group out in
    one buffer with at least `MIN_ROWS` rows, run the three projections as grouped GEMMs
    (one C++ call each per chunk of ~`CHUNK_ELEMENTS` activations, never a Python loop over
    groups), gather the rows back and combine.

    Same shapes, dtypes and arithmetic as `experts_reference`; returns `[N, h, d]`."""
    n, h, d = z.shape
    k = experts.shape[2]
    groups = w_gate.shape[0]
    if n == 0:
        return z.new_zeros((0, h, d))
    dev = z.device  # every index tensor lives with the inputs (CUDA rejects CPU ones)
    route_group = route_groups(experts, groups // h)
    order = torch.argsort(route_group, stable=True)
    counts = torch.bincount(route_group, minlength=groups)
    padded = torch.where(counts > 0, counts.clamp_min(MIN_ROWS), 0)
    ends = padded.cumsum(0)
    total = int(ends[-1])
    # a route's padded row = its sorted position, shifted by its group's padding so far
    shift = (ends - padded) - (counts.cumsum(0) - counts)
    dest = torch.empty_like(order)
    dest[order] = torch.arange(order.numel(), device=dev) + shift[route_group[order]]
    # padded row -> source (token, head) row; padding rows read an appended zero row
    source = torch.full((total,), n * h, dtype=torch.int64, device=dev)
    source[dest] = torch.arange(n * h, device=dev).repeat_interleave(k)
    zp = pad_features(z.reshape(n * h, d).float())
    rows = torch.cat([zp, zp.new_zeros((1, zp.shape[1]))]).index_select(0, source)
    y = torch.empty_like(rows)
    chunk_rows = max(MIN_ROWS, CHUNK_ELEMENTS // aligned(w_gate.shape[2]))
    ends_host = ends.tolist()
    g0 = start = 0
    while g0 < groups:  # chunks of whole groups, each <= chunk_rows rows or one group
        g1 = max(bisect.bisect_right(ends_host, start + chunk_rows), g0 + 1)
        stop = ends_host[g1 - 1]
        if stop > start:
            offs = (ends[g0:g1] - start).to(torch.int32)
            wg, wu, wd = _gemm_weights(w_gate[g0:g1], w_up[g0:g1], w_down[g0:g1])
            x = rows[start:stop]
            act = swiglu7_(grouped_mm(x, wg, offs), grouped_mm(x, wu, offs))
            y[start:stop] = grouped_mm(act.to(z.dtype).float(), wd, offs)
        g0, start = g1, stop
    routed = y.index_select(0, dest).view(n, h, k, -1)[..., :d]
    return combine(routed, weights).to(z.dtype)
