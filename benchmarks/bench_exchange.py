"""Benchmark of the packed head <-> token exchange on 4 CPU Gloo ranks.

    .venv/bin/python benchmarks/bench_exchange.py            # full table (2-4 min)
    .venv/bin/python benchmarks/bench_exchange.py --quick    # a short run

MAGI-2 MoE shapes (12 heads x 256), fp32 and bf16, tokens per rank 512..8192 and uneven
variants. Measured in the same run, interleaved, slowest rank's median:

- bare pair: two `all_to_all_single` moving the same bytes between pre-packed,
  pre-allocated buffers (the floor);
- round trip: `scatter_heads` + `gather_heads` with an `ExchangeWorkspace`;
- allocate-per-call: the straightforward version (permute, contiguous, all-to-all into a
  fresh buffer, permute back) with fresh buffers on every call.

Targets from 2048 tokens per rank: round trip <= 1.5x the bare pair, and >= 2x faster than
allocate-per-call. A second table compares, at SP4 / EP2, the replicated exchange over the
SP group (both part policies) with the exchange inside each EP run.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from benchmarks.common import (  # noqa: E402
    interleaved,
    load_average,
    markdown_table,
    paired_ratio,
    slowest_rank_median,
)
from headmoe.config import ParallelConfig  # noqa: E402
from headmoe.distributed import Counters, ParallelContext  # noqa: E402
from headmoe.distributed.exchange import (  # noqa: E402
    ExchangeWorkspace,
    HeadLayout,
    gather_heads,
    replica_token_counts,
    scatter_heads,
)
from headmoe.testing import run_ranks  # noqa: E402

HEADS, DIM, WORLD = 12, 256, 4
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def uneven(n: int) -> tuple[int, ...]:
    return (n * 3 // 4, n * 5 // 4, n // 2, n * 3 // 2)


def skewed(n: int) -> tuple[int, ...]:
    """Uneven EP runs at SP4 / EP2: run (0, 1) holds 2.75 n tokens, run (2, 3) 1.25 n."""
    return (n * 3 // 2, n * 5 // 4, n * 3 // 4, n // 2)


def configs(quick: bool) -> list[dict]:
    if quick:
        ep = [(d, (n,) * 4) for n in (512, 2048) for d in DTYPES] + [("fp32", uneven(2048))]
        rep = [("fp32", skewed(2048))]
    else:
        ep = [(d, (n,) * 4) for n in (512, 1024, 2048, 4096, 8192) for d in DTYPES]
        ep += [(d, uneven(n)) for n in (2048, 8192) for d in DTYPES]
        rep = [(d, c(n)) for n in (2048, 8192) for c in (uneven, skewed) for d in DTYPES]
    return [{"kind": "ep4", "dtype": d, "counts": c} for d, c in ep] + [
        {"kind": "sp4ep2", "dtype": d, "counts": c} for d, c in rep
    ]


def _splits(layout: HeadLayout, row: int) -> tuple[list[int], list[int]]:
    """(scatter input splits, scatter output splits) in elements."""
    return [n * row for n in layout.send_counts], [n * row for n in layout.owned_counts]


def allocate_per_call(x: torch.Tensor, group, layout: HeadLayout) -> torch.Tensor:
    """The straightforward round trip (no replicas): fresh buffers on every call."""
    t, heads, d = x.shape
    shards, h = layout.shards, heads // layout.shards
    send_splits, recv_splits = _splits(layout, h * d)
    send = x.view(t, shards, h, d).permute(1, 0, 2, 3).contiguous()
    recv = torch.empty(layout.owned_tokens, h, d, dtype=x.dtype)
    dist.all_to_all_single(recv.view(-1), send.view(-1), recv_splits, send_splits, group=group)
    back = torch.empty(shards, t, h, d, dtype=x.dtype)
    dist.all_to_all_single(back.view(-1), recv.view(-1), send_splits, recv_splits, group=group)
    return back.permute(1, 0, 2, 3).reshape(t, heads, d)


def _bytes_out(fn) -> int:
    counters = Counters()
    fn(counters)
    return sum(r.bytes_sent for r in counters.exchanges)


def _ep4(cfg: dict, rank: int, group, reps: int) -> dict:
    counts, dtype = cfg["counts"], DTYPES[cfg["dtype"]]
    layout = HeadLayout(counts, rank)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(counts[rank], HEADS, DIM, generator=g).to(dtype)
    send_splits, recv_splits = _splits(layout, HEADS // layout.shards * DIM)
    packed = x.view(-1, layout.shards, HEADS // layout.shards, DIM).transpose(0, 1).contiguous()
    packed = packed.view(-1)
    mid = torch.empty(sum(recv_splits), dtype=dtype)
    back = torch.empty_like(packed)
    ws = ExchangeWorkspace()

    def bare():
        dist.all_to_all_single(mid, packed, recv_splits, send_splits, group=group)
        dist.all_to_all_single(back, mid, send_splits, recv_splits, group=group)

    def round_trip(counters=None):
        y = scatter_heads(x, group, layout, workspace=ws, counters=counters)
        return gather_heads(y, group, layout, workspace=ws, counters=counters)

    times = interleaved(
        {"bare": bare, "round_trip": round_trip,
         "alloc": lambda: allocate_per_call(x, group, layout)},  # fmt: skip
        reps,
    )
    ok = torch.equal(round_trip(), x) and torch.equal(allocate_per_call(x, group, layout), x)
    return {"times": times, "bytes": _bytes_out(round_trip), "ok": ok}


def _sp4ep2(cfg: dict, ctx: ParallelContext, reps: int) -> dict:
    counts, dtype = cfg["counts"], DTYPES[cfg["dtype"]]
    rank = ctx.rank
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(counts[rank], HEADS, DIM, generator=g).to(dtype)
    run = ctx.group_ranks("ep")
    exchanges = {
        "in_run": (ctx.group("ep"), HeadLayout(tuple(counts[r] for r in run), run.index(rank))),
    }
    for policy in ("run_totals", "balanced"):
        parts = replica_token_counts(counts, 2, policy)
        exchanges[policy] = (ctx.group("sp"), HeadLayout(counts, rank, parts))
    workspaces = {name: ExchangeWorkspace() for name in exchanges}

    def method(name):
        group, layout = exchanges[name]

        def fn(counters=None):
            ws = workspaces[name]
            y = scatter_heads(x, group, layout, workspace=ws, counters=counters)
            return gather_heads(y, group, layout, workspace=ws, counters=counters)

        return fn

    fns = {name: method(name) for name in exchanges}
    times = interleaved(fns, reps)
    ok = all(torch.equal(fn(), x) for fn in fns.values())
    rows = {name: exchanges[name][1].owned_tokens for name in exchanges}
    return {"times": times, "bytes": {n: _bytes_out(f) for n, f in fns.items()}, "ok": ok,
            "owned": rows}  # fmt: skip


def _worker(rank: int, world_size: int, cfgs: list[dict], reps: int) -> list[dict]:
    ctx = ParallelContext.initialize(
        ParallelConfig(ulysses_degree=WORLD, enable_expert_parallel=True, expert_parallel_size=2)
    )
    out = []
    for cfg in cfgs:
        if cfg["kind"] == "ep4":
            out.append(_ep4(cfg, rank, ctx.group("sp"), reps))
        else:
            out.append(_sp4ep2(cfg, ctx, reps))
        gc.collect()
    ctx.destroy()
    return out


def _ms(per_rank: list[dict], cfg_i: int, name: str) -> str:
    """"min / median" ms over repetitions of the slowest rank's time of ``name``."""
    times = [r[cfg_i]["times"][name] for r in per_rank]
    slowest = [max(ts) for ts in zip(*times)]
    return f"{1e3 * min(slowest):.1f} / {1e3 * slowest_rank_median(times):.1f}"


def _ratio(per_rank: list[list[dict]], cfg_i: int, a: str, b: str) -> float:
    return paired_ratio(*([r[cfg_i]["times"][k] for r in per_rank] for k in (a, b)))


def report(cfgs: list[dict], per_rank: list[list[dict]]) -> str:
    ep_rows, rep_rows = [], []
    for i, cfg in enumerate(cfgs):
        res = [r[i] for r in per_rank]
        if not all(r["ok"] for r in res):
            raise AssertionError(f"round trip did not return its input for {cfg}")
        n = cfg["counts"]
        shown = f"{n[0]}" if len(set(n)) == 1 else "/".join(map(str, n))
        if cfg["kind"] == "ep4":
            bare, rt, alloc = (_ms(per_rank, i, k) for k in ("bare", "round_trip", "alloc"))
            over_bare = _ratio(per_rank, i, "round_trip", "bare")
            alloc_over = _ratio(per_rank, i, "alloc", "round_trip")
            target = sum(n) / len(n) >= 2048  # mean tokens per rank
            verdict = ("yes" if over_bare <= 1.5 and alloc_over >= 2 else "NO") if target else "-"
            ep_rows.append([cfg["dtype"], shown, f"{max(r['bytes'] for r in res) / 1e6:.1f}",
                            bare, rt, alloc, f"{over_bare:.2f}",
                            f"{alloc_over:.2f}", verdict])  # fmt: skip
        else:
            ms = {k: _ms(per_rank, i, k) for k in ("in_run", "run_totals", "balanced")}
            mb = {k: max(r["bytes"][k] for r in res) / 1e6 for k in ms}
            rows = {k: max(r["owned"][k] for r in res) for k in ms}
            rep_rows.append([cfg["dtype"], shown]
                            + [f"{ms[k]} ({mb[k]:.0f} MB, {rows[k]} rows)" for k in ms]
                            + [f"{_ratio(per_rank, i, 'run_totals', 'in_run'):.2f}",
                               f"{_ratio(per_rank, i, 'balanced', 'in_run'):.2f}"])  # fmt: skip
    ep_table = markdown_table(
        ["dtype", "tokens/rank", "MB out/rank", "bare pair ms min / median",
         "round trip ms min / median", "alloc-per-call ms min / median", "round trip / bare", "alloc / round trip", "targets met"],
        ep_rows,
    )  # fmt: skip
    rep_table = markdown_table(
        ["dtype", "tokens/rank", "in-run ms min / median (out, owner rows)",
         "replicated run_totals ms", "replicated balanced ms", "run_totals / in-run", "balanced / in-run"],
        rep_rows,
    )  # fmt: skip
    return (
        "EP over the whole group of 4 ranks (12 heads x 256, 3 heads per owner):\n\n"
        + ep_table
        + "\n\nSP4 / EP2 round trip: in each EP run vs replicated over the SP group "
        "(max over ranks of bytes sent and of rows owned):\n\n"
        + rep_table
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer shapes and repetitions")
    parser.add_argument("--reps", type=int, default=None, help="timed repetitions per method")
    args = parser.parse_args(argv)
    reps = args.reps or (3 if args.quick else 7)
    cfgs = configs(args.quick)
    print(f"torch {torch.__version__}, {WORLD} Gloo ranks x 1 thread, {reps} reps + 1 warm-up, "
          "times: slowest rank's min / median; ratios: median over reps of the paired ratio",
          flush=True)  # fmt: skip
    print(load_average(), flush=True)
    per_rank = run_ranks(_worker, WORLD, args=(cfgs, reps), timeout=1800)
    print(report(cfgs, per_rank))


if __name__ == "__main__":
    main()
