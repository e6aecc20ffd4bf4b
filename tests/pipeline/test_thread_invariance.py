"""The thread count is a speed setting, never a numerics one (issue 26): the same request in
one process at 1, 2 and 3 torch threads gives the same latents, frames and audio
(`torch.equal`) on every stage of the embedded tiny release: text encoder, transformer and
sampler (text-to-video, fp32 and bf16), the image encoder (image-to-video), the 1080p
refiner stage, and both video decoders (TurboV3, Wan2.2) and the Oobleck audio decoder.
3 threads on a 2-core CI machine is deliberate: a count that is not the core count."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import headmoe.pipeline.job as job_module
from headmoe.cli.generate import build_job
from headmoe.cli.main import build_parser
from headmoe.distributed import ParallelContext
from headmoe.pipeline.job import run_job
from tests.goldens import golden_file

REQUEST = ["--num-inference-steps", "2", "--seed", "7", "--prompt",
           "a lighthouse blinking over a stormy sea", "--no-progress"]
IMAGE = str(golden_file("magi2_pipeline", "images/landscape_37x23.png"))
CASES = {
    "t2v turbo fp32": [],
    "t2v wan2.2 bf16": ["--video-decoder", "wan2.2", "--dtype", "bf16"],
    "i2v": ["--image", IMAGE],
    "refiner": ["--refiner-height", "48", "--refiner-width", "64", "--refiner-steps", "2"],
}
THREADS = (1, 2, 3)
#: the pipeline's decode step, wrapped (not re-wrapped) by every run
DECODE = job_module.decode


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


def _run(cache, tmp_path, flags: list[str], monkeypatch) -> dict[str, torch.Tensor]:
    """One request in this process; the latents entering the decoders and the media."""
    seen: dict[str, torch.Tensor] = {}

    def recording(parts, req, xv, xa, *rest):
        frames, audio = DECODE(parts, req, xv, xa, *rest)
        seen.update(video_latent=xv.clone(), audio_latent=xa.clone(), frames=frames,
                    audio=audio)
        return frames, audio

    monkeypatch.setattr(job_module, "decode", recording)
    args = build_parser().parse_args(["generate", "--cache-dir", str(cache), "--output",
                                      str(tmp_path / "unused.mp4"), *REQUEST, *flags])
    job = dataclasses.replace(build_job(args)[0], output=None)
    result = run_job(ParallelContext.single(job.parallel), job)
    assert result["video_sha256"] is not None and set(seen) == {
        "video_latent", "audio_latent", "frames", "audio"}
    return seen


@pytest.mark.parametrize("case", CASES)
def test_same_bytes_at_1_2_and_3_threads(case, cache, tmp_path, monkeypatch):
    before, runs = torch.get_num_threads(), []
    try:
        for threads in THREADS:
            torch.set_num_threads(threads)
            runs.append(_run(cache, tmp_path, CASES[case], monkeypatch))
            assert torch.get_num_threads() == threads  # components restore the caller's count
    finally:
        torch.set_num_threads(before)
    for threads, run in zip(THREADS[1:], runs[1:]):
        for key, ref in runs[0].items():
            assert torch.equal(run[key], ref), (case, key, threads)
