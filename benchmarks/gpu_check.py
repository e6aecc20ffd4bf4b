"""One-GPU check of headmoe's Triton path (issue 14), in one run of under 8 minutes:

(a) the kernels against the torch paths and bit-identical rows across batchings, in bf16
    on the device (routing, experts, attention, and the MoE layer's dispatch);
(b) the MoE experts at MAGI-2 EP4 per-rank shapes (3 heads x 256 experts, 256 -> 1280 ->
    256, top-6, 14,836 and 29,672 tokens, bf16) in TFLOP/s and % of the H200's dense bf16
    peak, beside the per-group loop (`experts_grouped` on CUDA) and a dense-GEMM bound of
    the same FLOPs (cuBLAS bf16 GEMMs of the same M, N, K), timed in the same run;
(c) sink attention at 272p per-rank shapes (Ulysses SP8: 3 heads of 128, 2 segments of
    14,836 tokens) in TFLOP/s, beside torch SDPA (no sink) on the same shapes;
(d) one layer-shaped workload at SP8/EP4 per-rank shapes, self-contained (the model code
    is being rewritten): RMSNorm, linear_qkv, attention over the full sequence for the
    rank's 3 heads, linear_proj, split_linear, the MoE for the rank's 3 heads of 4 ranks'
    tokens, merge_linear and the shared experts, in ms; no collectives (one GPU);
(e) a table on stdout and in the markdown file `--out`;
(f) the refiner's block-grid range attention at 1080p (63x68x120 latents + 512 text
    tokens, SP8 per-rank heads: 4 query, 1 KV, 128 dims, bf16): against the CPU path,
    head-subset rows bit-identical, TFLOP/s of the attended pairs beside dense SDPA over as
    many pairs.

Targets (printed as ratios, never asserted by timed tests): experts >= 30% of peak at
29,672 tokens and >= 10x the per-group loop; attention >= 40% of peak; every invariance
check bit-identical. The exit status is 1 when a correctness or invariance check fails.

`--dry-run`: tiny shapes on the CPU under Triton's interpreter (fp32, the row-local dot of
`headmoe.layers.triton_runtime`), every code path except the timing.

    benchmarks/gpu_check.sh --out gpu_check.md
    benchmarks/gpu_check.sh --dry-run --out /tmp/gpu_check_dry.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import statistics
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from headmoe.layers import triton_runtime
from headmoe.layers.activations import swiglu7
from headmoe.layers.triton_attention import (
    DEFAULT_ATTENTION_TILES,
    AttentionTiles,
    triton_segment_attention,
    triton_sink_attention,
)
from headmoe.moe import MoEConfig, MultiHeadMoE, experts_grouped, experts_reference, route
from headmoe.moe.triton_moe import DEFAULT_TILES, MoETiles, experts_triton, route_triton

#: H200 dense bf16 tensor-core peak, TFLOP/s
PEAK_TFLOPS = 989.0
#: other fixed tiles timed beside the defaults (tuning data only; the defaults stay fixed).
#: A dry run takes the first of each.
MOE_SWEEP = (
    dataclasses.replace(DEFAULT_TILES, num_stages=4),
    dataclasses.replace(DEFAULT_TILES, block_m=64, num_warps=4),
    dataclasses.replace(DEFAULT_TILES, down_n=128),
)
ATTENTION_SWEEP = (
    AttentionTiles(block_m=128, block_n=128, num_warps=8, num_stages=2),
    AttentionTiles(block_m=128, block_n=64, num_warps=4, num_stages=3),
)


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Per-rank sizes: MoE heads x experts, head dim d, expert width f, top-k, token counts
    (moe_tokens timed, check_tokens for the checks); attention heads x head_dim over
    `segments` segments of `segment` tokens; hidden size C, shared-expert width, tokens of
    the rank (t_local) and the EP degree (MoE rows = ep * t_local)."""

    heads: int
    experts: int
    d: int
    f: int
    top_k: int
    moe_tokens: tuple[int, ...]
    check_tokens: int
    attn_heads: int
    head_dim: int
    segment: int
    segments: int
    hidden: int
    shared: int
    t_local: int
    ep: int
    reps: int


FULL = Shapes(3, 256, 256, 1280, 6, (14_836, 29_672), 4096, 3, 128, 14_836, 2, 3072, 2560,
              3709, 4, 5)  # fmt: skip
DRY = Shapes(3, 4, 64, 128, 2, (40, 80), 96, 3, 16, 40, 2, 64, 64, 10, 4, 0)


@dataclasses.dataclass
class Report:
    """Rows of the result table: (section, item, shape, value, target, ok or None)."""

    rows: list[tuple[str, str, str, str, str, bool | None]] = dataclasses.field(
        default_factory=list
    )

    def add(self, section: str, item: str, shape: str, value: str, target: str = "",
            ok: bool | None = None) -> None:  # fmt: skip
        self.rows.append((section, item, shape, value, target, ok))
        mark = {True: "ok", False: "FAIL", None: ""}[ok]
        print(f"[{section}] {item} ({shape}): {value} {target} {mark}".rstrip(), flush=True)

    def markdown(self) -> str:
        lines = ["| | check | shape | result | target | |", "|---|---|---|---|---|---|"]
        for section, item, shape, value, target, ok in self.rows:
            mark = {True: "ok", False: "**FAIL**", None: ""}[ok]
            lines.append(f"| {section} | {item} | {shape} | {value} | {target} | {mark} |")
        return "\n".join(lines) + "\n"

    def failed_checks(self) -> list[str]:
        return [r[1] for r in self.rows if r[0] == "a" and r[5] is False]


class Timer:
    """Median milliseconds of `reps` CUDA-event-timed calls after two warm-up calls; in a
    dry run one untimed call and None."""

    def __init__(self, dry: bool, reps: int):
        self.dry, self.reps = dry, reps

    def __call__(self, fn: Callable[[], Any]) -> float | None:
        if self.dry:
            fn()
            return None
        cuda = torch.cuda
        for _ in range(2):
            fn()
        times = []
        for _ in range(self.reps):
            start, stop = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return statistics.median(times)


def tflops(flop: float, ms: float | None) -> str:
    """`flop` over `ms` as "x TFLOP/s (y% of peak)", or "ran (dry)"."""
    if ms is None:
        return "ran (dry)"
    t = flop / ms / 1e9
    return f"{t:,.1f} TFLOP/s ({100 * t / PEAK_TFLOPS:.1f}% of {PEAK_TFLOPS:.0f}), {ms:.3f} ms"


def tile_text(tiles: MoETiles | AttentionTiles) -> str:
    """The fields of `tiles` that differ from the defaults, as "name=value" pairs."""
    default = DEFAULT_TILES if isinstance(tiles, MoETiles) else DEFAULT_ATTENTION_TILES
    diff = [f"{f.name}={getattr(tiles, f.name)}" for f in dataclasses.fields(tiles)
            if getattr(tiles, f.name) != getattr(default, f.name)]  # fmt: skip
    return ", ".join(diff)


def mismatched_rows(a: Any, b: Any) -> int:
    """Rows (first dim) of a and b that are not bit-identical."""
    if a.shape != b.shape:
        return a.shape[0] if a.dim() else 1
    return int((~(a == b).reshape(a.shape[0], -1).all(1)).sum()) if a.numel() else 0


@contextlib.contextmanager
def forced_triton(on: bool) -> Iterator[None]:
    """In a dry run, let the layers take the Triton path on CPU tensors."""
    real = triton_runtime.use_triton
    if on:
        triton_runtime.use_triton = lambda t: True
    try:
        yield
    finally:
        triton_runtime.use_triton = real


# ---------------------------------------------------------------------------- inputs
def moe_inputs(sh: Shapes, n: int, dtype: torch.dtype, seed: int) -> dict[str, Any]:
    """Random MoE inputs on the current device: z `[n, heads, d]`, an fp32 router (gate,
    bias) and expert weights in `dtype`, scaled like a trained layer's."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    rows, d, f = sh.heads * sh.experts, sh.d, sh.f

    def rnd(*shape: int, scale: float = 1.0, dt: torch.dtype = dtype) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=DEVICE) * scale).to(dt)

    return {
        "z": rnd(n, sh.heads, d),
        "gate": rnd(rows, d, scale=d**-0.5, dt=torch.float32),
        "bias": rnd(rows, scale=0.05, dt=torch.float32),
        "weights": [rnd(rows, d, f, scale=d**-0.5), rnd(rows, d, f, scale=d**-0.5),
                    rnd(rows, f, d, scale=f**-0.5)],
    }  # fmt: skip


def attention_reference(q, k, v, sinks, scale):
    """fp32 sink attention from its definition: softmax over [q.k * scale, sink] with a zero
    value for the sink; q `[L, Hq, D]`, k/v `[Lk, Hkv, D]` (GQA). Returns fp32."""
    rep = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(rep, dim=1) for t in (k, v))
    logits = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    sink = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
    p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", p, vf)


def group_sizes(ids: torch.Tensor, experts: int) -> torch.Tensor:
    """Rows per (head, expert) group of routes `[N, h, k]`, non-empty groups only."""
    heads = torch.arange(ids.shape[1], device=ids.device).view(1, -1, 1)
    counts = torch.bincount((ids + heads * experts).reshape(-1))
    return counts[counts > 0]


# ---------------------------------------------------------------------------- (a) checks
def check_routing(rep: Report, sh: Shapes, inp: dict[str, Any]) -> tuple[Any, Any]:
    """Triton routing against torch's `route` on the same device; returns torch's routes."""
    z, n = inp["z"], inp["z"].shape[0]
    ids, w = route(z, inp["gate"], inp["bias"], sh.top_k, 4.9)
    tids, tw = route_triton(z, inp["gate"], inp["bias"], sh.top_k, 4.9)
    same = (tids == ids).all(-1)
    share = float(same.float().mean())
    err = float((tw - w).abs()[same].max()) if bool(same.any()) else float("inf")
    shape = f"{n} tok x {sh.heads} heads x {sh.experts} experts, top-{sh.top_k}"
    rep.add("a", "routing: same experts as torch route", shape, f"{100 * share:.3f}% of rows",
            ">= 99.9%", share >= 0.999)  # fmt: skip
    rep.add("a", "routing: weight error where same", shape, f"{err:.2e}", "<= 1e-5", err <= 1e-5)
    return ids, w


def check_experts(rep: Report, sh: Shapes, inp: dict[str, Any], ids, w) -> None:
    """Triton experts against the reference loop, and bit-identical rows across batchings."""
    z, wts, n = inp["z"], inp["weights"], inp["z"].shape[0]
    full = experts_triton(z, ids, w, *wts)
    ref = experts_reference(z, ids, w, *wts).float()
    rel = float((full.float() - ref).abs().max() / ref.abs().max())
    shape = f"{n} tok, {z.dtype}".replace("torch.", "")
    tol = 2e-2 if z.dtype == torch.bfloat16 else 1e-4
    rep.add("a", "experts vs reference loop (max err / max)", shape, f"{rel:.2e}",
            f"<= {tol:g}", rel <= tol)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    bad, sizes = 0, []
    fids, fw = route_triton(z, inp["gate"], inp["bias"], sh.top_k, 4.9)
    for m in (1, 5, 37, n // 8, n // 3, n - 1):
        idx = torch.randperm(n, generator=g)[:m].to(z.device)
        sizes.append(group_sizes(ids[idx], sh.experts))
        bad += mismatched_rows(experts_triton(z[idx], ids[idx], w[idx], *wts), full[idx])
        tids, tw = route_triton(z[idx], inp["gate"], inp["bias"], sh.top_k, 4.9)
        bad += mismatched_rows(tids, fids[idx]) + mismatched_rows(tw, fw[idx])
    other = moe_inputs(sh, n // 2 + 3, z.dtype, seed=9)
    oids, ow = route(other["z"], inp["gate"], inp["bias"], sh.top_k, 4.9)
    both = experts_triton(torch.cat([other["z"], z]), torch.cat([oids, ids]),
                          torch.cat([ow, w]), *wts)  # fmt: skip
    bad += mismatched_rows(both[other["z"].shape[0]:], full)
    s = torch.cat(sizes)
    rep.add("a", "experts+routing rows bit-identical (6 random sub-batches, permuted, and a "
            "concatenation)", f"{shape}, groups of {int(s.min())}..{int(s.max())} rows",
            f"{bad} rows differ", "0", bad == 0)  # fmt: skip


def check_layer_dispatch(rep: Report, sh: Shapes, dtype: torch.dtype, dry: bool) -> None:
    """`MultiHeadMoE` on this device takes the Triton path: same bits as the kernels."""
    cfg = MoEConfig(hidden_size=sh.heads * sh.d, num_heads=sh.heads, num_experts=sh.experts,
                    top_k=sh.top_k, expert_intermediate_size=sh.f, route_scale=4.9,
                    dtype=dtype)  # fmt: skip
    inp = moe_inputs(sh, 64, dtype, seed=3)
    moe = MultiHeadMoE(cfg).to(DEVICE)
    for p, src in zip((moe.W_gate, moe.W_up, moe.W_down), inp["weights"]):
        p.copy_(src)
    moe.gate.copy_(inp["gate"])
    moe.router.expert_bias.copy_(inp["bias"])
    with forced_triton(dry):
        got = moe(inp["z"].reshape(64, -1)).view(64, sh.heads, sh.d)
    ids, w = route_triton(inp["z"], inp["gate"], inp["bias"], sh.top_k, 4.9)
    want = experts_triton(inp["z"], ids, w, *inp["weights"])
    bad = mismatched_rows(got, want)
    rep.add("a", "MultiHeadMoE on this device = Triton kernels", "64 tok", f"{bad} rows differ",
            "0", bad == 0)  # fmt: skip


def check_attention(rep: Report, sh: Shapes, dtype: torch.dtype) -> None:
    """Attention against the fp32 definition; bit-identical query rows across batchings."""
    length, hq, dim = min(sh.segment, 3000), sh.attn_heads, sh.head_dim
    g = torch.Generator(device=DEVICE).manual_seed(5)
    q, k, v = (torch.randn(length, hq, dim, generator=g, device=DEVICE).to(dtype)
               for _ in range(3))  # fmt: skip
    sinks = torch.randn(hq, generator=g, device=DEVICE)
    scale = dim**-0.5
    full = triton_sink_attention(q, k, v, sinks, scale)
    ref = attention_reference(q, k, v, sinks, scale)
    err = float((full.float() - ref).abs().max())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    shape = f"L={length}, {hq} heads x {dim}, {dtype}".replace("torch.", "")
    rep.add("a", "attention vs fp32 definition (max abs err)", shape, f"{err:.2e}",
            f"<= {tol:g}", err <= tol)  # fmt: skip
    bad = 0
    for a, b in ((0, 1), (length // 7, length // 2), (length - 5, length)):
        bad += mismatched_rows(triton_sink_attention(q[a:b], k, v, sinks, scale), full[a:b])
    idx = torch.randperm(length, generator=torch.Generator().manual_seed(6))[:301].to(DEVICE)
    bad += mismatched_rows(triton_sink_attention(q[idx], k, v, sinks, scale), full[idx])
    part = triton_sink_attention(q[:, 1:], k[:, 1:], v[:, 1:], sinks[1:], scale)
    bad += mismatched_rows(part, full[:, 1:])
    pre = length // 3
    packed = triton_segment_attention(torch.cat([q[:pre], q]), torch.cat([k[:pre], k]),
                                      torch.cat([v[:pre], v]), [(0, pre), (pre, pre + length)],
                                      sinks, scale)  # fmt: skip
    bad += mismatched_rows(packed[pre:], full)
    rep.add("a", "attention rows bit-identical (query slices, gathered rows, head subset, "
            "packed after another segment)", shape, f"{bad} rows differ", "0", bad == 0)


# ---------------------------------------------------------------------------- (b) MoE
def dense_bound(routes: int, d: int, f: int, dtype: torch.dtype) -> Callable[[], Any]:
    """The experts' FLOPs as two dense GEMMs: `[R, d] @ [d, 2f]` and `[R, f] @ [f, d]`."""
    a = torch.randn(routes, d, device=DEVICE).to(dtype)
    b = torch.randn(d, 2 * f, device=DEVICE).to(dtype)
    h = torch.randn(routes, f, device=DEVICE).to(dtype)
    c = torch.randn(f, d, device=DEVICE).to(dtype)
    return lambda: (a @ b, h @ c)


def bench_moe(rep: Report, sh: Shapes, dtype: torch.dtype, timer: Timer) -> None:
    """Experts (Triton), routing + experts (Triton), the per-group loop and the dense bound."""
    for n in sh.moe_tokens:
        inp = moe_inputs(sh, n, dtype, seed=n)
        z, wts = inp["z"], inp["weights"]
        ids, w = route_triton(z, inp["gate"], inp["bias"], sh.top_k, 4.9)
        routes = n * sh.heads * sh.top_k
        flop = 6.0 * sh.d * sh.f * routes
        route_flop = 2.0 * n * sh.heads * sh.experts * sh.d
        shape = f"{n:,} tok x {sh.heads} heads, {sh.experts} experts, top-{sh.top_k}"
        t_exp = timer(lambda z=z, ids=ids, w=w, wts=wts: experts_triton(z, ids, w, *wts))

        def both(inp: dict[str, Any] = inp) -> Any:
            ids, w = route_triton(inp["z"], inp["gate"], inp["bias"], sh.top_k, 4.9)
            return experts_triton(inp["z"], ids, w, *inp["weights"])

        t_all = timer(both)
        t_route = timer(lambda inp=inp: route_triton(inp["z"], inp["gate"], inp["bias"],
                                                     sh.top_k, 4.9))  # fmt: skip
        loop_timer = Timer(timer.dry, max(1, min(timer.reps, 2)))
        t_loop = loop_timer(lambda z=z, ids=ids, w=w, wts=wts: experts_grouped(z, ids, w, *wts))
        t_dense = timer(dense_bound(routes, sh.d, sh.f, dtype))
        big = n == max(sh.moe_tokens)
        ok = None if t_exp is None else flop / t_exp / 1e9 >= 0.3 * PEAK_TFLOPS
        rep.add("b", "experts, Triton", shape, tflops(flop, t_exp),
                ">= 30% of peak" if big else "", ok if big else None)  # fmt: skip
        rep.add("b", "routing alone, Triton (fp32 IEEE logits)", shape,
                tflops(route_flop, t_route))  # fmt: skip
        rep.add("b", "routing + experts, Triton", shape, tflops(flop + route_flop, t_all))
        rep.add("b", "experts, per-group loop (experts_grouped on this device)", shape,
                tflops(flop, t_loop))  # fmt: skip
        dense = f"dense {str(dtype).replace('torch.', '')} GEMMs of the same FLOPs (torch.mm)"
        rep.add("b", dense, shape, tflops(flop, t_dense))
        if big:
            for tiles in MOE_SWEEP[: 1 if timer.dry else None]:
                ms = timer(lambda tiles=tiles, z=z, ids=ids, w=w, wts=wts: experts_triton(
                    z, ids, w, *wts, tiles=tiles))  # fmt: skip
                rep.add("b", f"experts, Triton, other tiles: {tile_text(tiles)}", shape,
                        tflops(flop, ms))  # fmt: skip
        if t_exp is not None and t_loop is not None:
            ratio = t_loop / t_exp
            rep.add("b", "speed-up over the per-group loop", shape, f"{ratio:.1f}x",
                    ">= 10x" if big else "", (ratio >= 10) if big else None)  # fmt: skip
            rep.add("b", "experts / dense bound", shape, f"{100 * t_dense / t_exp:.0f}%")


# ---------------------------------------------------------------------------- (c) attention
def bench_attention(rep: Report, sh: Shapes, dtype: torch.dtype, timer: Timer) -> None:
    """Sink attention over `segments` packed segments, and SDPA (no sink) per segment."""
    length = sh.segment * sh.segments
    g = torch.Generator(device=DEVICE).manual_seed(7)
    q, k, v = (torch.randn(length, sh.attn_heads, sh.head_dim, generator=g, device=DEVICE)
               .to(dtype) for _ in range(3))  # fmt: skip
    sinks = torch.randn(sh.attn_heads, generator=g, device=DEVICE)
    segs = [(i * sh.segment, (i + 1) * sh.segment) for i in range(sh.segments)]
    scale = sh.head_dim**-0.5
    flop = 4.0 * sh.segment**2 * sh.head_dim * sh.attn_heads * sh.segments
    shape = f"{sh.segments} x {sh.segment:,} tok, {sh.attn_heads} heads x {sh.head_dim}"
    t = timer(lambda: triton_segment_attention(q, k, v, segs, sinks, scale))
    ok = None if t is None else flop / t / 1e9 >= 0.4 * PEAK_TFLOPS
    rep.add("c", "sink attention, Triton", shape, tflops(flop, t), ">= 40% of peak", ok)
    for tiles in ATTENTION_SWEEP[: 1 if timer.dry else None]:
        ms = timer(lambda tiles=tiles: triton_segment_attention(q, k, v, segs, sinks, scale,
                                                                tiles=tiles))  # fmt: skip
        rep.add("c", f"sink attention, other tiles: {tile_text(tiles)}", shape, tflops(flop, ms))
    heads = [t_.transpose(0, 1).unsqueeze(0).contiguous() for t_ in (q, k, v)]

    def sdpa() -> Any:
        for a, b in segs:
            torch.nn.functional.scaled_dot_product_attention(
                *(x[:, :, a:b] for x in heads), scale=scale
            )

    rep.add("c", "torch SDPA per segment, no sink (reference)", shape, tflops(flop, timer(sdpa)))


# ---------------------------------------------------------------------------- (f) refiner
#: the refiner's block-grid attention: (latent T, H, W, text tokens, query heads, KV heads,
#: head dim); full: 1080p at SP8 per-rank heads; dry: a ragged 9x5x14 grid
REFINER_FULL = (63, 68, 120, 512, 4, 1, 128)
REFINER_DRY = (9, 5, 14, 6, 4, 2, 16)


def refiner_attention(rep: Report, dry: bool, dtype: torch.dtype, timer: Timer) -> None:
    """(f) The refiner's block-sparse range attention (`triton_range_attention`) over the
    1080p block grid at SP8 per-rank heads: against the CPU path on a slice of the query
    tiles (max abs error), rows bit-identical for a head subset, and TFLOP/s of the
    attended pairs beside dense SDPA (FlashAttention) over as many pairs."""
    from headmoe.layers.range_attention import RangePlan, range_attention_reference
    from headmoe.layers.triton_range_attention import triton_range_attention
    from headmoe.models.refiner import attention_plan, get_refiner_config, pack_refiner

    t, h, w, lt, hq, hkv, dim = REFINER_DRY if dry else REFINER_FULL
    cfg = get_refiner_config("magi2-refiner")
    packed = pack_refiner(torch.zeros(48, t, h, w), torch.zeros(lt, cfg.text_in_channels), cfg)
    plan = attention_plan(packed)
    n, pairs = plan.num_tokens, plan.pairs()
    g = torch.Generator(device=DEVICE).manual_seed(11)
    q, k, v = (torch.randn(n, heads, dim, generator=g, device=DEVICE).to(dtype)
               for heads in (hq, hkv, hkv))  # fmt: skip
    scale = dim**-0.5
    shape = f"{t}x{h}x{w}+{lt} tok, {hq}/{hkv} heads x {dim}"
    full = triton_range_attention(q, k, v, plan, scale)
    few = slice(0, min(48, len(plan.q_tiles)))  # some tiles: the CPU path is slow at 1080p
    part = RangePlan(plan.q_tiles[few], plan.k_offsets[: few.stop + 1],
                     plan.k_ranges[: int(plan.k_offsets[few.stop])], n)
    ref = range_attention_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), part,
                                     scale)
    rows = int(plan.q_tiles[few.stop - 1, 1])
    err = float((full[:rows].float().cpu() - ref[:rows]).abs().max())
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    rep.add("f", "refiner attention vs CPU path (max abs err, first tiles)", shape,
            f"{err:.2e}", f"<= {tol:g}", err <= tol)
    sub = triton_range_attention(q[:, hq // hkv:], k[:, 1:], v[:, 1:], plan, scale)
    bad = mismatched_rows(sub, full[:, hq // hkv:])
    rep.add("f", "refiner attention rows bit-identical (head subset)", shape,
            f"{bad} rows differ", "0", bad == 0)
    flop = 4.0 * pairs * dim * hq
    rep.add("f", f"refiner attention, Triton ({pairs:.3g} pairs, "
            f"{100 * pairs / n**2:.2f}% of dense)", shape, tflops(flop, timer(
                lambda: triton_range_attention(q, k, v, plan, scale))))
    side = int(pairs**0.5)  # dense attention over as many pairs
    dq, dk, dv = (torch.randn(1, hq, side, dim, generator=g, device=DEVICE).to(dtype)
                  for _ in range(3))  # fmt: skip
    rep.add("f", "dense SDPA over the same pairs (reference)", f"L={side:,}, {hq} heads x {dim}",
            tflops(4.0 * side**2 * dim * hq, timer(
                lambda: torch.nn.functional.scaled_dot_product_attention(dq, dk, dv,
                                                                         scale=scale))))


# ---------------------------------------------------------------------------- (d) layer
def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """MAGI-2's RMSNorm in fp32 (`x * rsqrt(mean(x^2) + 1e-6) * (1 + w)`), back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)).to(x.dtype)


def layer_parts(sh: Shapes, dtype: torch.dtype) -> dict[str, Callable[[], Any]]:
    """The per-rank work of one MoE layer at SP8/EP4, as named steps on random tensors.

    The two all-to-alls of each branch are not run (one GPU): attention gets random q, k, v
    of the full sequence for the rank's heads, the MoE random rows for its heads of the EP
    group's tokens (ep * t_local), and the linears run on the rank's t_local rows."""
    c, t, dev = sh.hidden, sh.t_local, DEVICE
    g = torch.Generator(device=dev).manual_seed(11)

    def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dtype)

    x, w_norm = rnd(t, c), torch.zeros(c, device=dev)
    lin = {"qkv": rnd(3 * c, c, scale=c**-0.5), "g": rnd(c // sh.head_dim, c, scale=c**-0.5),
           "proj": rnd(c, c, scale=c**-0.5), "split": rnd(c, c, scale=c**-0.5),
           "merge": rnd(c, c, scale=c**-0.5), "fc1": rnd(2 * sh.shared, c, scale=c**-0.5),
           "fc2": rnd(c, sh.shared, scale=sh.shared**-0.5)}  # fmt: skip
    length = sh.segment * sh.segments
    q, k, v = (rnd(length, sh.attn_heads, sh.head_dim) for _ in range(3))
    sinks = torch.randn(sh.attn_heads, generator=g, device=dev)
    segs = [(i * sh.segment, (i + 1) * sh.segment) for i in range(sh.segments)]
    moe = moe_inputs(sh, sh.ep * t, dtype, seed=12)
    attn_out = rnd(t, c)
    F = torch.nn.functional

    def attn_in() -> Any:
        xn = rms_norm(x, w_norm)
        return F.linear(xn, lin["qkv"]), F.linear(xn, lin["g"])

    def attn_out_proj() -> Any:
        gate = torch.sigmoid(F.linear(x, lin["g"]).float()).to(dtype)
        o = attn_out.view(t, -1, sh.head_dim) * gate.unsqueeze(-1)
        return F.linear(o.reshape(t, c), lin["proj"])

    def moe_experts() -> Any:
        ids, w = route_triton(moe["z"], moe["gate"], moe["bias"], sh.top_k, 4.9)
        return experts_triton(moe["z"], ids, w, *moe["weights"])

    def moe_linears() -> Any:
        nrm = rms_norm(x, w_norm)
        split = F.linear(nrm, lin["split"])
        shared = F.linear(swiglu7(F.linear(nrm, lin["fc1"])).to(dtype), lin["fc2"])
        return F.linear(split, lin["merge"]) + shared

    return {
        "RMSNorm + linear_qkv + linear_g": attn_in,
        "sink attention (full sequence, rank's heads)": lambda: triton_segment_attention(
            q, k, v, segs, sinks, sh.head_dim**-0.5),
        "output gate + linear_proj": attn_out_proj,
        "MoE routing + experts (rank's heads, EP group's tokens)": moe_experts,
        "RMSNorm + split/merge linears + shared experts": moe_linears,
    }  # fmt: skip


def bench_layer(rep: Report, sh: Shapes, dtype: torch.dtype, timer: Timer) -> None:
    """Every step of `layer_parts` timed alone, then all of them in a row."""
    parts = layer_parts(sh, dtype)
    shape = (f"C={sh.hidden}, {sh.t_local:,} tok/rank, attention {sh.segments} x "
             f"{sh.segment:,}, MoE {sh.ep * sh.t_local:,} rows")  # fmt: skip
    for name, fn in parts.items():
        ms = timer(fn)
        rep.add("d", name, shape, "ran (dry)" if ms is None else f"{ms:.3f} ms")
    ms = timer(lambda: [fn() for fn in parts.values()])
    rep.add("d", "one layer, all steps (no collectives)", shape,
            "ran (dry)" if ms is None else f"{ms:.3f} ms")  # fmt: skip


# ---------------------------------------------------------------------------- main
DEVICE = "cpu"


def header(dry: bool) -> str:
    """Device, versions and mode, for the top of the markdown file."""
    import triton

    dev = torch.cuda.get_device_name() if DEVICE == "cuda" else "CPU (Triton interpreter)"
    mode = "dry run: tiny shapes, fp32, no timing" if dry else "bf16, CUDA-event medians"
    return (f"GPU check ({mode}) on {dev}; torch {torch.__version__}, triton "
            f"{triton.__version__}; peak taken as {PEAK_TFLOPS:.0f} TFLOP/s dense bf16.\n\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file for the table")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU under Triton's interpreter, no timing")
    args = parser.parse_args(argv)  # fmt: skip
    global DEVICE
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are imported
        triton_runtime.install_row_local_dot()
        DEVICE, dtype, sh = "cpu", torch.float32, DRY
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    else:
        DEVICE, dtype, sh = "cuda", torch.bfloat16, FULL
    rep, timer = Report(), Timer(args.dry_run, sh.reps)
    with torch.no_grad():
        inp = moe_inputs(sh, sh.check_tokens, dtype, seed=1)
        ids, w = check_routing(rep, sh, inp)
        check_experts(rep, sh, inp, ids, w)
        check_layer_dispatch(rep, sh, dtype, args.dry_run)
        check_attention(rep, sh, dtype)
        bench_moe(rep, sh, dtype, timer)
        bench_attention(rep, sh, dtype, timer)
        bench_layer(rep, sh, dtype, timer)
        refiner_attention(rep, args.dry_run, dtype, timer)
    args.out.write_text(header(args.dry_run) + rep.markdown())
    print(f"wrote {args.out}")
    failed = rep.failed_checks()
    if failed:
        print("FAILED checks: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
