"""Benchmark of one MAGI-2 transformer forward (tiny preset, fp32, one thread, one rank).

    .venv/bin/python benchmarks/bench_model.py
    .venv/bin/python benchmarks/bench_model.py --baseline-src /path/to/other/headmoe/src

Requests: the three golden request shapes (golden/magi2/cases.json: video grid,
audio latents, text tokens, CFG branches) and a 1k-token request (one branch, video
4 x 12 x 16 = 768, audio 100, text 156). Each forward is timed `--reps` times after one
warm-up; the median is reported.

`--baseline-src DIR` times the same requests, in the same run and interleaved with this
tree (each repetition runs both, in turn, in two worker processes), with the `headmoe`
package found in DIR (for example a checkout of an earlier commit, to compare the released
model with the look-alike it replaced). Only the public API common to both is used
(`get_config("tiny")`, `write_random_checkpoint`, `load_checkpoint`, `BranchInput`,
`Magi2Transformer(...)(branches)`).
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
sys.path.insert(0, str(REPO))  # `python benchmarks/bench_model.py` from a clone

from benchmarks.common import load_average  # noqa: E402

GOLDEN_CASES = REPO / "golden" / "magi2" / "cases.json"


def requests() -> dict[str, tuple[tuple[int, int, int], int, tuple[int, ...]]]:
    """name -> (video grid, audio latents, text tokens per branch)."""
    out = {}
    for name, case in json.loads(GOLDEN_CASES.read_text()).items():
        mi = case["make_inputs"]
        texts = (mi["text_len"], mi["null_text_len"]) if mi["cfg"] else (mi["text_len"],)
        out[f"golden {name}"] = (tuple(mi["video_thw"]), mi["audio_len"], texts)
    out["1k tokens"] = ((4, 12, 16), 100, (156,))
    return out


def worker(ckpt_dir: str) -> None:
    """Serve timing requests on stdin/stdout: one JSON line per request name."""
    import torch

    from headmoe.models.magi2 import (
        BranchInput,
        Magi2Transformer,
        get_config,
        load_checkpoint,
        write_random_checkpoint,
    )

    torch.set_num_threads(1)
    cfg = get_config("tiny")
    path = Path(ckpt_dir) / f"tiny-{os.getpid()}.safetensors"
    write_random_checkpoint(cfg, path, seed=0)
    model = Magi2Transformer(cfg, dtype=torch.float32)
    load_checkpoint(model, path)
    reqs = requests()
    gen = torch.Generator().manual_seed(0)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        grid, audio, texts = reqs[line.strip()]
        branches = [BranchInput(torch.randn(*grid, cfg.video_in_channels, generator=gen),
                                torch.randn(audio, cfg.audio_in_channels, generator=gen),
                                torch.randn(n, cfg.text_in_channels, generator=gen), 0.6, 0.6)
                    for n in texts]
        t0 = time.perf_counter()
        model(branches)
        print(json.dumps({"s": time.perf_counter() - t0}), flush=True)


def _start(src: Path, tmp: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, __file__, "--worker", tmp], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert json.loads(proc.stdout.readline())["ready"]
    return proc


def _time(proc: subprocess.Popen, name: str) -> float:
    proc.stdin.write(name + "\n")
    proc.stdin.flush()
    return json.loads(proc.stdout.readline())["s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--baseline-src", type=Path, default=None)
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        worker(args.worker)
        return
    with tempfile.TemporaryDirectory() as tmp:
        procs = {"this tree": _start(REPO / "src", tmp)}
        if args.baseline_src is not None:
            procs["baseline"] = _start(args.baseline_src.resolve(), tmp)
        rows = []
        for name in requests():
            times = {k: [] for k in procs}
            for i in range(args.reps + 1):  # A/B order alternates between repetitions
                for k, proc in (list(procs.items()) if i % 2 else list(procs.items())[::-1]):
                    t = _time(proc, name)
                    if i:
                        times[k].append(t)
            row = [name] + [f"{min(v) * 1e3:.1f} / {statistics.median(v) * 1e3:.1f}"
                            for v in times.values()]  # fmt: skip
            if "baseline" in procs:
                ratios = [a / b for a, b in zip(times["this tree"], times["baseline"])]
                row.append(f"{statistics.median(ratios):.2f}")
            rows.append(row)
        for proc in procs.values():
            proc.stdin.close()
            proc.wait(timeout=60)
    headers = ["request"] + [f"{k} ms min / median" for k in procs]
    print(load_average())
    if args.baseline_src is not None:
        headers.append("this / baseline")
    print("| " + " | ".join(headers) + " |\n|" + "---|" * len(headers))
    for row in rows:
        print("| " + " | ".join(row) + " |")


if __name__ == "__main__":
    main()
