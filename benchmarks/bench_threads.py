"""What thread-count-independent CPU numerics cost (issue 26): one denoising step (a MAGI-2
transformer forward over both CFG branches, tiny preset) at 1, 2 and all torch threads,
with oneMKL in its strict reproducible mode (headmoe's, "after") against MKL's default
mode ("before", where a rank with another thread count computes other bits).

    .venv/bin/python benchmarks/bench_threads.py [--reps 7] [--dtype fp32|bf16]

MKL's mode is chosen once per process, so each mode runs in its own worker process: the
"before" worker runs one GEMM before importing headmoe, which leaves MKL in its default
mode (headmoe.numerics then reports it, and the benchmark calls the model directly). The
workers take turns within every repetition, and the mode that goes first alternates, so a
slow moment of a shared machine hits both. Prints, per request and thread count, the
median and minimum step time of each mode and the median of the paired ratios
after / before, and the load average before and after the run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "src"))  # `python benchmarks/bench_threads.py` from a clone
#: request name -> (video latent grid, audio latents, text tokens per CFG branch)
REQUESTS = {
    "README request (13 x 64 x 96)": ((4, 4, 6), 26, (12, 24)),
    "1k tokens": ((4, 12, 16), 100, (156, 24)),
    "4k tokens": ((8, 16, 24), 200, (300, 24)),
}
MODES = ("before", "after")


def worker(mode: str, ckpt_dir: str, dtype_name: str) -> None:
    """Serve timing requests on stdin: ``<request>|<threads>`` -> one JSON line."""
    import torch

    if mode == "before":
        torch.ones(64, 64) @ torch.ones(64, 64)  # MKL's first GEMM: its default mode stays
    from headmoe.models.magi2 import (
        BranchInput,
        Magi2Transformer,
        get_config,
        load_checkpoint,
        write_random_checkpoint,
    )
    from headmoe.numerics import blas_mode

    cfg = get_config("tiny")
    path = Path(ckpt_dir) / f"tiny-{os.getpid()}.safetensors"
    write_random_checkpoint(cfg, path, seed=0)
    model = Magi2Transformer(cfg, dtype=getattr(torch, {"fp32": "float32"}.get(
        dtype_name, "bfloat16")))
    load_checkpoint(model, path)
    gen = torch.Generator().manual_seed(0)
    print(json.dumps({"ready": blas_mode().mode}), flush=True)
    for line in sys.stdin:
        name, threads = line.strip().split("|")
        grid, audio, texts = REQUESTS[name]
        branches = [BranchInput(torch.randn(*grid, cfg.video_in_channels, generator=gen),
                                torch.randn(audio, cfg.audio_in_channels, generator=gen),
                                torch.randn(n, cfg.text_in_channels, generator=gen), 0.6, 0.6)
                    for n in texts]
        torch.set_num_threads(int(threads))
        t0 = time.perf_counter()
        model(branches)
        print(json.dumps({"s": time.perf_counter() - t0}), flush=True)


def _start(mode: str, tmp: str, dtype: str) -> subprocess.Popen:
    from headmoe import OPENMP_DEFAULTS

    # both workers import torch before headmoe: they get headmoe's OpenMP defaults from here
    env = {**OPENMP_DEFAULTS, **{k: v for k, v in os.environ.items() if k != "MKL_CBWR"}}
    env["PYTHONPATH"] = str(REPO / "src")
    proc = subprocess.Popen([sys.executable, __file__, "--worker", mode, tmp, "--dtype", dtype],
                            env=env, text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    ready = json.loads(proc.stdout.readline())["ready"]
    print(f"{mode}: MKL mode {ready}", flush=True)
    return proc


def _time(proc: subprocess.Popen, name: str, threads: int) -> float:
    proc.stdin.write(f"{name}|{threads}\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["s"]


def _measure(procs: dict, name: str, threads: int, reps: int) -> list[str]:
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for i in range(reps + 1):  # the first repetition warms up
        order = MODES if i % 2 else MODES[::-1]
        for mode in order:
            t = _time(procs[mode], name, threads)
            if i:
                times[mode].append(t)
    ratio = statistics.median(a / b for a, b in zip(times["after"], times["before"]))
    cells = [f"{statistics.median(times[m]) * 1e3:.0f} / {min(times[m]) * 1e3:.0f}"
             for m in MODES]
    return [name, str(threads), *cells, f"{ratio:.2f}"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    ap.add_argument("--worker", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(*args.worker, args.dtype)
        return
    cores = len(os.sched_getaffinity(0))
    print(f"load average before: {os.getloadavg()}, cores: {cores}, dtype: {args.dtype}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        procs = {m: _start(m, tmp, args.dtype) for m in MODES}
        for name in REQUESTS:
            for threads in sorted({1, 2, cores}):
                rows.append(_measure(procs, name, threads, args.reps))
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    print(f"load average after: {os.getloadavg()}")
    headers = ["request", "threads", "before ms (median / min)", "after ms (median / min)",
               "after / before (paired median)"]
    print("| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
