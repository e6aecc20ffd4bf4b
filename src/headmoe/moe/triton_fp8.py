"""The W8A16 MoE GPU path: `headmoe.moe.triton_moe.experts_triton` with FP8 E4M3 weights.

Activations stay in their dtype (bf16 in production; fp16 and fp32 also work, fp32 with
IEEE products); the weights are `headmoe.moe.fp8.Fp8Weight`s (float8_e4m3fn values and one
fp32 scale per (head, expert) and output channel), converted to the activations' dtype
in registers tile by tile (`headmoe.moe.triton_fp8_kernels`), so HBM holds and streams
one byte per weight. Accumulation is fp32; a channel's scale multiplies its accumulator
after the reduction. Everything else (group schedule, tiles, SwiGLU7 rounding, combine,
batch invariance) is the bf16 path's, from `headmoe.moe.triton_moe`. W8A16 needs no FP8
tensor-core instruction: on GPUs before sm_89 (where triton refuses float8_e4m3fn) the
kernels read the weights' bytes as uint8 and widen them with integer operations
(`native_fp8`), so it runs wherever the bf16 kernels run, with the same bits.

Results agree with the CPU FP8 path (`headmoe.moe.fp8_experts.experts_fp8`) within
rounding (the CPU path multiplies the scale into each weight, the kernels into the sum).
"""

from __future__ import annotations

import torch

from headmoe.layers.activations import SWIGLU_ALPHA, SWIGLU_LIMIT
from headmoe.layers.triton_runtime import check_tensors, descriptor, kernels
from headmoe.moe.fp8 import Fp8Weight
from headmoe.moe.fp8_experts import check_fp8_experts
from headmoe.moe.routing import route_groups
from headmoe.moe.triton_moe import (
    DEFAULT_TILES,
    KERNELS,
    MoETiles,
    check_routes,
    group_schedule,
    supported,
    triton_cdiv,
)

#: the module of the W8A16 kernels (imported at the first call)
FP8_KERNELS = "headmoe.moe.triton_fp8_kernels"


def native_fp8(device: torch.device) -> bool:
    """Whether the kernels widen E4M3 with the hardware's conversion on `device` (CUDA
    sm_89 or later, where triton takes float8_e4m3fn) rather than with bit operations."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9)


def _check_args(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                w_gate: Fp8Weight, w_up: Fp8Weight, w_down: Fp8Weight,
                tiles: MoETiles) -> None:
    """ValueError naming the first argument of `experts_triton_fp8` that does not fit."""
    check_routes(z, experts, weights)
    d = z.shape[2]
    check_fp8_experts(z, w_gate, w_up, w_down)
    if not supported(d, w_gate.shape[2], tiles):
        raise ValueError(f"d={d} must be a multiple of tiles.gate_k={tiles.gate_k} and "
                         f"d_expert={w_gate.shape[2]} of tiles.down_k={tiles.down_k}")  # fmt: skip


def _padded_rows(experts: torch.Tensor, groups: int, h: int, block_m: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The group schedule of the routes and where each lands: `(tile_group, tile_rows,
    src, pos)`; src `[P]` int64 token of every padded row (P = T*block_m), pos `[N*h*k]`
    int64 padded row of every route, flat `[N, h, k]` order (see `group_schedule`)."""
    k = experts.shape[2]
    route_group = route_groups(experts, groups // h)
    tile_group, tile_rows, order, row = group_schedule(route_group, groups, block_m)
    src = torch.zeros(tile_group.numel() * block_m, dtype=torch.int64, device=experts.device)
    src[row] = order // (h * k)
    pos = torch.empty_like(row)
    pos[order] = row
    return tile_group, tile_rows, src, pos


def experts_triton_fp8(
    z: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate: Fp8Weight,
    w_up: Fp8Weight,
    w_down: Fp8Weight,
    tiles: MoETiles = DEFAULT_TILES,
    native: bool | None = None,
) -> torch.Tensor:
    """`experts_triton` with FP8 weights (W8A16).

    z: `[N, h, d]` (bf16, fp16 or fp32); experts / weights: `[N, h, k]` int64 ascending ids
    in [0, E) / fp32, from `route`; w_gate, w_up: `Fp8Weight` `[h*E, d, f]` (scale
    `[h*E, f]`), w_down: `[h*E, f, d]` (scale `[h*E, d]`), on z's device; d a multiple of
    `tiles.gate_k`, f of `tiles.down_k`; native: the E4M3 widening (None: `native_fp8` of
    z's device; both give the same bits). Returns `[N, h, d]` in z's dtype. Temporaries
    as `experts_triton`'s."""
    _check_args(z, experts, weights, w_gate, w_up, w_down, tiles)
    kern = kernels(FP8_KERNELS)
    check_tensors(kern.gate_up_fp8_kernel, z=z, experts=experts, weights=weights,
                  w_gate=w_gate.data, w_up=w_up.data, w_down=w_down.data)  # fmt: skip
    n, h, d = z.shape
    k, groups, f = experts.shape[2], w_gate.shape[0], w_gate.shape[2]
    out = torch.empty((n, h, d), dtype=z.dtype, device=z.device)
    if n == 0:
        return out
    if z.stride(2) != 1:
        z = z.contiguous()
    tile_group, tile_rows, src, pos = _padded_rows(experts, groups, h, tiles.block_m)
    native = native_fp8(z.device) if native is None else bool(native)
    wg, wu, wd = (w.data if native else w.data.view(torch.uint8) for w in (w_gate, w_up, w_down))
    bm, rows = tiles.block_m, src.numel()
    hidden = torch.empty((rows, f), dtype=z.dtype, device=z.device)
    routed = torch.empty((rows, d), dtype=torch.float32, device=z.device)
    prec = "ieee" if z.dtype == torch.float32 else "tf32"
    launch = {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages}
    nb_gate, nb_down = triton_cdiv(f, tiles.gate_n), triton_cdiv(d, tiles.down_n)
    gate_block = [tiles.gate_k, tiles.gate_n]
    kern.gate_up_fp8_kernel[(tile_group.numel() * nb_gate,)](
        z, src, tile_group, tile_rows, descriptor(wg.reshape(-1, f), gate_block),
        descriptor(wu.reshape(-1, f), gate_block), w_gate.scale.contiguous(),
        w_up.scale.contiguous(), descriptor(hidden, [bm, tiles.gate_n]), groups, groups // h,
        z.stride(0), z.stride(1), D=d, F=f, LIMIT=SWIGLU_LIMIT, ALPHA=SWIGLU_ALPHA,
        PRECISION=prec, NATIVE=native, N_BLOCKS=nb_gate, BLOCK_M=bm, BLOCK_N=tiles.gate_n,
        BLOCK_K=tiles.gate_k, **launch,
    )  # fmt: skip
    kern.down_fp8_kernel[(tile_group.numel() * nb_down,)](
        descriptor(hidden, [bm, tiles.down_k]),
        descriptor(wd.reshape(-1, d), [tiles.down_k, tiles.down_n]),
        w_down.scale.contiguous(), descriptor(routed, [bm, tiles.down_n]), tile_group, groups,
        F=f, D=d, PRECISION=prec, NATIVE=native, N_BLOCKS=nb_down, BLOCK_M=bm, BLOCK_N=tiles.down_n,
        BLOCK_K=tiles.down_k, **launch,
    )  # fmt: skip
    grid = (triton_cdiv(n * h, tiles.combine_m), triton_cdiv(d, tiles.combine_d))
    kernels(KERNELS).combine_kernel[grid](
        routed, pos, weights.contiguous(), out, n * h, D=d, TOP_K=k, BLOCK_M=tiles.combine_m,
        BLOCK_D=tiles.combine_d, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out
