"""The refiner's block-grid attention on the CPU: the range path headmoe runs
(`headmoe.layers.range_attention.range_attention_reference`: per video block, the gathered
keys of its neighbour blocks plus the text) against one dense masked SDPA over the same
q, k, v and the same [N, N] mask (the only way to run this mask with a stock kernel).

Shapes are per-rank shapes of the released refiner at SP 8 (4 query heads, 1 KV head,
head dim 128, fp32 on the CPU) over smaller latents than 1080p's 63 x 68 x 120 (a dense
mask there would be 2.6e11 cells). Time: median of `--reps` interleaved calls in this
process, and their ratio. Peak memory: each method once in a fresh process, the rise of
the process's peak RSS (VmHWM, reset through /proc/self/clear_refs: Linux) over its RSS
with the inputs built; the dense mask itself is listed apart.

    python benchmarks/bench_refiner_attention.py [--reps 3] [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/x.py`

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from benchmarks.common import REPO_ROOT, load_average, markdown_table, min_median  # noqa: E402
from headmoe.layers.range_attention import range_attention_reference  # noqa: E402
from headmoe.models.refiner import (  # noqa: E402
    attention_plan,
    get_refiner_config,
    pack_refiner,
)

#: latent (T, H, W) and text tokens of each case
#: (the dense baseline's fp32 scores are 4 N^2 bytes per head: 1.1 GiB at 8x24x42)
CASES = {"8x16x28": ((8, 16, 28), 256), "8x24x42": ((8, 24, 42), 256)}
HQ, HKV, DIM = 4, 1, 128


def inputs(thw: tuple[int, int, int], text: int):
    cfg = get_refiner_config("magi2-refiner")
    packed = pack_refiner(torch.zeros(48, *thw), torch.zeros(text, cfg.text_in_channels), cfg)
    plan = attention_plan(packed)
    g = torch.Generator().manual_seed(0)
    n = packed.num_tokens
    q, k, v = (torch.randn(n, h, DIM, generator=g) for h in (HQ, HKV, HKV))
    return plan, q, k, v


def dense_mask(plan) -> torch.Tensor:
    """The plan's [N, N] bool mask (what the dense baseline needs)."""
    n = plan.num_tokens
    mask = torch.zeros(n, n, dtype=torch.bool)
    for r, (a, b) in enumerate(plan.q_tiles.tolist()):
        for ka, kb in plan.keys_of(r):
            mask[a:b, ka:kb] = True
    return mask


def dense(q, k, v, mask, scale):
    qh = q.transpose(0, 1)
    kh = k.repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    vh = v.repeat_interleave(HQ // HKV, 1).transpose(0, 1)
    return F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale).transpose(0, 1)


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":"))


def one(method: str, case: str) -> dict:
    """Run `method` once on `case`; the rise of the peak RSS (MiB) over the RSS with the
    inputs (and the dense mask) built, and the time (s). Linux: writing 5 to
    /proc/self/clear_refs resets the peak (VmHWM)."""
    thw, text = CASES[case]
    plan, q, k, v = inputs(thw, text)
    mask = dense_mask(plan) if method == "dense" else None
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    base = _status_kib("VmRSS")
    t0 = time.perf_counter()
    if method == "dense":
        dense(q, k, v, mask, DIM ** -0.5)
    else:
        range_attention_reference(q, k, v, plan, DIM ** -0.5)
    sec = time.perf_counter() - t0
    mask_mib = 0 if mask is None else mask.numel() / 2**20
    return {"rise_mib": (_status_kib("VmHWM") - base) / 1024, "mask_mib": mask_mib, "s": sec}


def peak(method: str, case: str, threads: int) -> dict:
    cmd = [sys.executable, __file__, "--one", method, case, "--threads", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=REPO_ROOT)
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(case: str, reps: int) -> dict:
    thw, text = CASES[case]
    plan, q, k, v = inputs(thw, text)
    mask = dense_mask(plan)
    scale = DIM ** -0.5
    ours = range_attention_reference(q, k, v, plan, scale)
    ref = dense(q, k, v, mask, scale)
    times: dict[str, list[float]] = {"range": [], "dense": []}
    methods = (("range", lambda: range_attention_reference(q, k, v, plan, scale)),
               ("dense", lambda: dense(q, k, v, mask, scale)))
    for rep in range(reps):  # A/B order alternates: B runs first every other repetition
        for name, fn in (methods if rep % 2 == 0 else methods[::-1]):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    n = plan.num_tokens
    return {"tokens": n, "pairs": plan.pairs(), "density": plan.pairs() / n**2,
            "max_abs": (ours - ref).abs().max().item(),
            "range_s": min_median(times["range"]), "dense_s": min_median(times["dense"]),
            "ratio": statistics.median(d / r for r, d in zip(times["range"], times["dense"]))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--one", nargs=2, metavar=("METHOD", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.one:
        print(json.dumps(one(*args.one)))
        return 0
    rows = []
    for case in args.cases:
        r = bench(case, args.reps)
        mem = {m: peak(m, case, args.threads) for m in ("range", "dense")}
        rows.append([case, f"{r['tokens']:,}", f"{100 * r['density']:.1f}%",
                     r["range_s"], r["dense_s"], f"{r['ratio']:.2f}x",
                     f"{mem['range']['rise_mib']:.0f}",
                     f"{mem['dense']['rise_mib']:.0f} (+{mem['dense']['mask_mib']:.0f} mask)",
                     f"{r['max_abs']:.1e}"])
        print(rows[-1], flush=True)
    print(load_average())
    print(markdown_table(["latent TxHxW", "tokens", "mask density", "range s min / med",
                          "dense s min / med",
                          "dense / range", "range peak MiB", "dense peak MiB",
                          "max abs diff"], rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
