"""One-GPU check of headmoe's Triton path (issue 21): one run of at most `--budget-s`
seconds (default 360) that cannot stop half-way without a report.

First the environment (device name, versions, clocks), then twelve sections, each in its own
try/except, the markdown file `--out` rewritten (atomically) after every section, so a
failure or the budget running out loses only the rest of that section:

(0) compile: every kernel compiled for this device's capability by
    benchmarks/compile_check.py: registers, spills and shared memory against the device's
    shared-memory limit per block (a kernel over it would fail at launch);
(a) bf16 correctness and row invariance of every kernel: routing, experts (and NaN rows),
    the MoE layer's dispatch, attention, the dense GEMM and RMSNorm, against torch;
(b) the dense-op invariance probe: rows of `bi_linear`, `bi_matmul` and `rms_norm` at
    every position tried for M in 1, 7, 16, 3709, 3710, 14836 against the same rows alone,
    and cuBLAS (`F.linear`) on the same probe for comparison;
(c) the MoE experts at MAGI-2 EP4 per-rank shapes (3 heads x 256 experts, 256 -> 1280 ->
    256, top-6, 14,836 and 29,672 tokens): TFLOP/s, a per-kernel table (torch.profiler),
    the gather A/B (row gather vs offsets, timed, with a bit-equality check),
    `torch._grouped_mm` bf16 on the same routes as the baseline, peak memory, and the
    registers / spills / shared memory of the kernels the device compiled;
(d) sink attention at 272p per-rank shapes (Ulysses SP8: 3 heads of 128, 2 segments of
    14,836 tokens): the Triton kernel, the flash path (`headmoe.layers.flash_attention`:
    torch's FA2 varlen with one KV split, and cuDNN; the sink from the LSE) against the
    definition with its invariance probe (head subsets, rows moved), whose result is
    recorded for `--attention auto` under `--cache-dir` (`attention_proof.json`, keyed by
    GPU name and torch/CUDA/cuDNN versions), and SDPA's flash and cuDNN backends (no
    sink) on the same shapes;
(e) one layer-shaped workload at SP8/EP4 per-rank shapes (no collectives): RMSNorm and the
    linears through headmoe's batch-invariant ops, attention, routing + experts, beside
    the same steps with cuBLAS linears and torch RMSNorm;
(f) layer streaming (`--offload-layers`, benchmarks/bench_stream.py `gpu_section`): the
    host stage (mapped file -> pinned) and host-to-device GB/s of one MAGI-2 Preview MoE
    layer of an EP4 rank, and 6 such layers resident vs streamed (2 slots) at two token
    counts: step times, the fraction of the copy hidden behind compute, bit equality;
(g) the refiner's block-grid range attention at 1080p (63x68x120 latents + 512 text
    tokens, SP8 per-rank heads: 4 query, 1 KV, 128 dims): against the CPU path on the first
    tiles, head-subset rows bit-identical, TFLOP/s of the attended pairs beside dense SDPA
    over as many pairs;
(h) fused mHC (`headmoe.layers.triton_mhc`: coefficients with the whole Sinkhorn loop,
    `mhc_input`, `mhc_update`) at the SP8 per-rank layer shape (3,709 tokens x 4 streams x
    3072) against the eager torch definition: error, rows alone vs in the batch, time.
(i) FP8 routed experts, W8A16 (`headmoe.moe.triton_fp8`, docs/fp8.md) at the section (c)
    shapes: against the torch FP8 path (`experts_fp8`), the hardware's E4M3
    widening vs the bit-operation one (same bits), sub-batch rows, the MoE layer in the
    FP8 format (`Fp8Experts`) taking the W8A16 kernels, and TFLOP/s and weight bytes/s
    beside the bf16 kernels on the same routes.
(j) the fused expert tile (`expert_tile_kernel`, the default) against the two-kernel path
    (`gate_up_kernel` + `down_kernel`, `MoETiles(fused=False)`) at the section (c) shapes:
    rows that differ and the largest difference (rounding only), rows alone vs in the
    batch, time of both; and the fused layer linear (`triton_dense.linear_rows`: RMSNorm
    prologue, SwiGLU7 epilogue, bf16 out) against the unfused kernels at the SP8 per-rank
    shape (3,709 tokens, 3072 -> 2 x 2560): differing rows, error, time of both.
(k) CUDA graphs (`headmoe.layers.cuda_graphs.GraphedStep`, `--cuda-graphs`): one
    sync-free layer step at the SP8 per-rank shape (fused mHC branch, the fused layer
    linear, routing + the MoE experts) eager vs captured and replayed: outputs
    `torch.equal`, a second input of the same shape replayed, a shape not captured running
    eagerly, min / median ms of both over the repeats, and the kernel launches of one
    eager step against the graph launches of one replay (torch.profiler); a dry run
    captures with the CPU stand-in (`stand_in`), every code path, no timing.

Exit status 0 when every check passed, 1 when a check or a section failed or the budget
ran out, 2 without a CUDA device. Targets (ratios in the table, never asserted by timed
tests): experts >= 30% of the H200's dense bf16 peak at 29,672 tokens and >= 2x
`torch._grouped_mm`; attention >= 40% of peak; every invariance row "0 rows differ".

`--dry-run`: tiny shapes on the CPU under Triton's interpreter (fp32, the row-local dot of
`headmoe.layers.triton_runtime`), every code path without timing. `--inject-failure S`
(repeatable) makes section S raise at its start, to test the report (tests/moe/
test_gpu_check.py).

    benchmarks/gpu_check.sh --out gpu_check.md
    benchmarks/gpu_check.sh --dry-run --out /tmp/gpu_check_dry.md
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/x.py`

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks import bench_stream, compile_check  # noqa: E402
from headmoe.deployment import DeploymentOptions  # noqa: E402
from headmoe.files import atomic_write  # noqa: E402
from headmoe.layers import flash_attention as fa  # noqa: E402
from headmoe.layers import mhc, norms, triton_dense, triton_runtime  # noqa: E402
from headmoe.layers.activations import swiglu7, swiglu7_  # noqa: E402
from headmoe.layers.matmul import bi_linear, bi_matmul  # noqa: E402
from headmoe.layers.triton_attention import triton_segment_attention, triton_sink_attention  # noqa: E402
from headmoe.moe import MoEConfig, MultiHeadMoE, experts_reference, route  # noqa: E402
from headmoe.moe.experts import combine  # noqa: E402
from headmoe.moe.routing import route_groups  # noqa: E402
from headmoe.moe.triton_moe import DEFAULT_TILES, experts_triton, route_triton  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: H200 dense bf16 tensor-core peak, TFLOP/s
PEAK_TFLOPS = 989.0
#: the row counts of the dense probe (issue 21 point 1)
ROW_COUNTS = (1, 7, 16, 3709, 3710, 14836)
#: the sections, in run order
SECTIONS = {
    "0": "compile: registers, spills, shared memory vs the device limit",
    "a": "bf16 correctness and row invariance of every kernel",
    "b": "dense-op invariance probe",
    "c": "MoE experts: speed, per-kernel table, gather A/B, grouped_mm baseline, memory",
    "d": "attention: Triton vs the flash path (FA2, cuDNN; probe, proof) vs SDPA",
    "e": "layer-shaped workload",
    bench_stream.SECTION: "layer streaming: H2D GB/s, step time resident vs streamed, copy hidden",
    "g": "refiner block-grid attention at 1080p vs dense SDPA of the same pairs",
    "h": "fused mHC (coefficients + Sinkhorn, input, update) vs the eager torch definition",
    "i": "FP8 routed experts (W8A16): error, widenings, rows, speed and bytes/s vs bf16",
    "j": "fused expert tile vs the two kernels; fused layer linear vs the unfused ops",
    "k": "CUDA graphs: a sync-free layer step eager vs graphed (bits, time, launches)",
}


@dataclasses.dataclass(frozen=True)
class Shapes:
    """Per-rank sizes: MoE heads x experts, head dim d, expert width f, top-k, token counts
    (moe_tokens timed, check_tokens for the checks); attention heads x head_dim over
    `segments` segments of `segment` tokens; hidden size C, shared-expert width, tokens of
    the rank (t_local), the EP degree (MoE rows = ep * t_local), mHC streams; reps: timed
    repetitions; compile: the kernels of section (0)."""

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
    streams: int
    reps: int
    compile: tuple[str, ...]
    probe_rows: tuple[int, ...]


FULL = Shapes(3, 256, 256, 1280, 6, (14_836, 29_672), 4096, 3, 128, 14_836, 2, 3072, 2560,
              3709, 4, 4, 5, tuple(compile_check.specs()), ROW_COUNTS)  # fmt: skip
#: the dry run probes small M only (the same code path; tests/layers/test_triton_dense.py
#: runs every M of ROW_COUNTS under the interpreter)
DRY = Shapes(3, 4, 64, 128, 2, (40, 80), 96, 3, 16, 40, 2, 64, 64, 10, 4, 4, 0, ("combine",),
             (1, 7, 16, 37))  # fmt: skip


class OutOfBudget(Exception):
    """The run's `--budget-s` is spent: the section stops, the report says so."""


@dataclasses.dataclass
class Ctx:
    """What every section needs: device, dtype, shapes, timing and the report."""

    dry: bool
    device: str
    dtype: torch.dtype
    sh: Shapes
    deadline: float
    report: Report
    proof_dir: str = DeploymentOptions().cache_dir
    """Where section d records the flash path's invariance proof (`--cache-dir`)."""

    def check_budget(self) -> None:
        if time.monotonic() > self.deadline:
            raise OutOfBudget

    def time(self, fn: Callable[[], Any], reps: int | None = None) -> float | None:
        """Median ms of `reps` (default `sh.reps`) CUDA-event-timed calls after two warm-up
        calls; in a dry run one untimed call and None. Raises OutOfBudget past the deadline."""
        self.check_budget()
        if self.dry:
            fn()
            return None
        for _ in range(2):
            fn()
        times = []
        for _ in range(reps or self.sh.reps):
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            times.append(start.elapsed_time(stop))
        return statistics.median(times)

    def randn(self, *shape: int, scale: float = 1.0, dtype: torch.dtype | None = None,
              gen: torch.Generator | None = None) -> torch.Tensor:  # fmt: skip
        """Random normal `shape` * scale on the device, in `dtype` (default: the run's)."""
        t = torch.randn(*shape, generator=gen, device=self.device) * scale
        return t.to(dtype or self.dtype)


@dataclasses.dataclass
class Report:
    """The header lines and the rows (section, item, shape, value, target, ok or None)."""

    header: list[str] = dataclasses.field(default_factory=list)
    rows: list[tuple[str, str, str, str, str, bool | None]] = dataclasses.field(
        default_factory=list
    )
    status: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, section: str, item: str, shape: str, value: str, target: str = "",
            ok: bool | None = None) -> None:  # fmt: skip
        self.rows.append((section, item, shape, value, target, ok))
        mark = {True: "ok", False: "FAIL", None: ""}[ok]
        print(f"[{section}] {item} ({shape}): {value} {target} {mark}".rstrip(), flush=True)

    def markdown(self) -> str:
        lines = [*self.header, "", "| section | status |", "|---|---|"]
        lines += [f"| {k} {SECTIONS[k]} | {self.status.get(k, 'not run')} |" for k in SECTIONS]
        lines += ["", "| | check | shape | result | target | |", "|---|---|---|---|---|---|"]
        for section, item, shape, value, target, ok in self.rows:
            mark = {True: "ok", False: "**FAIL**", None: ""}[ok]
            lines.append(f"| {section} | {item} | {shape} | {value} | {target} | {mark} |")
        return "\n".join(lines) + "\n"

    def write(self, path: Path) -> None:
        """Rewrite `path` atomically with the report so far."""
        text = self.markdown()
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))

    def failures(self) -> list[str]:
        bad = [f"{r[0]}: {r[1]}" for r in self.rows if r[5] is False]
        return bad + [f"section {k}: {v}" for k, v in self.status.items() if not v.startswith("ok")]


def tflops(flop: float, ms: float | None) -> str:
    """`flop` over `ms` as "x TFLOP/s (y% of peak), z ms", or "ran (dry)"."""
    if ms is None:
        return "ran (dry)"
    t = flop / ms / 1e9
    return f"{t:,.1f} TFLOP/s ({100 * t / PEAK_TFLOPS:.1f}% of {PEAK_TFLOPS:.0f}), {ms:.3f} ms"


def ms_text(ms: float | None) -> str:
    return "ran (dry)" if ms is None else f"{ms:.3f} ms"


def mismatched_rows(a: torch.Tensor, b: torch.Tensor) -> int:
    """Rows (first dim) of a and b that are not bit-identical (NaN rows compare by bits)."""
    if a.shape != b.shape:
        return a.shape[0] if a.dim() else 1
    if not a.numel():
        return 0
    same = (a == b) | (torch.isnan(a) & torch.isnan(b)) if a.is_floating_point() else a == b
    return int((~same.reshape(a.shape[0], -1).all(1)).sum())


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


# ---------------------------------------------------------------------------- environment
def environment(ctx: Ctx) -> list[str]:
    """Header lines: device name, versions, clocks (each item guarded: a failing query
    prints its error instead of stopping the run)."""
    import triton

    lines = [f"# GPU check ({'dry run: tiny shapes, fp32, no timing' if ctx.dry else 'bf16'})",
             "", f"- date: {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}",
             f"- python {platform.python_version()}, torch {torch.__version__}, triton "
             f"{triton.__version__}, CUDA runtime {torch.version.cuda}"]  # fmt: skip
    if ctx.dry:
        return [*lines, "- device: CPU (Triton interpreter)"]
    try:
        p = torch.cuda.get_device_properties(0)
        lines.append(f"- device: {p.name}, sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, "
                     f"{p.total_memory / 2**30:.1f} GiB, shared memory per block (opt-in) "
                     f"{p.shared_memory_per_block_optin:,} B")  # fmt: skip
    except Exception as e:  # noqa: BLE001 - reported, the run goes on
        lines.append(f"- device: query failed: {e!r}")
    query = "name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu"
    try:
        smi = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv"],
                             capture_output=True, text=True, timeout=20)  # fmt: skip
        lines.append("- nvidia-smi: " + " / ".join(smi.stdout.strip().splitlines()))
    except Exception as e:  # noqa: BLE001
        lines.append(f"- nvidia-smi: failed: {e!r}")
    return lines


# ---------------------------------------------------------------------------- (0) compile
def section_compile(ctx: Ctx) -> None:
    """compile_check.py in a fresh process (compiled kernels, not the interpreter), for this
    device's capability and shared-memory limit; one row per kernel."""
    if ctx.dry:
        cap, limit = 90, compile_check.SMEM_LIMIT
    else:
        major, minor = torch.cuda.get_device_capability()
        cap = 10 * major + minor
        limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    timeout = max(10.0, ctx.deadline - time.monotonic())
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "compile_check.py"), "--kernels",
         ",".join(ctx.sh.compile), "--smem-limit", str(limit), "--capability", str(cap)],
        env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip
    lines = {x.split()[0]: x for x in run.stdout.splitlines() if x.strip()}
    for name in ctx.sh.compile:
        line = lines.get(name, "no output")
        shared = re.search(r"shared=([\d,]+)/", line)
        bad = [x for x in run.stderr.splitlines() if f"FAILED: {name}:" in x]
        ctx.report.add("0", f"compile {name} for sm_{cap}", f"limit {limit:,} B",
                       " ".join(line.split()[1:]), f"shared <= {limit:,} B, no spills",
                       bool(shared) and not bad)  # fmt: skip
    if run.returncode not in (0, 1):
        raise RuntimeError(f"compile_check exited {run.returncode}: {run.stderr[-1500:]}")


# ---------------------------------------------------------------------------- inputs
def moe_inputs(ctx: Ctx, n: int, seed: int) -> dict[str, Any]:
    """Random MoE inputs: z `[n, heads, d]`, an fp32 router (gate, bias) and expert weights
    in the run's dtype, scaled like a trained layer's."""
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    sh = ctx.sh
    rows, d, f = sh.heads * sh.experts, sh.d, sh.f
    return {
        "z": ctx.randn(n, sh.heads, d, gen=g),
        "gate": ctx.randn(rows, d, scale=d**-0.5, dtype=torch.float32, gen=g),
        "bias": ctx.randn(rows, scale=0.05, dtype=torch.float32, gen=g),
        "weights": [ctx.randn(rows, d, f, scale=d**-0.5, gen=g),
                    ctx.randn(rows, d, f, scale=d**-0.5, gen=g),
                    ctx.randn(rows, f, d, scale=f**-0.5, gen=g)],
    }  # fmt: skip


def routes(ctx: Ctx, inp: dict[str, Any], z: torch.Tensor | None = None):
    """Triton routes `(ids, weights)` of `z` (default inp's z) with inp's router."""
    z = inp["z"] if z is None else z
    return route_triton(z, inp["gate"], inp["bias"], ctx.sh.top_k, 4.9)


def attention_reference(q, k, v, sinks, scale):
    """fp32 sink attention from its definition: softmax over [q.k * scale, sink] with a zero
    value for the sink; q `[L, Hq, D]`, k/v `[Lk, Hkv, D]` (GQA). Returns fp32."""
    rep = q.shape[1] // k.shape[1]
    kf, vf = (t.float().repeat_interleave(rep, dim=1) for t in (k, v))
    logits = torch.einsum("qhd,khd->hqk", q.float(), kf) * scale
    sink = sinks.float().view(-1, 1, 1).expand(-1, q.shape[0], 1)
    p = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", p, vf)


# ---------------------------------------------------------------------------- (a) checks
def check_routing(ctx: Ctx, inp: dict[str, Any]) -> tuple[Any, Any]:
    """Triton routing against torch's `route` on the same device; returns torch's routes."""
    sh, z = ctx.sh, inp["z"]
    ids, w = route(z, inp["gate"], inp["bias"], sh.top_k, 4.9)
    tids, tw = routes(ctx, inp)
    same = (tids == ids).all(-1)
    share = float(same.float().mean())
    err = float((tw - w).abs()[same].max()) if bool(same.any()) else float("inf")
    shape = f"{z.shape[0]} tok x {sh.heads} heads x {sh.experts} experts, top-{sh.top_k}"
    ctx.report.add("a", "routing: same experts as torch route", shape,
                   f"{100 * share:.3f}% of rows", ">= 99.9%", share >= 0.999)  # fmt: skip
    ctx.report.add("a", "routing: weight error where same", shape, f"{err:.2e}", "<= 1e-5",
                   err <= 1e-5)  # fmt: skip
    return ids, w


def check_experts(ctx: Ctx, inp: dict[str, Any], ids, w) -> None:
    """Triton experts against the reference loop, and bit-identical rows across batchings."""
    z, wts, n = inp["z"], inp["weights"], inp["z"].shape[0]
    full = experts_triton(z, ids, w, *wts)
    ref = experts_reference(z, ids, w, *wts).float()
    rel = float((full.float() - ref).abs().max() / ref.abs().max())
    shape = f"{n} tok, {z.dtype}".replace("torch.", "")
    tol = 2e-2 if z.dtype == torch.bfloat16 else 1e-4
    ctx.report.add("a", "experts vs reference loop (max err / max)", shape, f"{rel:.2e}",
                   f"<= {tol:g}", rel <= tol)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    bad = 0
    fids, fw = routes(ctx, inp)
    for m in (1, 5, 37, n // 8, n // 3, n - 1):
        idx = torch.randperm(n, generator=g)[:m].to(z.device)
        bad += mismatched_rows(experts_triton(z[idx], ids[idx], w[idx], *wts), full[idx])
        tids, tw = routes(ctx, inp, z[idx])
        bad += mismatched_rows(tids, fids[idx]) + mismatched_rows(tw, fw[idx])
    other = moe_inputs(ctx, n // 2 + 3, seed=9)
    oids, ow = route(other["z"], inp["gate"], inp["bias"], ctx.sh.top_k, 4.9)
    both = experts_triton(torch.cat([other["z"], z]), torch.cat([oids, ids]),
                          torch.cat([ow, w]), *wts)  # fmt: skip
    bad += mismatched_rows(both[other["z"].shape[0] :], full)
    ctx.report.add("a", "experts+routing rows bit-identical (6 random sub-batches, permuted, "
                   "and a concatenation)", shape, f"{bad} rows differ", "0", bad == 0)  # fmt: skip


def check_nan_rows(ctx: Ctx, inp: dict[str, Any]) -> None:
    """NaN router inputs on every head (the last included): valid expert ids, no device
    assert, the other rows unchanged."""
    z = inp["z"][:64].clone()
    for hd in range(ctx.sh.heads):
        z[hd, hd] = float("nan")
    ids, w = routes(ctx, inp, z)
    ok_ids = int(ids.min()) >= 0 and int(ids.max()) < ctx.sh.experts
    out = experts_triton(z, ids, w, *inp["weights"])
    clean = experts_triton(z[ctx.sh.heads :], ids[ctx.sh.heads :], w[ctx.sh.heads :],
                           *inp["weights"])  # fmt: skip
    bad = mismatched_rows(out[ctx.sh.heads :], clean)
    ctx.report.add("a", "NaN rows on every head: ids in [0, E), other rows unchanged",
                   f"{ctx.sh.heads} NaN rows in 64", f"ids ok={ok_ids}, {bad} rows differ",
                   "ids ok, 0", ok_ids and bad == 0)  # fmt: skip


def moe_layer_config(ctx: Ctx) -> MoEConfig:
    """The `MoEConfig` of one MoE layer at the run's per-rank shapes."""
    sh = ctx.sh
    return MoEConfig(hidden_size=sh.heads * sh.d, num_heads=sh.heads, num_experts=sh.experts,
                     top_k=sh.top_k, expert_intermediate_size=sh.f, route_scale=4.9,
                     dtype=ctx.dtype)  # fmt: skip


def check_layer_dispatch(ctx: Ctx) -> None:
    """`MultiHeadMoE` on this device takes the Triton path: same bits as the kernels."""
    sh = ctx.sh
    inp = moe_inputs(ctx, 64, seed=3)
    moe = MultiHeadMoE(moe_layer_config(ctx)).to(ctx.device)
    for p, src in zip((moe.W_gate, moe.W_up, moe.W_down), inp["weights"]):
        p.copy_(src)
    moe.gate.copy_(inp["gate"])
    moe.router.expert_bias.copy_(inp["bias"])
    with forced_triton(ctx.dry):
        got = moe(inp["z"].reshape(64, -1)).view(64, sh.heads, sh.d)
    ids, w = routes(ctx, inp)
    bad = mismatched_rows(got, experts_triton(inp["z"], ids, w, *inp["weights"]))
    ctx.report.add("a", "MultiHeadMoE on this device = Triton kernels", "64 tok",
                   f"{bad} rows differ", "0", bad == 0)  # fmt: skip


def check_attention(ctx: Ctx) -> None:
    """Attention against the fp32 definition; bit-identical query rows across batchings."""
    sh = ctx.sh
    length, hq, dim = min(sh.segment, 3000), sh.attn_heads, sh.head_dim
    g = torch.Generator(device=ctx.device).manual_seed(5)
    q, k, v = (ctx.randn(length, hq, dim, gen=g) for _ in range(3))
    sinks = ctx.randn(hq, dtype=torch.float32, gen=g)
    scale = dim**-0.5
    full = triton_sink_attention(q, k, v, sinks, scale)
    err = float((full.float() - attention_reference(q, k, v, sinks, scale)).abs().max())
    tol = 2e-2 if ctx.dtype == torch.bfloat16 else 1e-4
    shape = f"L={length}, {hq} heads x {dim}, {ctx.dtype}".replace("torch.", "")
    ctx.report.add("a", "attention vs fp32 definition (max abs err)", shape, f"{err:.2e}",
                   f"<= {tol:g}", err <= tol)  # fmt: skip
    bad = 0
    for a, b in ((0, 1), (length // 7, length // 2), (length - 5, length)):
        bad += mismatched_rows(triton_sink_attention(q[a:b], k, v, sinks, scale), full[a:b])
    idx = torch.randperm(length, generator=torch.Generator().manual_seed(6))[:301].to(q.device)
    bad += mismatched_rows(triton_sink_attention(q[idx], k, v, sinks, scale), full[idx])
    part = triton_sink_attention(q[:, 1:], k[:, 1:], v[:, 1:], sinks[1:], scale)
    bad += mismatched_rows(part, full[:, 1:])
    pre = length // 3
    packed = triton_segment_attention(torch.cat([q[:pre], q]), torch.cat([k[:pre], k]),
                                      torch.cat([v[:pre], v]), [(0, pre), (pre, pre + length)],
                                      sinks, scale)  # fmt: skip
    bad += mismatched_rows(packed[pre:], full)
    ctx.report.add("a", "attention rows bit-identical (query slices, gathered rows, head "
                   "subset, packed after another segment)", shape, f"{bad} rows differ", "0",
                   bad == 0)  # fmt: skip


def check_dense(ctx: Ctx) -> None:
    """The dense GEMM and RMSNorm against fp32 torch, on the layer's hidden size."""
    c, g = ctx.sh.hidden, torch.Generator(device=ctx.device).manual_seed(8)
    x, w = ctx.randn(300, c, gen=g), ctx.randn(c, c, scale=c**-0.5, gen=g)
    got = triton_dense.matmul(x, w.t()).float()
    ref = x.float() @ w.float().t()
    rel = float((got - ref).abs().max() / ref.abs().max())
    tol = 1e-2 if ctx.dtype == torch.bfloat16 else 1e-5
    shape = f"300 x {c} @ {c} x {c}, {ctx.dtype}".replace("torch.", "")
    ctx.report.add("a", "dense GEMM vs fp32 (max err / max)", shape, f"{rel:.2e}", f"<= {tol:g}",
                   rel <= tol)  # fmt: skip
    nw = ctx.randn(c, scale=0.1, dtype=torch.float32, gen=g)
    got = triton_dense.rms_norm_rows(x, nw, 1e-6)
    ref = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + nw)
    err = float((got - ref).abs().max())
    shape = f"300 x {c}, {ctx.dtype}".replace("torch.", "")
    ctx.report.add("a", "RMSNorm rows vs torch fp32 (max abs err)", shape, f"{err:.2e}",
                   "<= 1e-4", err <= 1e-4)  # fmt: skip


def section_checks(ctx: Ctx) -> None:
    """Every check of section (a), the budget looked at between them."""
    inp = moe_inputs(ctx, ctx.sh.check_tokens, seed=1)
    ids, w = check_routing(ctx, inp)
    for check in (lambda: check_experts(ctx, inp, ids, w), lambda: check_nan_rows(ctx, inp),
                  lambda: check_layer_dispatch(ctx), lambda: check_attention(ctx),
                  lambda: check_dense(ctx)):  # fmt: skip
        ctx.check_budget()
        check()


# ---------------------------------------------------------------------------- (b) probe
def probe_rows(ctx: Ctx, op: Callable[[torch.Tensor], torch.Tensor], cols: int,
               seed: int) -> tuple[int, int]:  # fmt: skip
    """(rows differing, rows compared): 5 probe rows alone against the same rows placed at
    first / middle / last / tile-edge positions of batches of every M in `sh.probe_rows`."""
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    probe = ctx.randn(5, cols, gen=g)
    alone = [op(probe[j : j + 1]) for j in range(5)]
    bad = total = 0
    for m in ctx.sh.probe_rows:
        ctx.check_budget()
        batch = ctx.randn(m, cols, gen=g)
        spots = sorted({0, m // 2, m - 1, min(m - 1, 127), min(m - 1, 128)})[:5]
        for j, p in enumerate(spots):
            batch[p] = probe[j]
        out = op(batch)
        for j, p in enumerate(spots):
            bad += mismatched_rows(out[p : p + 1], alone[j])
            total += 1
    return bad, total


def section_probe(ctx: Ctx) -> None:
    """bi_linear (Linear's product), bi_matmul (mHC's) and rms_norm through headmoe's
    CUDA dispatch, and cuBLAS `F.linear` / torch's RMSNorm on the same probe for
    comparison (informative: no target)."""
    c, sh = ctx.sh.hidden, ctx.sh
    g = torch.Generator(device=ctx.device).manual_seed(21)
    w = ctx.randn(c, c, scale=c**-0.5, gen=g)
    phi = ctx.randn(sh.streams * c, 2 * sh.streams + sh.streams**2, scale=0.02,
                    dtype=torch.float32, gen=g)  # fmt: skip
    nw = ctx.randn(c, scale=0.1, dtype=torch.float32, gen=g)
    ops = {
        "bi_linear (Triton GEMM)": (lambda x: bi_linear(x, w), c, True),
        "bi_matmul fp32 (mHC logits)": (lambda x: bi_matmul(x.float(), phi), sh.streams * c, True),
        "rms_norm (Triton rows)": (lambda x: norms.rms_norm(x, nw), c, True),
        "cuBLAS F.linear (comparison)": (lambda x: F.linear(x, w), c, False),
        "torch RMSNorm (comparison)": (lambda x: norms.rms_norm_torch(x, nw), c, False),
    }
    counts = ", ".join(str(m) for m in sh.probe_rows)
    for i, (name, (op, cols, ours)) in enumerate(ops.items()):
        with forced_triton(ctx.dry and ours):
            bad, total = probe_rows(ctx, op, cols, seed=30 + i)
        ctx.report.add("b", name, f"M in {counts}, K={cols}", f"{bad} of {total} rows differ",
                       "0" if ours else "", (bad == 0) if ours else None)  # fmt: skip


# ---------------------------------------------------------------------------- (c) MoE
def grouped_mm_experts(z, ids, w, w_gate, w_up, w_down) -> torch.Tensor:
    """The experts of routes (ids, w) with `torch._grouped_mm` (bf16 on CUDA): routes sorted
    by (head, expert), three grouped GEMMs, SwiGLU7, the ascending-order combine. The
    baseline of section (c): same routes, same FLOPs. z `[N, h, d]` -> `[N, h, d]`."""
    n, h, d = z.shape
    k, groups = ids.shape[2], w_gate.shape[0]
    group = route_groups(ids, groups // h)
    order = torch.argsort(group, stable=True)
    ends = torch.bincount(group, minlength=groups).cumsum(0).to(torch.int32)
    x = z.reshape(n * h, d)[order // k]
    act = swiglu7_(torch._grouped_mm(x, w_gate, offs=ends).float(),
                   torch._grouped_mm(x, w_up, offs=ends).float())  # fmt: skip
    y = torch._grouped_mm(act.to(z.dtype), w_down, offs=ends)
    routed = torch.empty_like(y)
    routed[order] = y
    return combine(routed.float().view(n, h, k, d), w).to(z.dtype)


def grouped_baseline(ctx: Ctx, z, ids, w, wts) -> Callable[[], Any]:
    """`grouped_mm_experts` as a callable, with the weights in the layout this device's
    `torch._grouped_mm` takes (row-major, else column-major; reported)."""
    try:
        grouped_mm_experts(z, ids, w, *wts)
        return lambda: grouped_mm_experts(z, ids, w, *wts)
    except RuntimeError as e:
        cols = [t.transpose(-2, -1).contiguous().transpose(-2, -1) for t in wts]
        grouped_mm_experts(z, ids, w, *cols)
        ctx.report.add("c", "grouped_mm: weights made column-major", "", str(e).splitlines()[0])
        return lambda: grouped_mm_experts(z, ids, w, *cols)


def kernel_table(ctx: Ctx, fn: Callable[[], Any], shape: str) -> None:
    """One profiled call of fn: time per kernel (CUDA; CPU ops in a dry run), top 8."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] if ctx.dry else [ProfilerActivity.CUDA]
    with profile(activities=acts) as prof:
        fn()
        if not ctx.dry:
            torch.cuda.synchronize()
    attr = "self_cpu_time_total" if ctx.dry else "self_device_time_total"
    events = sorted(prof.key_averages(), key=lambda e: -getattr(e, attr, 0))[:8]
    for e in events:
        us = getattr(e, attr, 0)
        ctx.report.add("c", f"kernel: {e.key[:60]}", shape,
                       "ran (dry)" if ctx.dry else f"{us / 1000:.3f} ms x{e.count}")  # fmt: skip


def device_compile_info(ctx: Ctx) -> None:
    """Registers, spills and shared memory of the MoE kernels as this device compiled them
    (triton's JIT caches); the interpreter has none."""
    from headmoe.moe import triton_moe

    kern = triton_runtime.kernels(triton_moe.KERNELS)
    for name in ("route_kernel", "expert_tile_kernel", "gate_up_kernel", "down_kernel",
                 "combine_kernel"):
        caches = getattr(getattr(kern, name), "device_caches", None)
        if not caches:
            ctx.report.add("c", f"device compile: {name}", "", "interpreter: no device compile")
            continue
        try:  # triton's JIT internals (3.9: device -> (kernel cache, ...)) may move
            for cache in caches.values():
                for compiled in cache[0].values():
                    compiled._init_handles()
                    ctx.report.add("c", f"device compile: {name}", "",
                                   f"registers={compiled.n_regs} spills={compiled.n_spills} "
                                   f"shared={compiled.metadata.shared:,} B")  # fmt: skip
        except (AttributeError, IndexError, KeyError, TypeError) as e:
            ctx.report.add("c", f"device compile: {name}", "", f"unreadable: {e!r}")


def bench_moe_tokens(ctx: Ctx, n: int) -> None:
    sh = ctx.sh
    inp = moe_inputs(ctx, n, seed=n)
    z, wts = inp["z"], inp["weights"]
    ids, w = routes(ctx, inp)
    flop = 6.0 * sh.d * sh.f * n * sh.heads * sh.top_k
    shape = f"{n:,} tok x {sh.heads} heads, {sh.experts} experts, top-{sh.top_k}"
    big = n == max(sh.moe_tokens)
    if not ctx.dry:
        torch.cuda.reset_peak_memory_stats()
    t_exp = ctx.time(lambda: experts_triton(z, ids, w, *wts))
    ok = None if t_exp is None or not big else flop / t_exp / 1e9 >= 0.3 * PEAK_TFLOPS
    ctx.report.add("c", "experts, Triton", shape, tflops(flop, t_exp),
                   ">= 30% of peak" if big else "", ok)  # fmt: skip
    t_all = ctx.time(lambda: experts_triton(z, *routes(ctx, inp), *wts))
    ctx.report.add("c", "routing + experts, Triton", shape, tflops(flop, t_all))
    peak = "n/a (CPU)" if ctx.dry else f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    ctx.report.add("c", "peak memory (inputs + routing + experts)", shape, peak)
    offsets = dataclasses.replace(DEFAULT_TILES, row_gather=False)
    same = mismatched_rows(experts_triton(z, ids, w, *wts, tiles=offsets),
                           experts_triton(z, ids, w, *wts))  # fmt: skip
    t_off = ctx.time(lambda: experts_triton(z, ids, w, *wts, tiles=offsets))
    gain = "" if t_off is None else f", row gather {t_off / t_exp:.2f}x faster"
    ctx.report.add("c", "gather A/B: offsets (before the fix) vs rows", shape,
                   f"{same} rows differ; {tflops(flop, t_off)}{gain}", "0 rows differ",
                   same == 0)  # fmt: skip
    gmm = grouped_baseline(ctx, z, ids, w, wts)
    t_gmm = ctx.time(gmm)
    speed = "" if t_gmm is None else f"; Triton {t_gmm / t_exp:.2f}x faster"
    ctx.report.add("c", "baseline: torch._grouped_mm on the same routes", shape,
                   tflops(flop, t_gmm) + speed, ">= 2x" if big else "",
                   None if t_gmm is None or not big else t_gmm / t_exp >= 2)  # fmt: skip
    kernel_table(ctx, lambda: experts_triton(z, *routes(ctx, inp), *wts), shape)


def section_moe(ctx: Ctx) -> None:
    for n in ctx.sh.moe_tokens:
        bench_moe_tokens(ctx, n)
    device_compile_info(ctx)


# ---------------------------------------------------------------------------- (d) attention
def flash_backends(ctx: Ctx) -> dict[str, fa.FlashBackend]:
    """The flash backends of section d (`headmoe.layers.flash_attention.BACKENDS`); a dry
    run has none on the CPU and runs the math definition in their place (the code path)."""
    return {"math (dry stand-in)": fa.math_backend} if ctx.dry else dict(fa.BACKENDS)


def flash_probe(qkv: torch.Tensor, segs: list[tuple[int, int]], sinks: torch.Tensor,
                scale: float, backend: fa.FlashBackend) -> tuple[torch.Tensor, int]:
    """The flash path's invariance probe: (the full call `[L, h, D]`, rows that differ from it
    in bits) over head subsets (one head, the last heads), the last segment alone at row 0,
    and the segments packed in the reverse order (rows moved). qkv `[L, 3, h, D]`."""
    def run(x: torch.Tensor, s: list[tuple[int, int]], sk: torch.Tensor) -> torch.Tensor:
        return fa.flash_segment_attention(x, s, sk, scale, backend=backend)

    full, h = run(qkv, segs, sinks), qkv.shape[2]
    bad = sum(mismatched_rows(run(qkv[:, :, a:b], segs, sinks[a:b]), full[:, a:b])
              for a, b in ((0, 1), (1, h), (h - 1, h)))
    a, b = segs[-1]
    bad += mismatched_rows(run(qkv[a:b], [(0, b - a)], sinks), full[a:b])
    rev, pos = [], 0
    for x, y in reversed(segs):
        rev.append((pos, pos + y - x))
        pos += y - x
    moved = run(torch.cat([qkv[x:y] for x, y in reversed(segs)]), rev, sinks)
    back = torch.cat([moved[r0:r1] for r0, r1 in reversed(rev)])
    return full, bad + mismatched_rows(back, full)


def record_proof(ctx: Ctx, name: str, invariant: bool, detail: str) -> str:
    """Write this device and stack's proof of backend `name` (`fa.write_proof`) under
    `ctx.proof_dir`; returns where."""
    key = fa.proof_key(ctx.device if not ctx.dry else "cpu", name)
    return str(fa.write_proof(ctx.proof_dir, key, invariant, detail))


def section_attention(ctx: Ctx) -> None:
    """Sink attention over `segments` packed segments: the Triton kernel, and the flash path
    (`headmoe.layers.flash_attention`: torch's FA2 varlen with num_splits=1, and cuDNN, the
    sink from the LSE) against the fp32 definition, with the invariance probe whose result
    `--attention auto` reads (`record_proof`); then SDPA (no sink) per segment."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sh = ctx.sh
    length = sh.segment * sh.segments
    g = torch.Generator(device=ctx.device).manual_seed(7)
    qkv = ctx.randn(length, 3, sh.attn_heads, sh.head_dim, gen=g)
    q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    sinks = ctx.randn(sh.attn_heads, dtype=torch.float32, gen=g)
    segs = [(i * sh.segment, (i + 1) * sh.segment) for i in range(sh.segments)]
    scale = sh.head_dim**-0.5
    flop = 4.0 * sh.segment**2 * sh.head_dim * sh.attn_heads * sh.segments
    shape = f"{sh.segments} x {sh.segment:,} tok, {sh.attn_heads} heads x {sh.head_dim}"
    t = ctx.time(lambda: triton_segment_attention(q, k, v, segs, sinks, scale))
    ok = None if t is None else flop / t / 1e9 >= 0.4 * PEAK_TFLOPS
    ctx.report.add("d", "sink attention, Triton", shape, tflops(flop, t), ">= 40% of peak", ok)
    rows = min(sh.segment, 2048)  # the definition's check on each segment's first rows
    want = torch.cat([attention_reference(q[a:a + rows], k[a:b], v[a:b], sinks, scale)
                      for a, b in segs])  # fmt: skip
    tol = 2e-2 if ctx.dtype == torch.bfloat16 else 1e-4
    for name, backend in flash_backends(ctx).items():
        try:
            full, bad = flash_probe(qkv, segs, sinks, scale, backend)
        except RuntimeError as e:
            ctx.report.add("d", f"flash path ({name}), sink from the LSE", shape,
                           f"unavailable: {str(e).splitlines()[0][:80]}")  # fmt: skip
            continue
        got = torch.cat([full[a:a + rows] for a, _ in segs]).float()
        err = float((got - want).abs().max())
        ctx.report.add("d", f"flash path ({name}) vs fp32 definition (max abs err)", shape,
                       f"{err:.2e}", f"<= {tol:g}", err <= tol)  # fmt: skip
        where = record_proof(ctx, name, bad == 0 and err <= tol, f"{bad} rows differ; {shape}")
        # a dry run's stand-in is a code path, not a proof: its row is not a check
        ctx.report.add("d", f"flash path ({name}) rows bit-identical (head subsets, segment "
                       f"alone, segments reordered); proof in {where}", shape,
                       f"{bad} rows differ", "0", None if ctx.dry else bad == 0)  # fmt: skip
        ms = ctx.time(lambda b=backend: fa.flash_segment_attention(qkv, segs, sinks, scale, b))
        ratio = "" if ms is None or t is None else f"; Triton / this time {t / ms:.2f}"
        ctx.report.add("d", f"flash path ({name}) with the sink", shape, tflops(flop, ms) + ratio)
    heads = [x.transpose(0, 1).unsqueeze(0).contiguous() for x in (q, k, v)]

    def sdpa() -> None:
        for a, b in segs:
            F.scaled_dot_product_attention(*(x[:, :, a:b] for x in heads), scale=scale)

    for name, sdp in (("flash", SDPBackend.FLASH_ATTENTION), ("cuDNN", SDPBackend.CUDNN_ATTENTION)):
        try:
            with sdpa_kernel(sdp):
                ms = ctx.time(sdpa)
            value = tflops(flop, ms) + ("" if ms is None or t is None else f"; Triton/SDPA "
                                        f"time {t / ms:.2f}")  # fmt: skip
        except RuntimeError as e:
            value = f"unavailable: {str(e).splitlines()[0][:80]}"
        ctx.report.add("d", f"torch SDPA {name} backend per segment, no sink", shape, value)


# ---------------------------------------------------------------------------- (e) layer
def layer_parts(ctx: Ctx, ours: bool) -> dict[str, Callable[[], Any]]:
    """The per-rank work of one MoE layer at SP8/EP4, as named steps on random tensors:
    linears and RMSNorm through headmoe's batch-invariant ops (`ours`) or cuBLAS / torch.

    The two all-to-alls of each branch are not run (one GPU): attention gets random q, k, v
    of the full sequence for the rank's heads, the MoE random rows for its heads of the EP
    group's tokens (ep * t_local), and the linears run on the rank's t_local rows."""
    sh, dt = ctx.sh, ctx.dtype
    c, t = sh.hidden, sh.t_local
    g = torch.Generator(device=ctx.device).manual_seed(11)
    lin_names = {"qkv": (3 * c, c), "g": (c // sh.head_dim, c), "proj": (c, c),
                 "split": (c, c), "merge": (c, c), "fc1": (2 * sh.shared, c),
                 "fc2": (c, sh.shared)}  # fmt: skip
    lin = {k: ctx.randn(o, i, scale=i**-0.5, gen=g) for k, (o, i) in lin_names.items()}
    x, w_norm = ctx.randn(t, c, gen=g), torch.zeros(c, device=ctx.device)
    q, k, v = (ctx.randn(sh.segment * sh.segments, sh.attn_heads, sh.head_dim, gen=g)
               for _ in range(3))  # fmt: skip
    sinks = ctx.randn(sh.attn_heads, dtype=torch.float32, gen=g)
    segs = [(i * sh.segment, (i + 1) * sh.segment) for i in range(sh.segments)]
    moe = moe_inputs(ctx, sh.ep * t, seed=12)
    attn_out = ctx.randn(t, c, gen=g)
    linear = bi_linear if ours else F.linear
    norm = norms.rms_norm if ours else norms.rms_norm_torch

    def attn_in() -> Any:
        xn = norm(x, w_norm).to(dt)
        return linear(xn, lin["qkv"]), linear(xn, lin["g"])

    def attn_out_proj() -> Any:
        gate = torch.sigmoid(linear(x, lin["g"]).float()).to(dt)
        o = attn_out.view(t, -1, sh.head_dim) * gate.unsqueeze(-1)
        return linear(o.reshape(t, c), lin["proj"])

    def moe_linears() -> Any:
        nrm = norm(x, w_norm).to(dt)
        shared = linear(swiglu7(linear(nrm, lin["fc1"])).to(dt), lin["fc2"])
        return linear(linear(nrm, lin["split"]), lin["merge"]) + shared

    return {
        "RMSNorm + linear_qkv + linear_g": attn_in,
        "sink attention (full sequence, rank's heads)": lambda: triton_segment_attention(
            q, k, v, segs, sinks, sh.head_dim**-0.5),
        "output gate + linear_proj": attn_out_proj,
        "MoE routing + experts (rank's heads, EP group's tokens)": lambda: experts_triton(
            moe["z"], *routes(ctx, moe), *moe["weights"]),
        "RMSNorm + split/merge linears + shared experts": moe_linears,
    }  # fmt: skip


def section_layer(ctx: Ctx) -> None:
    """Every step of `layer_parts` timed alone (headmoe's ops, then cuBLAS/torch), then all
    steps in a row."""
    sh = ctx.sh
    shape = (f"C={sh.hidden}, {sh.t_local:,} tok/rank, attention {sh.segments} x "
             f"{sh.segment:,}, MoE {sh.ep * sh.t_local:,} rows")  # fmt: skip
    totals = {}
    for ours in (True, False):
        label = "batch-invariant ops" if ours else "cuBLAS linears, torch RMSNorm"
        with forced_triton(ctx.dry and ours):
            parts = layer_parts(ctx, ours)
            for name, fn in parts.items():
                ctx.report.add("e", f"{name} [{label}]", shape, ms_text(ctx.time(fn)))
            totals[ours] = ctx.time(lambda parts=parts: [fn() for fn in parts.values()])
        ctx.report.add("e", f"one layer, all steps [{label}]", shape, ms_text(totals[ours]))
    if totals[True] is not None and totals[False] is not None:
        ctx.report.add("e", "layer time, batch-invariant / cuBLAS", shape,
                       f"{totals[True] / totals[False]:.2f}x")  # fmt: skip


# ---------------------------------------------------------------------------- (i) FP8
def fp8_weights(wts: list[torch.Tensor]) -> list[Any]:
    """The experts' weights quantized by headmoe's FP8 rule (`headmoe.moe.fp8.quantize`)."""
    from headmoe.moe.fp8 import quantize

    return [quantize(n, t) for n, t in zip(("W_gate", "W_up", "W_down"), wts)]


def check_fp8(ctx: Ctx) -> None:
    """W8A16 against the torch FP8 path (`experts_fp8`, fp32 GEMMs on the dequantized
    blocks), both widenings' bits, and a permuted half batch's rows against the full
    batch's."""
    from headmoe.moe.fp8_experts import experts_fp8
    from headmoe.moe.triton_fp8 import experts_triton_fp8

    n = ctx.sh.check_tokens
    inp = moe_inputs(ctx, n, seed=17)
    z, q = inp["z"], fp8_weights(inp["weights"])
    ids, w = routes(ctx, inp)
    shape = f"{n:,} tok x {ctx.sh.heads} heads"
    out = experts_triton_fp8(z, ids, w, *q)
    ref = experts_fp8(z, ids, w, *q).float()
    rel = float((out.float() - ref).norm() / ref.norm())
    tol = 1e-5 if ctx.dtype == torch.float32 else 1e-2
    ctx.report.add("i", "W8A16 vs the torch FP8 path (rel L2)", shape,
                   f"rel L2 {rel:.2e}", f"<= {tol:g}", rel <= tol)  # fmt: skip
    for native in (True, False):
        diff = mismatched_rows(experts_triton_fp8(z, ids, w, *q, native=native), out)
        ctx.report.add("i", f"widening native={native} vs the device default", shape,
                       f"{diff} rows differ", "0 rows differ", diff == 0)  # fmt: skip
    idx = torch.randperm(n, generator=torch.Generator().manual_seed(18))[: n // 2]
    idx = idx.to(z.device)
    diff = mismatched_rows(experts_triton_fp8(z[idx], ids[idx], w[idx], *q), out[idx])
    ctx.report.add("i", "rows of a permuted half batch vs the full batch", shape,
                   f"{diff} rows differ", "0 rows differ", diff == 0)  # fmt: skip


def check_fp8_layer(ctx: Ctx) -> None:
    """`MultiHeadMoE` in the FP8 format (`Fp8Experts`, what ``--expert-format fp8``
    builds) on this device takes the W8A16 kernels: same bits as calling them."""
    from headmoe.moe.fp8_format import SCALE_SUFFIX, VALUES, Fp8Experts
    from headmoe.moe.triton_fp8 import experts_triton_fp8

    sh = ctx.sh
    inp = moe_inputs(ctx, 64, seed=5)
    q = fp8_weights(inp["weights"])
    moe = MultiHeadMoE(moe_layer_config(ctx), experts=Fp8Experts()).to(ctx.device)
    for name, x in zip(VALUES, q):
        getattr(moe, name).copy_(x.data)
        getattr(moe, name + SCALE_SUFFIX).copy_(x.scale)
    moe.gate.copy_(inp["gate"])
    moe.router.expert_bias.copy_(inp["bias"])
    with forced_triton(ctx.dry):
        got = moe(inp["z"].reshape(64, -1)).view(64, sh.heads, sh.d)
    ids, w = routes(ctx, inp)
    bad = mismatched_rows(got, experts_triton_fp8(inp["z"], ids, w, *q))
    ctx.report.add("i", "MultiHeadMoE(Fp8Experts) on this device = W8A16 kernels", "64 tok",
                   f"{bad} rows differ", "0", bad == 0)  # fmt: skip


def bench_fp8_tokens(ctx: Ctx, n: int) -> None:
    """bf16 and W8A16 experts on the same routes: TFLOP/s and weight bytes streamed / s."""
    from headmoe.moe.triton_fp8 import experts_triton_fp8

    sh = ctx.sh
    inp = moe_inputs(ctx, n, seed=n + 1)
    z, wts = inp["z"], inp["weights"]
    q = fp8_weights(wts)
    ids, w = routes(ctx, inp)
    flop = 6.0 * sh.d * sh.f * n * sh.heads * sh.top_k
    shape = f"{n:,} tok x {sh.heads} heads, {sh.experts} experts, top-{sh.top_k}"
    sizes = {"bf16": sum(t.numel() * t.element_size() for t in wts),
             "fp8": sum(x.data.numel() + x.scale.numel() * 4 for x in q)}  # fmt: skip
    times = {"bf16": ctx.time(lambda: experts_triton(z, ids, w, *wts)),
             "fp8": ctx.time(lambda: experts_triton_fp8(z, ids, w, *q))}  # fmt: skip
    for kind, ms in times.items():
        rate = "" if ms is None else f"; weights {sizes[kind] / ms / 1e6:,.0f} GB/s"
        ctx.report.add("i", f"experts, {kind} weights ({sizes[kind] / 2**20:,.0f} MiB)", shape,
                       tflops(flop, ms) + rate)  # fmt: skip
    if None not in times.values():
        ctx.report.add("i", "W8A16 time / bf16 time", shape, f"{times['fp8'] / times['bf16']:.2f}")


def section_fp8(ctx: Ctx) -> None:
    check_fp8(ctx)
    check_fp8_layer(ctx)
    for n in ctx.sh.moe_tokens:
        bench_fp8_tokens(ctx, n)


# ---------------------------------------------------------------------------- main
# ---------------------------------------------------------------------------- (g) refiner
#: the refiner's block-grid attention: (latent T, H, W, text tokens, query heads, KV heads,
#: head dim); full: 1080p at SP8 per-rank heads; dry: a ragged 9x5x14 grid
REFINER_FULL = (63, 68, 120, 512, 4, 1, 128)
REFINER_DRY = (9, 5, 14, 6, 4, 2, 16)


def section_refiner(ctx: Ctx) -> None:
    """(g) The refiner's block-sparse range attention (`triton_range_attention`) over the
    1080p block grid at SP8 per-rank heads: against the CPU path on the first query tiles
    (max abs error), rows bit-identical for a head subset, and TFLOP/s of the attended pairs
    beside dense SDPA (flash) over as many pairs."""
    from headmoe.layers.range_attention import RangePlan, range_attention_reference
    from headmoe.layers.triton_range_attention import triton_range_attention
    from headmoe.models.refiner import attention_plan, get_refiner_config, pack_refiner

    t, h, w, lt, hq, hkv, dim = REFINER_DRY if ctx.dry else REFINER_FULL
    cfg = get_refiner_config("magi2-refiner")
    packed = pack_refiner(torch.zeros(48, t, h, w), torch.zeros(lt, cfg.text_in_channels), cfg)
    plan = attention_plan(packed)
    n, pairs = plan.num_tokens, plan.pairs()
    g = torch.Generator(device=ctx.device).manual_seed(11)
    q, k, v = (torch.randn(n, heads, dim, generator=g, device=ctx.device).to(ctx.dtype)
               for heads in (hq, hkv, hkv))  # fmt: skip
    scale = dim**-0.5
    shape = f"{t}x{h}x{w}+{lt} tok, {hq}/{hkv} heads x {dim}"
    full = triton_range_attention(q, k, v, plan, scale)
    few = min(48, len(plan.q_tiles))  # the first tiles: the CPU path is slow at 1080p
    part = RangePlan(plan.q_tiles[:few], plan.k_offsets[: few + 1],
                     plan.k_ranges[: int(plan.k_offsets[few])], n)
    ref = range_attention_reference(q.float().cpu(), k.float().cpu(), v.float().cpu(), part,
                                    scale)
    rows = int(plan.q_tiles[few - 1, 1])
    err = float((full[:rows].float().cpu() - ref[:rows]).abs().max())
    tol = 2e-2 if ctx.dtype == torch.bfloat16 else 1e-4
    ctx.report.add("g", "refiner attention vs CPU path (max abs err, first tiles)", shape,
            f"{err:.2e}", f"<= {tol:g}", err <= tol)
    sub = triton_range_attention(q[:, hq // hkv:], k[:, 1:], v[:, 1:], plan, scale)
    bad = mismatched_rows(sub, full[:, hq // hkv:])
    ctx.report.add("g", "refiner attention rows bit-identical (head subset)", shape,
            f"{bad} rows differ", "0", bad == 0)
    flop = 4.0 * pairs * dim * hq
    ms = ctx.time(lambda: triton_range_attention(q, k, v, plan, scale))
    ctx.report.add("g", f"refiner attention, Triton ({pairs:.3g} pairs, {100 * pairs / n**2:.2f}% "
            "of dense)", shape, tflops(flop, ms))
    side = int(pairs**0.5)  # dense attention over as many pairs
    dq, dk, dv = (torch.randn(1, hq, side, dim, generator=g, device=ctx.device).to(ctx.dtype)
                  for _ in range(3))  # fmt: skip
    dense_ms = ctx.time(lambda: F.scaled_dot_product_attention(dq, dk, dv, scale=scale))
    ratio = "" if ms is None or dense_ms is None else f"; range/dense TFLOP/s {dense_ms / ms:.2f}"
    ctx.report.add("g", "dense SDPA over the same pairs (reference)", f"L={side:,}, {hq} heads x {dim}",
            tflops(4.0 * side**2 * dim * hq, dense_ms) + ratio)


def mhc_branch(state, args, y, dtype, fused: bool):
    """One mHC branch (mix, input, update) on the fused kernels or the torch definition."""
    real = triton_runtime.use_triton
    triton_runtime.use_triton = (lambda t: True) if fused else (lambda t: False)
    try:
        mix = mhc.mhc_mix(state, *args, iters=20, eps=1e-12, norm_eps=1e-6)
        return mhc.mhc_input(state, mix, dtype), mhc.mhc_update(state, mix, y, dtype)
    finally:
        triton_runtime.use_triton = real


def section_mhc(ctx: Ctx) -> None:
    """Fused mHC at the layer's per-rank shape against the eager torch definition: error,
    rows alone vs in the batch (bits), time of both."""
    sh = ctx.sh
    n, c, t = sh.streams, sh.hidden, sh.t_local
    g = torch.Generator(device=ctx.device).manual_seed(11)
    state = ctx.randn(t, n, c, gen=g)
    f32 = {"dtype": torch.float32, "gen": g}
    args = (ctx.randn(n * c, scale=0.1, **f32), ctx.randn(n * c, 2 * n + n * n, **f32),
            tuple(ctx.randn(1, **f32).abs() for _ in range(3)),
            (ctx.randn(n, **f32), ctx.randn(n, **f32), ctx.randn(n * n, **f32)))  # fmt: skip
    y = ctx.randn(t, c, gen=g)
    shape = f"{t:,} tok x {n} x {c}, {ctx.dtype}".replace("torch.", "")
    fused = mhc_branch(state, args, y, ctx.dtype, True)
    eager = mhc_branch(state.float(), args, y.float(), torch.float32, False)
    err = max(float((a.float() - b).abs().max() / b.abs().max()) for a, b in zip(fused, eager))
    tol = 2e-2 if ctx.dtype == torch.bfloat16 else 1e-4
    ctx.report.add("h", "fused mHC vs eager fp32 (max err / max)", shape, f"{err:.2e}",
                   f"<= {tol:g}", err <= tol)  # fmt: skip
    lo, hi = t // 3, t // 3 + 5
    part = mhc_branch(state[lo:hi], args, y[lo:hi], ctx.dtype, True)
    bad = sum(mismatched_rows(a, b[lo:hi]) for a, b in zip(part, fused))
    ctx.report.add("h", "fused mHC rows alone vs in the batch", shape, f"{bad} rows differ",
                   "0", bad == 0)  # fmt: skip
    t_fused = ctx.time(lambda: mhc_branch(state, args, y, ctx.dtype, True))
    t_eager = ctx.time(lambda: mhc_branch(state, args, y, ctx.dtype, False))
    ratio = "" if t_fused is None or t_eager is None else f"; eager / fused {t_eager / t_fused:.2f}"
    ctx.report.add("h", "one mHC branch: fused, eager ms", shape,
                   f"{ms_text(t_fused)}, {ms_text(t_eager)}{ratio}")  # fmt: skip


# ---------------------------------------------------------------------------- (j) fusion
def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest |a - b| (fp32)."""
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def check_expert_tile(ctx: Ctx, n: int) -> None:
    """The fused expert tile against the two-kernel path on the same routes: rows that
    differ, the largest difference, rows alone vs in the batch, time of both."""
    sh = ctx.sh
    inp = moe_inputs(ctx, n, seed=n + 1)
    z, wts = inp["z"], inp["weights"]
    ids, w = routes(ctx, inp)
    two = dataclasses.replace(DEFAULT_TILES, fused=False)
    shape = f"{n:,} tok x {sh.heads} heads, {sh.experts} experts, top-{sh.top_k}"
    fused, split = experts_triton(z, ids, w, *wts), experts_triton(z, ids, w, *wts, tiles=two)
    ctx.report.add("j", "fused expert tile vs two kernels", shape,
                   f"{mismatched_rows(fused, split)} rows differ, max abs diff "
                   f"{max_diff(fused, split):.3g}")  # fmt: skip
    lo, hi = n // 3, n // 3 + 7
    alone = experts_triton(z[lo:hi], ids[lo:hi], w[lo:hi], *wts)
    bad = mismatched_rows(alone, fused[lo:hi])
    ctx.report.add("j", "fused expert tile rows alone vs in the batch", shape,
                   f"{bad} rows differ", "0", bad == 0)  # fmt: skip
    t_fused = ctx.time(lambda: experts_triton(z, ids, w, *wts))
    t_two = ctx.time(lambda: experts_triton(z, ids, w, *wts, tiles=two))
    ratio = "" if t_fused is None or t_two is None else f"; two / fused {t_two / t_fused:.2f}"
    ctx.report.add("j", "experts: fused tile, two kernels ms", shape,
                   f"{ms_text(t_fused)}, {ms_text(t_two)}{ratio}")  # fmt: skip


def check_fused_linear(ctx: Ctx) -> None:
    """`linear_rows` with the RMSNorm prologue and the SwiGLU7 epilogue (the multimodal
    MLP's up projection) against rms_norm_rows -> cast -> matmul -> swiglu7 -> cast."""
    sh, dt = ctx.sh, ctx.dtype
    g = torch.Generator(device=ctx.device).manual_seed(13)
    x = ctx.randn(sh.t_local, sh.hidden, gen=g)
    w = ctx.randn(2 * sh.shared, sh.hidden, scale=sh.hidden**-0.5, gen=g)
    nw = ctx.randn(sh.hidden, scale=0.1, dtype=torch.float32, gen=g)
    shape = f"{sh.t_local:,} tok, {sh.hidden} -> 2 x {sh.shared}, {dt}".replace("torch.", "")

    def fused() -> torch.Tensor:
        norm = triton_dense.RowNorm(triton_dense.rms_inv_rows(x, 1e-6), nw)
        return triton_dense.linear_rows(x, w.t(), norm=norm, swiglu=True, out_dtype=dt)

    def unfused() -> torch.Tensor:
        xn = triton_dense.rms_norm_rows(x, nw, 1e-6).to(dt)
        return swiglu7(triton_dense.matmul(xn, w.t()).float()).to(dt)

    a, b = fused(), unfused()
    ctx.report.add("j", "fused linear (norm + SwiGLU7) vs unfused kernels", shape,
                   f"{mismatched_rows(a, b)} rows differ, max abs diff {max_diff(a, b):.3g}")
    lo, hi = sh.t_local // 3, sh.t_local // 3 + 5
    norm = triton_dense.RowNorm(triton_dense.rms_inv_rows(x[lo:hi], 1e-6), nw)
    part = triton_dense.linear_rows(x[lo:hi], w.t(), norm=norm, swiglu=True, out_dtype=dt)
    bad = mismatched_rows(part, a[lo:hi])
    ctx.report.add("j", "fused linear rows alone vs in the batch", shape, f"{bad} rows differ",
                   "0", bad == 0)  # fmt: skip
    t_f, t_u = ctx.time(fused), ctx.time(unfused)
    ratio = "" if t_f is None or t_u is None else f"; unfused / fused {t_u / t_f:.2f}"
    ctx.report.add("j", "fused, unfused ms", shape, f"{ms_text(t_f)}, {ms_text(t_u)}{ratio}")


def section_fusion(ctx: Ctx) -> None:
    for n in ctx.sh.moe_tokens[-1:] if ctx.dry else ctx.sh.moe_tokens:  # dry: the code path once
        check_expert_tile(ctx, n)
    check_fused_linear(ctx)


# ---------------------------------------------------------------------------- (k) graphs
def graph_step_inputs(ctx: Ctx, t: int, seed: int) -> dict[str, Any]:
    """The layer step's inputs at ``t`` tokens: mHC state and branch output, the fused
    linear's weights, the MoE inputs (`moe_inputs`) of its rows."""
    sh = ctx.sh
    n, c = sh.streams, sh.hidden
    g = torch.Generator(device=ctx.device).manual_seed(seed)
    f32 = {"dtype": torch.float32, "gen": g}
    return {"state": ctx.randn(t, n, c, gen=g), "y": ctx.randn(t, c, gen=g),
            "mhc": (ctx.randn(n * c, scale=0.1, **f32), ctx.randn(n * c, 2 * n + n * n, **f32),
                    tuple(ctx.randn(1, **f32).abs() for _ in range(3)),
                    (ctx.randn(n, **f32), ctx.randn(n, **f32), ctx.randn(n * n, **f32))),
            "w": ctx.randn(2 * sh.shared, c, scale=c**-0.5, gen=g),
            "nw": ctx.randn(c, scale=0.1, **f32), "moe": moe_inputs(ctx, t, seed)}  # fmt: skip


def graph_step(ctx: Ctx, inp: dict[str, Any]) -> Callable[..., tuple[torch.Tensor, ...]]:
    """A layer-shaped step with no host sync on CUDA: the fused mHC branch, the fused layer
    linear (RMSNorm prologue, SwiGLU7), Triton routing and experts (grids from an upper
    bound). Takes (state [t, n, C], y [t, C], z [t, heads, d]); returns its outputs."""
    moe = inp["moe"]

    def step(state: torch.Tensor, y: torch.Tensor, z: torch.Tensor):
        x_in, new_state = mhc_branch(state, inp["mhc"], y, ctx.dtype, True)
        norm = triton_dense.RowNorm(triton_dense.rms_inv_rows(x_in, 1e-6), inp["nw"])
        up = triton_dense.linear_rows(x_in, inp["w"].t(), norm=norm, swiglu=True,
                                      out_dtype=ctx.dtype)  # fmt: skip
        ids, w = route_triton(z, moe["gate"], moe["bias"], ctx.sh.top_k, 4.9)
        return x_in, new_state, up, experts_triton(z, ids, w, *moe["weights"])

    return step


def launches(ctx: Ctx, fn: Callable[[], Any]) -> tuple[int, int]:
    """(kernel launches, graph launches) of one call of ``fn`` in torch.profiler's CUDA
    runtime events; (0, 0) in a dry run (no CUDA runtime)."""
    if ctx.dry:
        fn()
        return 0, 0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    kernels = sum("LaunchKernel" in x or x.startswith("cuLaunch") for x in names)
    return kernels, sum("GraphLaunch" in x for x in names)


def min_median(ctx: Ctx, fn: Callable[[], Any]) -> str:
    """min / median ms of `ctx.sh.reps` single-call timings, or "ran (dry)"."""
    if ctx.dry:
        fn()
        return "ran (dry)"
    times = [ctx.time(fn, reps=1) for _ in range(ctx.sh.reps)]
    ms = [x for x in times if x is not None]
    return f"min {min(ms):.3f} ms, median {statistics.median(ms):.3f} ms"


def section_graphs(ctx: Ctx) -> None:
    """The layer step eager vs `GraphedStep` (module doc, section k)."""
    from headmoe.layers.cuda_graphs import GraphedStep, stand_in

    sh, t = ctx.sh, ctx.sh.t_local
    inp = graph_step_inputs(ctx, t, seed=21)
    step = graph_step(ctx, inp)
    graphed = GraphedStep(step, **(stand_in() if ctx.dry else {}))
    shape = f"{t:,} tok x {sh.streams} x {sh.hidden}, {sh.heads} MoE heads, {ctx.dtype}"
    shape = shape.replace("torch.", "")
    with forced_triton(ctx.dry):
        args = (inp["state"], inp["y"], inp["moe"]["z"])
        eager, first = step(*args), graphed(*args)
        other = graph_step_inputs(ctx, t, seed=22)
        args2 = (other["state"], other["y"], other["moe"]["z"])
        eager2, replay2 = step(*args2), graphed(*args2)
        same = all(torch.equal(a, b) for a, b in zip((*eager, *eager2), (*first, *replay2)))
        ctx.report.add("k", "graphed step == eager step (torch.equal, capture and a "
                       "replay of new inputs)", shape,
                       f"{len(graphed.graphs)} graph(s), {graphed.replays} replays, "
                       f"refused: {list(graphed.refused.values()) or 'none'}", "equal",
                       same and graphed.replays == 2 and not graphed.refused)  # fmt: skip
        small = graph_step_inputs(ctx, t // 2 + 1, seed=23)
        args3 = (small["state"], small["y"], small["moe"]["z"])
        out3 = graphed(*args3, capture=False)
        ok3 = graphed.eager_calls == 1 and all(torch.equal(a, b)
                                               for a, b in zip(out3, step(*args3)))
        ctx.report.add("k", "a shape not captured runs eagerly", f"{t // 2 + 1:,} tok",
                       f"{graphed.eager_calls} eager call(s)", "1, equal", ok3)  # fmt: skip
        t_eager, t_graph = min_median(ctx, lambda: step(*args)), \
            min_median(ctx, lambda: graphed(*args))  # fmt: skip
        ctx.report.add("k", "one step: eager; graphed", shape, f"{t_eager}; {t_graph}")
        k_eager, _ = launches(ctx, lambda: step(*args))
        k_graph, g_graph = launches(ctx, lambda: graphed(*args))
        ctx.report.add("k", "launches of one step: eager kernels; graphed kernels + graphs",
                       shape, "counted on a GPU only (dry)" if ctx.dry else
                       f"{k_eager}; {k_graph} + {g_graph} (saved {k_eager - k_graph})")  # fmt: skip


SECTION_FNS: dict[str, Callable[[Ctx], None]] = {
    "0": section_compile, "a": section_checks, "b": section_probe, "c": section_moe,
    "d": section_attention, "e": section_layer, bench_stream.SECTION: bench_stream.gpu_section,
    "g": section_refiner, "h": section_mhc, "i": section_fp8, "j": section_fusion,
    "k": section_graphs,
}  # fmt: skip


def run_section(ctx: Ctx, key: str, inject: set[str], out: Path) -> None:
    """Run one section under its own try/except; record its status; rewrite the report."""
    start = time.monotonic()
    try:
        if key in inject:
            raise RuntimeError(f"injected failure in section {key} (--inject-failure)")
        ctx.check_budget()
        with torch.no_grad():
            SECTION_FNS[key](ctx)
        ctx.report.status[key] = "ok"
    except OutOfBudget:
        ctx.report.status[key] = "stopped: the --budget-s budget ran out"
    except Exception as e:  # noqa: BLE001 - recorded; the other sections still run
        traceback.print_exc()
        ctx.report.status[key] = f"FAILED: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    ctx.report.status[key] += f" ({time.monotonic() - start:.0f} s)"
    ctx.report.write(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="markdown file for the report")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU under Triton's interpreter, no timing")
    parser.add_argument("--budget-s", type=float, default=360.0,
                        help="stop starting timed work after this many seconds (default 360)")
    parser.add_argument("--cache-dir", default=None, help=(
        "where section d records the flash path's invariance proof that `--attention auto` "
        f"reads (default: {DeploymentOptions().cache_dir}; a dry run: <out>.cache)"))
    parser.add_argument("--inject-failure", action="append", default=[], choices=list(SECTIONS),
                        help="make this section raise at its start (tests the report)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=(
        "comma-separated sections to run, in the report's order (default: all); the others "
        "are reported 'not run'"))
    args = parser.parse_args(argv)  # fmt: skip
    if args.budget_s <= 0:
        parser.error(f"--budget-s must be > 0, got {args.budget_s}")
    chosen = [k.strip() for k in args.sections.split(",") if k.strip()]
    unknown = [k for k in chosen if k not in SECTIONS]
    if unknown or not chosen:
        parser.error(f"--sections: unknown section(s) {unknown or args.sections!r}; "
                     f"choose from {','.join(SECTIONS)}")
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernel modules are imported
        triton_runtime.install_row_local_dot()
        device, dtype, sh = "cpu", torch.float32, DRY
    elif not torch.cuda.is_available():
        print("gpu_check: no CUDA device (use --dry-run on a CPU machine)", file=sys.stderr)
        return 2
    else:
        device, dtype, sh = "cuda", torch.bfloat16, FULL
    proof_dir = args.cache_dir or (f"{args.out}.cache" if args.dry_run
                                   else DeploymentOptions().cache_dir)
    ctx = Ctx(args.dry_run, device, dtype, sh, time.monotonic() + args.budget_s, Report(),
              proof_dir)
    ctx.report.header = environment(ctx)
    ctx.report.write(args.out)
    for key in SECTIONS:
        if key in chosen:
            run_section(ctx, key, set(args.inject_failure), args.out)
    print(f"wrote {args.out}")
    failed = ctx.report.failures()
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
