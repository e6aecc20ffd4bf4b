"""A real ``headmoe serve`` process on 127.0.0.1 for the tests, driven with httpx."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from headmoe.testing import spawned_rank_pids

HEADMOE = str(Path(sys.executable).with_name("headmoe"))
START_TIMEOUT_S = 180
REQUEST = {
    "prompt": "a red fox running through snow at dusk",
    "negative_prompt": "blur",
    "seed": 5,
    "num_inference_steps": 2,
    "guidance_scale": 4.0,
}
#: `REQUEST` with the refiner stage (the 1080p path) at a CPU-sized 64 x 96, 2 steps
REFINED = {**REQUEST, "refiner_height": 64, "refiner_width": 96, "refiner_steps": 2}


class Server:
    """``headmoe serve --port 0 ...`` in a subprocess; ``url`` once it listens."""

    def __init__(self, tmp: Path, cache: Path, *flags: str):
        self.output_dir = tmp / "videos"
        cmd = [HEADMOE, "serve", "--port", "0", "--cache-dir", str(cache), "--output-dir",
               str(self.output_dir), "--timeout", "60", *flags]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.out, self.err = bytearray(), bytearray()
        self._readers = [threading.Thread(target=self._drain, args=(s, b), daemon=True)
                         for s, b in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self._readers:
            t.start()
        deadline = time.monotonic() + START_TIMEOUT_S
        while not (m := re.search(rb"listening on (http://[\d.]+:\d+)", self.out)):
            assert self.proc.poll() is None, self.log()
            assert time.monotonic() < deadline, f"server did not start\n{self.log()}"
            time.sleep(0.05)
        self.url = m.group(1).decode()

    @staticmethod
    def _drain(stream, buf: bytearray) -> None:
        for chunk in iter(lambda: stream.read1(4096), b""):
            buf.extend(chunk)

    def log(self) -> str:
        return (self.out + self.err).decode(errors="replace")

    def tail(self, lines: int = 40) -> str:
        """The last ``lines`` lines of the server's stderr (for assertion messages)."""
        text = self.err.decode(errors="replace").splitlines()[-lines:]
        return "server stderr tail:\n" + "\n".join(text)

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> dict:
        """Poll ``GET /health`` until every replica's model is loaded; its body. The server
        answers 200 once replica 0 is in (it admits jobs then); the other replicas may
        still report ``"loading"`` for a moment, so this waits for none to."""
        deadline = time.monotonic() + timeout
        with self.client() as client:
            while (r := client.get("/health")).status_code != 200 or any(
                    rep["state"] == "loading" for rep in r.json().get("replicas", [])):
                assert self.proc.poll() is None, self.tail()
                assert time.monotonic() < deadline, f"not ready: {r.text}\n{self.tail()}"
                time.sleep(0.1)
        return r.json()

    def client(self, api_key: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=60)

    def worker_pids(self) -> list[int]:
        """The spawned rank processes, in start order (rank order)."""
        return spawned_rank_pids(self.proc.pid)

    def wait(self, timeout: float) -> int:
        code = self.proc.wait(timeout=timeout)
        for t in self._readers:
            t.join(timeout=5)
        return code

    def stop(self) -> None:
        """SIGTERM and wait; kill if it does not go (teardown)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def wait_for(client: httpx.Client, video_id: str, done, timeout: float = 120) -> dict:
    """Poll ``GET /v1/videos/{id}`` until ``done(job)``; the job."""
    deadline = time.monotonic() + timeout
    while True:
        job = client.get(f"/v1/videos/{video_id}").json()
        if done(job):
            return job
        assert time.monotonic() < deadline, f"timed out waiting on {json.dumps(job)}"
        time.sleep(0.05)


def finished(job: dict) -> bool:
    return job["status"] in ("completed", "failed", "cancelled")


def generate_samples_hashes(tmp: Path, cache: Path,
                            requests: list[dict]) -> list[tuple[str, str]]:
    """``headmoe generate --samples`` of ``requests`` (one model load, in this process):
    each request's (video_sha256, audio_sha256), in order."""
    from headmoe.cli.main import main

    samples = tmp / "samples.jsonl"
    samples.write_text("".join(json.dumps(r) + "\n" for r in requests))
    out = tmp / "samples.mp4"
    assert main(["generate", "--samples", str(samples), "--cache-dir", str(cache),
                 "--output", str(out), "--no-progress"]) == 0
    sides = [json.loads((tmp / f"samples.{n}.json").read_text())
             for n in range(1, len(requests) + 1)]
    return [(side["video_sha256"], side["audio_sha256"]) for side in sides]


def generate_hashes(tmp: Path, cache: Path, request: dict) -> tuple[str, str]:
    """``headmoe generate`` of ``request`` on one rank (in this process): its hashes."""
    from headmoe.cli.main import main

    out = tmp / "generate.mp4"
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in request.items()]
    assert main(["generate", *flags, "--cache-dir", str(cache), "--output", str(out),
                 "--no-progress"]) == 0
    side = json.loads(out.with_suffix(".json").read_text())
    return side["video_sha256"], side["audio_sha256"]
