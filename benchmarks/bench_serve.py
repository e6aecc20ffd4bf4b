"""Resident server vs a fresh ``headmoe generate``: the end-to-end time of one request.

    python benchmarks/bench_serve.py [--steps 8] [--reps 3] [--nproc 4 --ulysses-degree 4
        --enable-expert-parallel --expert-parallel-size 2]

Starts ``headmoe serve`` once with the layout (model loaded once), sends one warm-up request
(the server's first), then, ``--reps`` times in turn: a fresh ``headmoe generate`` of the same
request and layout (wall time of the whole command: start ranks, build groups, load the
checkpoint, denoise, write), and the same request to the server through
``POST /v1/videos/sync`` (wall time from sending the request to holding the mp4 bytes).
Interleaving lets a slow moment of the shared machine hit both alike. Prints each time, the
medians and the ratio generate / serve, and checks that every run gave the same
``video_sha256`` / ``audio_sha256``.
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


def _start_server(tmp: Path, layout: list[str]) -> tuple[subprocess.Popen, str]:
    cmd = [HEADMOE, "serve", "--port", "0", "--cache-dir", str(tmp / "cache"), "--output-dir",
           str(tmp / "served"), *layout]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if m := re.search(r"listening on (http://\S+)", line):
            return proc, m.group(1)
        if time.monotonic() > deadline:
            break
    proc.kill()
    raise RuntimeError(f"the server did not start: {' '.join(cmd)}")


def _generate(tmp: Path, layout: list[str], request: dict, k: int) -> tuple[float, tuple]:
    out = tmp / f"generate{k}.mp4"
    flags = [f"--{name.replace('_', '-')}={v}" for name, v in request.items()]
    cmd = [HEADMOE, "generate", *flags, *layout, "--cache-dir", str(tmp / "cache"), "--output",
           str(out), "--no-progress"]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, capture_output=True, timeout=600)
    wall = time.perf_counter() - t0
    side = json.loads(out.with_suffix(".json").read_text())
    return wall, (side["video_sha256"], side["audio_sha256"])


def _served(client: httpx.Client, request: dict) -> tuple[float, tuple]:
    t0 = time.perf_counter()
    r = client.post("/v1/videos/sync", json=request)
    wall = time.perf_counter() - t0
    r.raise_for_status()
    return wall, (r.headers["x-video-sha256"], r.headers["x-audio-sha256"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--prompt", default="a red fox running through snow at dusk")
    args, layout = p.parse_known_args()
    layout = layout or ["--nproc", "4", "--ulysses-degree", "4", "--enable-expert-parallel",
                        "--expert-parallel-size", "2"]
    request = {"prompt": args.prompt, "num_inference_steps": args.steps, "seed": 0}
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        proc, url = _start_server(tmp, layout)
        try:
            with httpx.Client(base_url=url, timeout=600) as client:
                first, ref = _served(client, request)
                print(f"layout {' '.join(layout)}, {args.steps} steps; server's first request "
                      f"{first:.2f} s")
                gen, srv = [], []
                for k in range(args.reps):
                    g, gh = _generate(tmp, layout, request, k)
                    s, sh = _served(client, request)
                    assert gh == ref and sh == ref, (gh, sh, ref)
                    gen.append(g)
                    srv.append(s)
                    print(f"rep {k}: fresh generate {g:.2f} s, server request {s:.2f} s, "
                          f"ratio {g / s:.1f}x")
                sides = sorted((tmp / "served").glob("*.json"))
                loads = {json.loads(f.read_text())["server"]["model_loaded_at"] for f in sides}
                print(f"median: generate {statistics.median(gen):.2f} s, server "
                      f"{statistics.median(srv):.2f} s, ratio "
                      f"{statistics.median(g / s for g, s in zip(gen, srv)):.1f}x; same hashes "
                      f"({ref[0][:16]}, {ref[1][:16]}); {len(sides)} served requests, model "
                      f"loaded {len(loads)} time(s)")
                print(f"min / median: generate {min_median(gen)} s, server {min_median(srv)} s; "
                      f"{load_average()}")
        finally:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
