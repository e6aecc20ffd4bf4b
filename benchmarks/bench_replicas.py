"""Data-parallel serve replicas vs one rank: requests per minute of a burst of requests.

    .venv/bin/python benchmarks/bench_replicas.py [--repeats 1] [--steps 4] [--quick]

Makes the references first: ``headmoe generate --samples`` of the 8 requests (different
seeds and prompts; 2 with ``--quick``) in one process. Then, ``--repeats`` times, for each
layout in turn (the one that goes first alternates between repeats, so a slow moment of the
shared machine hits both alike): starts ``headmoe serve`` with it (``--nproc 2
--data-parallel-size 2``, or one rank), waits until ``/health`` says ok, submits every
request at once (``POST /v1/videos``) and polls until the last one completes; the time is
from the first submit to the last completion (model loading is outside it). Prints each
run's seconds and requests per minute, then the min / median seconds of each layout, the
median of the paired ratios one-rank time / replicas time (2 replicas on 2 cores: ideal
2x), and the load average before and after. Every served video's ``video_sha256`` /
``audio_sha256`` must equal generate's of the same request, or the benchmark fails.
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # `python benchmarks/x.py`
from benchmarks.common import load_average, min_median  # noqa: E402

HEADMOE = str(Path(sys.executable).with_name("headmoe"))
LAYOUTS = {"2 replicas": ["--nproc", "2", "--data-parallel-size", "2"], "1 rank": []}
PROMPTS = ["a red fox running through snow at dusk", "a heron lifting off a misty lake",
           "waves breaking on black volcanic sand", "a tram crossing a rainy city square",
           "lanterns drifting over a night river", "a kestrel hovering above a cornfield",
           "steam rising from a mountain hot spring", "a cat asleep on a sunlit windowsill"]
WAIT_S = 1800.0


def _requests(n: int, steps: int) -> list[dict]:
    return [{"prompt": PROMPTS[k], "seed": 100 + k, "num_inference_steps": steps}
            for k in range(n)]


def _references(tmp: Path, requests: list[dict]) -> list[tuple[str, str]]:
    """``headmoe generate --samples`` of ``requests`` (one model load): their hashes."""
    samples = tmp / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in requests))
    subprocess.run([HEADMOE, "generate", "--samples", str(samples), "--cache-dir",
                    str(tmp / "cache"), "--output", str(tmp / "ref.mp4"), "--no-progress"],
                   check=True, capture_output=True, timeout=WAIT_S)
    sides = [json.loads((tmp / f"ref.{n}.json").read_text()) for n in range(1, len(requests) + 1)]
    return [(s["video_sha256"], s["audio_sha256"]) for s in sides]


def _start_server(tmp: Path, layout: list[str], run: int) -> tuple[subprocess.Popen, str]:
    """``headmoe serve`` with ``layout``, its URL once ``/health`` says ok (all loaded)."""
    out = tmp / f"served{run}"
    cmd = [HEADMOE, "serve", "--port", "0", "--cache-dir", str(tmp / "cache"), "--output-dir",
           str(out), "--max-queue", "16", *layout]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 600
    assert proc.stdout is not None
    for line in proc.stdout:
        if m := re.search(r"listening on (http://\S+)", line):
            url = m.group(1)
            break
        if time.monotonic() > deadline:
            break
    else:
        proc.kill()
        raise RuntimeError(f"the server did not start: {' '.join(cmd)}")
    with httpx.Client(base_url=url, timeout=60) as client:
        while client.get("/health").status_code != 200:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                raise RuntimeError(f"the server never became ready: {' '.join(cmd)}")
            time.sleep(0.2)
    return proc, url


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=30)


def _burst(url: str, requests: list[dict]) -> tuple[float, list[dict]]:
    """Submit every request at once, poll until all finished: (seconds from the first
    submit to the last completion, the finished jobs in request order)."""
    with httpx.Client(base_url=url, timeout=60) as client:
        t0 = time.perf_counter()
        ids = []
        for r in requests:
            resp = client.post("/v1/videos", json=r)
            resp.raise_for_status()
            ids.append(resp.json()["id"])
        deadline = time.monotonic() + WAIT_S
        while True:
            jobs = {j["id"]: j for j in client.get("/v1/videos").json()["data"]}
            if all(jobs[i]["status"] in ("completed", "failed", "cancelled") for i in ids):
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"jobs still running after {WAIT_S:g} s")
            time.sleep(0.05)
        wall = time.perf_counter() - t0
    return wall, [jobs[i] for i in ids]


def _check(layout: str, jobs: list[dict], refs: list[tuple[str, str]]) -> None:
    for k, (job, ref) in enumerate(zip(jobs, refs)):
        got = (job.get("video_sha256"), job.get("audio_sha256"))
        if job["status"] != "completed" or got != ref:
            raise SystemExit(f"FAILED: {layout}, request {k}: {job['status']} {got} != "
                             f"generate's {ref} ({job.get('error')})")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--steps", type=int, default=4, help="steps of every request (default 4)")
    p.add_argument("--quick", action="store_true", help="2 requests (a smoke test)")
    args = p.parse_args()
    requests = _requests(2 if args.quick else 8, args.steps)
    print(f"{len(requests)} requests of {args.steps} steps, tiny release; {load_average()} "
          "(before)", flush=True)
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        refs = _references(tmp, requests)
        times: dict[str, list[float]] = {k: [] for k in LAYOUTS}
        for rep in range(args.repeats):
            order = list(LAYOUTS) if rep % 2 == 0 else list(reversed(LAYOUTS))
            for layout in order:
                proc, url = _start_server(tmp, LAYOUTS[layout], len(sum(times.values(), [])))
                try:
                    wall, jobs = _burst(url, requests)
                finally:
                    _stop(proc)
                _check(layout, jobs, refs)
                times[layout].append(wall)
                replicas = sorted({j["replica"] for j in jobs})
                print(f"repeat {rep}, {layout}: {wall:.2f} s, "
                      f"{60 * len(requests) / wall:.2f} requests/min (replicas used {replicas})",
                      flush=True)
    two, one = times["2 replicas"], times["1 rank"]
    ratio = statistics.median(o / t for o, t in zip(one, two))
    for layout, ts in times.items():
        print(f"{layout}: min / median {min_median(ts)} s, median "
              f"{60 * len(requests) / statistics.median(ts):.2f} requests/min")
    print(f"ratio (1 rank time / 2 replicas time, median of {args.repeats} pair(s)): "
          f"{ratio:.2f}x (ideal on 2 cores: 2x); every video equals generate --samples' bytes")
    print(f"{load_average()} (after)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
