"""The README's request gives the same bytes on every layout *and thread count* of this
machine (issue 26): `headmoe generate` on one rank with its default threads (every core of
this process), ``--nproc 2 --ulysses-degree 2`` (one thread each on 2 cores), the README's
SP4 + EP2 layout (4 ranks on 2 cores: oversubscribed), and `headmoe serve --nproc 2`. Each
runs in its own processes, as a user runs them; the sidecar states the threads each ran."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from headmoe.distributed.context import available_cores
from tests.serve.server import HEADMOE, Server, finished, wait_for

PROMPT = "a red fox running through snow at dusk"  # the README's prompt
STEPS = "2"
LAYOUTS = {
    "1 rank": [],
    "sp2": ["--nproc", "2", "--ulysses-degree", "2"],
    "sp4 ep2": ["--nproc", "4", "--ulysses-degree", "4", "--enable-expert-parallel",
                "--expert-parallel-size", "2"],
}


def _generate(tmp: Path, cache: Path, name: str, flags: list[str]) -> dict:
    out = tmp / f"{name.replace(' ', '_')}.mp4"
    cmd = [HEADMOE, "generate", "--prompt", PROMPT, "--num-inference-steps", STEPS,
           "--cache-dir", str(cache), "--output", str(out), "--no-progress", *flags]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr
    return json.loads(out.with_suffix(".json").read_text())


def _serve(tmp: Path, cache: Path) -> dict:
    server = Server(tmp, cache, "--nproc", "2", "--ulysses-degree", "2")
    try:
        with server.client() as client:
            job = client.post("/v1/videos", json={
                "prompt": PROMPT, "num_inference_steps": int(STEPS)}).json()
            return wait_for(client, job["id"], finished, timeout=300)
    finally:
        server.stop()


@pytest.mark.multirank
def test_readme_request_same_bytes_on_every_layout_and_thread_count(tmp_path):
    """The four runs go at once (each its own processes; the thread count a rank takes is
    its launcher's rule, not the machine's load), after one run has built the tiny model."""
    cache = tmp_path / "cache"
    first, *rest = LAYOUTS.items()
    sides = {first[0]: _generate(tmp_path, cache, *first)}
    with ThreadPoolExecutor(len(rest) + 1) as pool:
        served = pool.submit(_serve, tmp_path, cache)
        runs = {name: pool.submit(_generate, tmp_path, cache, name, flags)
                for name, flags in rest}
        sides |= {name: run.result() for name, run in runs.items()}
        job = served.result()
    hashes = {name: (s["video_sha256"], s["audio_sha256"]) for name, s in sides.items()}
    assert len(set(hashes.values())) == 1, hashes
    threads = {name: s["numerics"]["torch_threads"] for name, s in sides.items()}
    assert threads["1 rank"] == available_cores()
    assert threads["sp2"] == max(1, available_cores() // 2)
    assert sides["sp4 ep2"]["layout"]["resolved_expert_parallel_size"] == 2
    assert {s["numerics"]["blas_mode"] for s in sides.values()} == {"AUTO,STRICT"}
    assert job["status"] == "completed", job
    assert (job["video_sha256"], job["audio_sha256"]) == hashes["1 rank"]
