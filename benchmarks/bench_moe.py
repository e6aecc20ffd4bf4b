"""Benchmark of the MoE expert compute on this CPU (one process, the machine's threads).

    .venv/bin/python benchmarks/bench_moe.py            # full tables
    .venv/bin/python benchmarks/bench_moe.py --quick    # fewer shapes, one repetition

Two regimes, fp32 and bf16, routes from the real router on random weights and tokens:

- MAGI-2 head shapes: d_head 256, d_expert 1280, top-6, 3 local heads (12 heads at EP4),
  64 and 256 experts per head, 1k..8k tokens.
- tiny config: 12 heads x 32, 8 experts, top-2, d_expert 64, 64..1024 tokens.

Methods, measured in the same run and interleaved (each repetition runs every method once;
the median is reported):

- fast: `experts_grouped` (sorted routes, grouped GEMMs, batch-invariant);
- loop: `experts_reference` (a Python loop over every (head, expert));
- dense: the dense bound, only the same three GEMMs (gate, up, down) as single dense
  matmuls over all M = tokens x heads x top-k routed rows with one expert's weights, in the
  same arithmetic (fp32 GEMMs; bf16 operands widened), without routing, sorting, the
  activation or the combine.

Targets: fast <= 1.2x dense at MAGI-2 shapes and never slower than loop; fast >= 5x faster
than loop at the tiny config. Routing time (`route`, the same for every method) is shown
apart.
"""

from __future__ import annotations

import argparse
import gc
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from benchmarks.common import load_average, markdown_table  # noqa: E402
from headmoe.moe import experts_grouped, experts_reference, route  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MAGI = {"heads": 3, "d": 256, "f": 1280, "k": 6}
TINY = {"heads": 12, "d": 32, "f": 64, "k": 2, "experts": 8}


def interleaved(methods: dict[str, Callable[[], object]], reps: int) -> dict[str, float]:
    """Median seconds per method (and its minimum under ``name + "_min"``); every
    repetition runs each method once, after a warm-up."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for i in range(reps + 1):
        for name, fn in methods.items():
            t0 = time.perf_counter()
            fn()
            if i:
                times[name].append(time.perf_counter() - t0)
    out = {name: statistics.median(ts) for name, ts in times.items()}
    return out | {f"{name}_min": min(ts) for name, ts in times.items()}


def dense_bound(x: torch.Tensor, wg: torch.Tensor, wu: torch.Tensor, wd: torch.Tensor):
    """Only the three GEMMs over all routed rows x `[M, d]` with one expert's weights (the
    gate output stands in for the activation)."""
    x = x.float()
    g = x @ wg.float()
    x @ wu.float()
    return g.to(wg.dtype).float() @ wd.float()


def measure(shape: dict, experts: int, tokens: int, dtype: torch.dtype, reps: int,
            weights: tuple[torch.Tensor, ...], with_loop: bool = True) -> dict:  # fmt: skip
    h, d, k = shape["heads"], shape["d"], shape["k"]
    g = torch.Generator().manual_seed(tokens)
    gate = torch.randn(h * experts, d, generator=g) / math.sqrt(d)
    z = torch.randn(tokens, h, d, generator=g).to(dtype)
    wg, wu, wd = (w.to(dtype) for w in weights)
    bias = torch.zeros(h * experts)
    ids, w = route(z, gate, bias, k, 1.0)
    rows = z.reshape(-1, d).repeat_interleave(k, dim=0)  # M = tokens * heads * k
    methods = {
        "route": lambda: route(z, gate, bias, k, 1.0),
        "fast": lambda: experts_grouped(z, ids, w, wg, wu, wd),
        "dense": lambda: dense_bound(rows, wg[0], wu[0], wd[0]),
    }
    if with_loop:
        methods["loop"] = lambda: experts_reference(z, ids, w, wg, wu, wd)
    out = interleaved(methods, reps)
    out["gflop"] = 3 * 2 * rows.shape[0] * d * shape["f"] / 1e9
    return out


def weights_for(shape: dict, experts: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(experts)
    n, d, f = shape["heads"] * experts, shape["d"], shape["f"]
    return (torch.randn(n, d, f, generator=g) / math.sqrt(d),
            torch.randn(n, d, f, generator=g) / math.sqrt(d),
            torch.randn(n, f, d, generator=g) / math.sqrt(f))  # fmt: skip


def min_med(r: dict, name: str) -> str:
    """``name``'s "min / median" ms of `measure`'s result ("-" where not measured)."""
    return "-" if name not in r else f"{r[name + '_min'] * 1e3:.1f} / {r[name] * 1e3:.1f}"


def row(name: str, experts: int, tokens: int, r: dict) -> list:
    loop = r.get("loop")
    return [
        name, experts, tokens, min_med(r, "route"), min_med(r, "fast"), min_med(r, "dense"),
        min_med(r, "loop"),
        f"{r['fast'] / r['dense']:.2f}", "-" if loop is None else f"{loop / r['fast']:.1f}",
        f"{r['gflop'] / r['fast']:.0f}",
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes, one repetition")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per method")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (default 1, as in a rank; see docs)")
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES))
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    reps = args.reps or (1 if args.quick else 3)
    magi_tokens = (1024, 4096) if args.quick else (1024, 2048, 4096, 8192)
    tiny_tokens = (64, 256, 1024)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {reps} reps + 1 "
          "warm-up, min / median ms; ratios (of medians) fast/dense and loop/fast", flush=True)
    print(load_average(), flush=True)
    rows = []
    for dname in args.dtypes:
        for tokens in tiny_tokens:
            r = measure(TINY, TINY["experts"], tokens, DTYPES[dname], max(reps, 5),
                        weights_for(TINY, TINY["experts"]))  # fmt: skip
            rows.append(row(f"tiny {dname}", TINY["experts"], tokens, r))
            print(rows[-1], flush=True)
    for experts in (64, 256):
        weights = weights_for(MAGI, experts)
        for dname in args.dtypes:
            for tokens in magi_tokens:
                r = measure(MAGI, experts, tokens, DTYPES[dname], reps, weights)
                rows.append(row(f"MAGI-2 {dname}", experts, tokens, r))
                print(rows[-1], flush=True)
                gc.collect()
        del weights
        gc.collect()
    print(markdown_table(
        ["regime", "experts/head", "tokens", "route ms min / median", "fast ms min / median",
         "dense ms min / median", "loop ms min / median",
         "fast / dense", "loop / fast", "fast GFLOP/s"], rows))  # fmt: skip


if __name__ == "__main__":
    main()
