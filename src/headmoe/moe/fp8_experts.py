"""The CPU experts path for FP8 weights (`headmoe.moe.fp8`): the arithmetic of
`headmoe.moe.experts.experts_grouped`, with each (head, expert) block dequantized to fp32
only while its group runs.

Memory: one block of each weight at a time (`[1, d, f]` + `[1, f, d]` fp32, 3.9 MB at
MAGI-2's d=256, f=1280), never the whole layer; groups without routes dequantize nothing.

Bits: every non-empty group runs as one `grouped_mm` call of its own (its rows, then zero
rows up to `MIN_ROWS`, 64-byte aligned features from `pad_features`); a row's bits do not
depend on the group's size or place (the invariance argument of `headmoe.moe.experts`,
whose test with one group per chunk checks exactly this), and the route outputs are
combined by `experts.combine`. So the result equals, bit for bit, `experts_grouped` given
the dequantized weights as fp32 (tests/moe/test_fp8.py). The loop over non-empty groups
is Python (a few small ops per group); `experts_grouped` batches groups into chunks.
"""

from __future__ import annotations

import torch

from headmoe.layers.activations import swiglu7_
from headmoe.layers.matmul import MIN_ROWS
from headmoe.moe.experts import combine
from headmoe.moe.fp8 import Fp8Weight
from headmoe.moe.gemm import aligned, grouped_mm, pad_features
from headmoe.moe.routing import route_groups


def check_fp8_experts(
    z: torch.Tensor, w_gate: Fp8Weight, w_up: Fp8Weight, w_down: Fp8Weight
) -> None:
    """ValueError naming the first FP8 weight whose shape does not fit z `[N, h, d]`:
    w_gate / w_up `[h*E, d, f]`, w_down `[h*E, f, d]`, `Fp8Weight`s on z's device."""
    _, h, d = z.shape
    rows = w_gate.shape[0] if isinstance(w_gate, Fp8Weight) else -1
    f = w_gate.shape[2] if isinstance(w_gate, Fp8Weight) else -1
    expected = {"w_gate": (rows, d, f), "w_up": (rows, d, f), "w_down": (rows, f, d)}
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not isinstance(w, Fp8Weight):
            raise ValueError(f"{name} must be an Fp8Weight, got {type(w).__name__}")
        if tuple(w.shape) != expected[name] or rows % h or rows == 0:
            raise ValueError(f"{name} must be FP8 {expected[name]} (rows = h*E, h={h}), got "
                             f"{tuple(w.shape)}")  # fmt: skip
        if w.device != z.device:
            raise ValueError(f"{name} must be on {z.device} like z, got {w.device}")


def _group_output(
    x: torch.Tensor, g: int, w_gate: Fp8Weight, w_up: Fp8Weight, w_down: Fp8Weight,
    act_dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """SwiGLU7 experts of group g on x `[P, aligned(d)]` fp32 (P >= MIN_ROWS, zero rows
    at the end): `[P, aligned(d)]` fp32, the group's weights dequantized for this call."""
    wg, wu, wd = (pad_features(w.dequantize(g, g + 1), dims=2) for w in (w_gate, w_up, w_down))
    offs = torch.tensor([x.shape[0]], dtype=torch.int32, device=x.device)
    act = swiglu7_(grouped_mm(x, wg, offs), grouped_mm(x, wu, offs))
    return grouped_mm(act.to(act_dtype).float(), wd, offs)


def experts_fp8(
    z: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate: Fp8Weight,
    w_up: Fp8Weight,
    w_down: Fp8Weight,
) -> torch.Tensor:
    """`experts_grouped` with FP8 weights, one (head, expert) block dequantized at a time.

    z: `[N, h, d]` (fp32, bf16 or fp16: the activation dtype, to which SwiGLU7's output and
    the result are rounded); experts / weights: `[N, h, k]` int64 ascending ids in [0, E) /
    fp32, from `route`; w_gate, w_up: `Fp8Weight` `[h*E, d, f]` (scale `[h*E, f]`),
    w_down: `[h*E, f, d]` (scale `[h*E, d]`). Returns `[N, h, d]` in z's dtype."""
    check_fp8_experts(z, w_gate, w_up, w_down)
    n, h, d = z.shape
    k, groups = experts.shape[2], w_gate.shape[0]
    if n == 0:
        return z.new_zeros((0, h, d))
    route_group = route_groups(experts, groups // h)
    order = torch.argsort(route_group, stable=True)
    counts = torch.bincount(route_group, minlength=groups).tolist()
    zp = pad_features(z.reshape(n * h, d).float())
    y = zp.new_empty((n * h * k, aligned(d)))  # route outputs, flat [N, h, k] order
    start = 0
    for g, count in enumerate(counts):
        if count == 0:
            continue
        routes = order[start : start + count]
        x = zp.new_zeros((max(count, MIN_ROWS), zp.shape[1]))
        x[:count] = zp.index_select(0, routes // k)
        y[routes] = _group_output(x, g, w_gate, w_up, w_down, z.dtype)[:count]
        start += count
    return combine(y.view(n, h, k, -1)[..., :d], weights).to(z.dtype)
