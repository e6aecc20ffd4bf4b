"""The MoE GPU path: routing and grouped experts as batch-invariant Triton kernels.

Same contract as `headmoe.moe.routing.route` and `headmoe.moe.experts.experts_grouped`
(shapes, dtypes, ascending combine order), for CUDA tensors, or CPU tensors under Triton's
interpreter (tests). triton is imported only when a kernel runs (`headmoe.layers.
triton_runtime`).

Arithmetic: routing logits are fp32 products of the fp32-widened z and the fp32 gate (IEEE
fp32, no TF32); the expert GEMMs take operands in the expert dtype (bf16 in production;
fp16 and fp32 also work, fp32 with IEEE products) and accumulate in fp32; SwiGLU7 runs in
fp32 and is rounded to the expert dtype before W_down; the combine is fp32 in ascending
expert order; the result is rounded to the expert dtype. Results agree with the CPU paths
within rounding, not bit for bit (other GEMM reduction trees, `exp`).

Batch invariance (a (token, head) row's bits do not depend on the other rows of the call):
the routes are sorted into (head, expert) groups on the device (`torch.sort`, stable, and
`torch.searchsorted`; no host sync) and cut into tiles of `block_m` rows, one tile per
program, the grid sized by an upper bound (idle programs exit). Tile shapes are fixed by
`MoETiles` (never by the row count: no autotuning, no split-K), every reduction dim is
walked in one order, a tile's padding rows load zeros and land in rows nobody reads, and
the combine is a separate row-local pass: no atomics. A row's result therefore depends on
its own z row, its group's weights and the tiles only, provided the GPU's MMA gives an
element the same bits wherever its row sits in a tile (expected of the hardware, not yet
measured here: `benchmarks/gpu_check.py` checks it on the device).
"""

from __future__ import annotations

import dataclasses

import torch

from headmoe.config import is_int
from headmoe.layers.activations import SWIGLU_ALPHA, SWIGLU_LIMIT
from headmoe.layers.triton_runtime import (
    KERNEL_FLOATS,
    check_tensors,
    check_tile_sizes,
    descriptor,
    kernels,
)
from headmoe.moe.routing import ROUTE_EPS, route_groups

#: the module of the kernels (imported at the first call)
KERNELS = "headmoe.moe.triton_moe_kernels"


@dataclasses.dataclass(frozen=True)
class MoETiles:
    """Fixed tile configuration of the expert kernels (powers of two >= 16).

    block_m: rows per tile (the group schedule's unit); gate_n/gate_k: d_expert columns and
    d-step of the gate/up kernel; down_n/down_k: d columns and d_expert-step of the down
    kernel; combine_m/combine_d: rows and columns of the combine; num_warps/num_stages:
    CUDA launch options (ignored by the interpreter). row_gather: the gate/up kernel
    addresses z rows as `head * stride_h + token * stride_t` (strides that triton knows
    to be multiples of 16, so the loads vectorise); False: the former gather through
    element offsets loaded from memory (2-byte loads on bf16), kept for the A/B of
    benchmarks/gpu_check.py. Both read the same elements: same bits."""

    block_m: int = 128
    gate_n: int = 128
    gate_k: int = 64
    down_n: int = 256
    down_k: int = 64
    combine_m: int = 16
    combine_d: int = 256
    num_warps: int = 8
    num_stages: int = 3
    row_gather: bool = True
    fused: bool = True
    fused_m: int = 64

    def __post_init__(self) -> None:
        check_tile_sizes(self, tuple(f.name for f in dataclasses.fields(self)[:7]) + ("fused_m",))

    @property
    def schedule_m(self) -> int:
        """Rows per tile of the group schedule: `fused_m` on the fused path, else `block_m`."""
        return self.fused_m if self.fused else self.block_m


#: the production configuration (bf16 on Hopper); fixed, so rows never see another one
DEFAULT_TILES = MoETiles()
#: routing: tokens per program and d-step (the expert dim is one block of next_pow2(E))
ROUTE_BLOCK_M = 32
ROUTE_BLOCK_K = 32


def supported(d: int, d_expert: int, tiles: MoETiles = DEFAULT_TILES) -> bool:
    """Whether `experts_triton` takes head dim d and expert width d_expert with `tiles`
    (d a multiple of `tiles.gate_k`, d_expert of `tiles.down_k`; MAGI-2: 256 and 1280)."""
    return d % tiles.gate_k == 0 and d_expert % tiles.down_k == 0


def _pow2(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _check_float(name: str, t: torch.Tensor, dim: int) -> None:
    if not isinstance(t, torch.Tensor) or t.dim() != dim or t.dtype not in KERNEL_FLOATS:
        got = f"{tuple(t.shape)} {t.dtype}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dim}-d float tensor, got {got}")


def route_triton(
    z: torch.Tensor, gate: torch.Tensor, expert_bias: torch.Tensor, top_k: int,
    route_scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """`headmoe.moe.routing.route` as one Triton kernel.

    z: `[N, h, d]` (fp32/fp16/bf16, routed in fp32); gate: `[h*E, d]` fp32; expert_bias:
    `[h*E]` fp32. Returns experts `[N, h, top_k]` int64 ascending and weights `[N, h, top_k]`
    fp32 (unbiased scores / max(their ascending-order sum, 1e-12) * route_scale); selection
    ties go to the lowest expert id."""
    _check_float("z", z, 3)
    n, h, d = z.shape
    if gate.dtype != torch.float32 or gate.dim() != 2 or gate.shape[1] != d or gate.shape[0] % h:
        raise ValueError(f"gate must be fp32 [h*E, {d}] with h={h}, got "
                         f"{tuple(gate.shape)} {gate.dtype}")  # fmt: skip
    e = gate.shape[0] // h
    if expert_bias.dtype != torch.float32 or tuple(expert_bias.shape) != (h * e,):
        raise ValueError(f"expert_bias must be fp32 [{h * e}], got "
                         f"{tuple(expert_bias.shape)} {expert_bias.dtype}")  # fmt: skip
    if not is_int(top_k) or not 1 <= top_k <= e:
        raise ValueError(f"top_k must be an int in [1, {e}], got {top_k!r}")
    kern = kernels(KERNELS).route_kernel
    check_tensors(kern, z=z, gate=gate, expert_bias=expert_bias)
    ids = torch.empty((n, h, top_k), dtype=torch.int64, device=z.device)
    weights = torch.empty((n, h, top_k), dtype=torch.float32, device=z.device)
    if n == 0:
        return ids, weights
    if z.stride(2) != 1:
        z = z.contiguous()
    grid = (triton_cdiv(n, ROUTE_BLOCK_M), h)
    kern[grid](
        z, gate.contiguous(), expert_bias.contiguous(), ids, weights, n, z.stride(0),
        z.stride(1), float(route_scale), ROUTE_EPS, H=h, E=e, D=d, TOP_K=top_k,
        BLOCK_M=ROUTE_BLOCK_M, BLOCK_E=_pow2(e), BLOCK_K=ROUTE_BLOCK_K, num_warps=8,
    )  # fmt: skip
    return ids, weights


def triton_cdiv(a: int, b: int) -> int:
    """`ceil(a / b)` for non-negative ints."""
    return -(-a // b)


def group_schedule(
    route_group: torch.Tensor, groups: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort routes into groups and lay every group out in whole tiles, on the routes' device.

    route_group: `[R]` int64 group id (head*E + expert) of every route, flat `[N, h, k]`
    order. Tile t owns padded rows `[t*block_m, (t+1)*block_m)`; a group's tiles are
    consecutive and its routes fill them in route order. The tile count has the upper
    bound T = min(R, ceil(R/block_m) + groups), known without a host sync; tiles past the
    last real one are idle. Returns `(tile_group, tile_rows, order, row)`: tile_group `[T]`
    int32 (`groups` for idle tiles), tile_rows `[T]` int32 (real rows in the tile), order
    `[R]` int64 (routes sorted by group, stable), row `[R]` int64 (padded row of
    `order[i]`)."""
    r = route_group.numel()
    dev = route_group.device
    sorted_group, order = torch.sort(route_group, stable=True)
    ends = torch.searchsorted(sorted_group, torch.arange(groups, device=dev), right=True)
    counts = torch.diff(ends, prepend=ends.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    first = tile_ends - tiles  # each group's first tile
    t = torch.arange(min(r, triton_cdiv(r, block_m) + groups), device=dev)
    tile_group = torch.searchsorted(tile_ends, t, right=True)
    g = tile_group.clamp_max(groups - 1)
    tile_rows = (counts[g] - (t - first[g]) * block_m).clamp(0, block_m)
    tile_rows = torch.where(tile_group < groups, tile_rows, 0)
    rank = torch.arange(r, device=dev) - (ends - counts)[sorted_group]  # index in its group
    row = first[sorted_group] * block_m + rank
    return tile_group.to(torch.int32), tile_rows.to(torch.int32), order, row


def check_routes(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> None:
    """ValueError naming the first of the experts kernels' token inputs that does not fit:
    z `[N, h, d]` float, experts `[N, h, k]` int64, weights `[N, h, k]` fp32 (every weight
    format's experts path checks them so)."""
    _check_float("z", z, 3)
    n, h, _ = z.shape
    if experts.dtype != torch.int64 or experts.dim() != 3 or experts.shape[:2] != (n, h):
        raise ValueError(f"experts must be int64 [{n}, {h}, k], got "
                         f"{tuple(experts.shape)} {experts.dtype}")  # fmt: skip
    if weights.dtype != torch.float32 or weights.shape != experts.shape:
        raise ValueError(f"weights must be fp32 {tuple(experts.shape)}, got "
                         f"{tuple(weights.shape)} {weights.dtype}")  # fmt: skip


def _check_experts_args(z: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor,
                        w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor,
                        tiles: MoETiles) -> None:
    """ValueError naming the first argument of `experts_triton` with a bad shape or dtype."""
    check_routes(z, experts, weights)
    _, h, d = z.shape
    rows, f = w_gate.shape[0], (w_gate.shape[2] if w_gate.dim() == 3 else -1)
    expected = {"w_gate": (rows, d, f), "w_up": (rows, d, f), "w_down": (rows, f, d)}
    for name, t in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if tuple(t.shape) != expected[name] or t.dtype != z.dtype or rows % h or rows == 0:
            raise ValueError(f"{name} must be {z.dtype} {expected[name]} (rows = h*E, h={h}), "
                             f"got {tuple(t.shape)} {t.dtype}")  # fmt: skip
    if not supported(d, f, tiles):
        raise ValueError(f"d={d} must be a multiple of tiles.gate_k={tiles.gate_k} and "
                         f"d_expert={f} of tiles.down_k={tiles.down_k}")  # fmt: skip


#: the experts kernels' row gather: z, the z row of every padded row, tile groups, tile rows
Gather = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _launch_options(z: torch.Tensor, tiles: MoETiles) -> dict[str, object]:
    """The experts kernels' shared launch arguments."""
    return {"PRECISION": "ieee" if z.dtype == torch.float32 else "tf32",
            "ROW_GATHER": tiles.row_gather, "LIMIT": SWIGLU_LIMIT, "ALPHA": SWIGLU_ALPHA,
            "num_warps": tiles.num_warps, "num_stages": tiles.num_stages}  # fmt: skip


def _expert_tile(gather: Gather, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, routed: torch.Tensor, tiles: MoETiles) -> None:  # fmt: skip
    """`expert_tile_kernel` over the schedule's tiles: routed `[P, d]` fp32 padded rows."""
    z, _src, tile_group, _rows = gather
    groups, d, f = w_gate.shape[0], w_gate.shape[1], w_gate.shape[2]
    h = z.shape[1]
    bm, nb = tiles.fused_m, triton_cdiv(d, tiles.down_n)
    gate_block = [tiles.gate_k, tiles.down_k]
    kernels(KERNELS).expert_tile_kernel[(tile_group.numel() * nb,)](
        *gather, descriptor(w_gate.reshape(-1, f), gate_block),
        descriptor(w_up.reshape(-1, f), gate_block),
        descriptor(w_down.reshape(-1, d), [tiles.down_k, tiles.down_n]),
        descriptor(routed, [bm, tiles.down_n]), groups, groups // h, z.stride(0), z.stride(1),
        D=d, F=f, N_BLOCKS=nb, BLOCK_M=bm, BLOCK_N=tiles.down_n, BLOCK_F=tiles.down_k,
        BLOCK_K=tiles.gate_k, **_launch_options(z, tiles),
    )  # fmt: skip


def _two_kernels(gather: Gather, w_gate: torch.Tensor, w_up: torch.Tensor,
                 w_down: torch.Tensor, routed: torch.Tensor, tiles: MoETiles) -> None:  # fmt: skip
    """`gate_up_kernel` (hidden `[P, f]` rows in z's dtype) then `down_kernel`."""
    z, _src, tile_group, _rows = gather
    groups, d, f = w_gate.shape[0], w_gate.shape[1], w_gate.shape[2]
    h = z.shape[1]
    kern = kernels(KERNELS)
    hidden = torch.empty((routed.shape[0], f), dtype=z.dtype, device=z.device)
    opts = _launch_options(z, tiles)
    bm = tiles.block_m
    nb_gate, nb_down = triton_cdiv(f, tiles.gate_n), triton_cdiv(d, tiles.down_n)
    gate_block = [tiles.gate_k, tiles.gate_n]
    kern.gate_up_kernel[(tile_group.numel() * nb_gate,)](
        *gather, descriptor(w_gate.reshape(-1, f), gate_block),
        descriptor(w_up.reshape(-1, f), gate_block), descriptor(hidden, [bm, tiles.gate_n]),
        groups, groups // h, z.stride(0), z.stride(1), D=d, N_BLOCKS=nb_gate, BLOCK_M=bm,
        BLOCK_N=tiles.gate_n, BLOCK_K=tiles.gate_k, **opts,
    )  # fmt: skip
    del opts["ROW_GATHER"], opts["LIMIT"], opts["ALPHA"]
    kern.down_kernel[(tile_group.numel() * nb_down,)](
        descriptor(hidden, [bm, tiles.down_k]),
        descriptor(w_down.reshape(-1, d), [tiles.down_k, tiles.down_n]),
        descriptor(routed, [bm, tiles.down_n]), tile_group, groups, F=f, N_BLOCKS=nb_down,
        BLOCK_M=bm, BLOCK_N=tiles.down_n, BLOCK_K=tiles.down_k, **opts,
    )  # fmt: skip


def experts_triton(
    z: torch.Tensor,
    experts: torch.Tensor,
    weights: torch.Tensor,
    w_gate: torch.Tensor,
    w_up: torch.Tensor,
    w_down: torch.Tensor,
    tiles: MoETiles = DEFAULT_TILES,
) -> torch.Tensor:
    """`experts_grouped` as Triton kernels: the fused expert tile (gather + W_gate/W_up +
    SwiGLU7 + W_down, `tiles.fused`) or gate/up then down, and the combine.

    z: `[N, h, d]` (bf16, fp16 or fp32); experts / weights: `[N, h, k]` int64 ascending ids
    in [0, E) / fp32, from `route`; w_gate, w_up: `[h*E, d, f]`, w_down: `[h*E, f, d]`, in
    z's dtype; d a multiple of `tiles.gate_k`, f of `tiles.down_k`. Returns `[N, h, d]` in
    z's dtype. Temporaries: P = T*m padded rows (m = `tiles.schedule_m`, T from
    `group_schedule`, P < N*h*k + h*E*m) of d in fp32, and on the two-kernel path of f in
    z's dtype. Rows compared for bits must come from calls with the same `tiles`."""
    _check_experts_args(z, experts, weights, w_gate, w_up, w_down, tiles)
    kern = kernels(KERNELS)
    check_tensors(kern.gate_up_kernel, z=z, experts=experts, weights=weights, w_gate=w_gate,
                  w_up=w_up, w_down=w_down)  # fmt: skip
    n, h, d = z.shape
    k, groups = experts.shape[2], w_gate.shape[0]
    out = torch.empty((n, h, d), dtype=z.dtype, device=z.device)
    if n == 0:
        return out
    if z.stride(2) != 1:
        z = z.contiguous()
    route_group = route_groups(experts, groups // h)
    tile_group, tile_rows, order, row = group_schedule(route_group, groups, tiles.schedule_m)
    rows = tile_group.numel() * tiles.schedule_m
    src = torch.zeros(rows, dtype=torch.int64, device=z.device)  # z row of every padded row
    token, head = order // (h * k), (order // k) % h
    src[row] = token if tiles.row_gather else token * z.stride(0) + head * z.stride(1)
    pos = torch.empty_like(row)
    pos[order] = row  # padded row of every route, flat [N, h, k] order
    routed = torch.empty((rows, d), dtype=torch.float32, device=z.device)
    gather = (z, src, tile_group, tile_rows)
    (_expert_tile if tiles.fused else _two_kernels)(gather, w_gate, w_up, w_down, routed, tiles)
    grid = (triton_cdiv(n * h, tiles.combine_m), triton_cdiv(d, tiles.combine_d))
    kern.combine_kernel[grid](
        routed, pos, weights.contiguous(), out, n * h, D=d, TOP_K=k, BLOCK_M=tiles.combine_m,
        BLOCK_D=tiles.combine_d, num_warps=tiles.num_warps,
    )  # fmt: skip
    return out
