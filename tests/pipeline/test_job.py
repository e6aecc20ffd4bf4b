"""Pipeline logic with a test-only denoiser: noise order, CFG paths, DP seeds, output."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

import headmoe.pipeline.job as job_module
from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.job import GenerateJob, output_path, run_job, run_jobs
from headmoe.pipeline.media import quantize_audio, read_mp4, tensor_sha256
from headmoe.pipeline.request import GenerateRequest
from headmoe.pipeline.sampler import UniPCSampler, cfg_combine, released_schedule
from headmoe.release.standins import ByteTextEncoder, TinyAudioDecoder, TinyVideoDecoder
from headmoe.testing import run_ranks
from tests.pipeline.fake import AUDIO_C, TEXT_C, VIDEO_C, fake_components, fake_velocity

REQ = GenerateRequest(prompt="a cat", negative_prompt="blur", num_inference_steps=3)


def _job(parallel=None, output=None, request=REQ):
    return GenerateJob(
        deployment=Deployment(model_config=None, parallel=parallel or ParallelConfig()),
        request=request,
        output=output,
        progress=False,
        components=fake_components,
    )


def _reference(req, seed):
    """The pipeline written out step by step from the spec (one process, no parallelism):
    the release's noise draw (video ``[1, C, T, H, W]`` first, then audio ``[1, L, C]``),
    the released schedule with the integer model time, UniPC per latent."""
    vdec, adec, enc = TinyVideoDecoder(VIDEO_C), TinyAudioDecoder(AUDIO_C), ByteTextEncoder(TEXT_C)
    torch.manual_seed(seed)  # the reference seeds the global generator
    xv = torch.randn(1, VIDEO_C, 4, 4, 6)[0].permute(1, 2, 3, 0)
    xa = torch.randn(1, 26, AUDIO_C)[0]
    tc, tu = enc.encode(req.prompt), enc.encode(req.negative_prompt)
    sched = released_schedule(req.num_inference_steps, req.shift)
    sv, sa = UniPCSampler(sched), UniPCSampler(sched)
    for i in range(req.num_inference_steps):
        s = float(sched.timesteps[i].float() / 1000)
        v = cfg_combine(fake_velocity(xv, tc, s), fake_velocity(xv, tu, s), req.guidance_scale)
        a = cfg_combine(
            fake_velocity(xa, tc, s), fake_velocity(xa, tu, s), req.audio_guidance_scale
        )
        xv, xa = sv.step(i, xv, v), sa.step(i, xa, a)
    frames = vdec.decode(xv, req.num_frames)
    audio = quantize_audio(adec.decode(xa, 45864))
    return tensor_sha256(frames), tensor_sha256(audio)


def test_single_rank_matches_reference_and_writes_outputs(tmp_path):
    out = tmp_path / "clip.mp4"
    res = run_job(ParallelContext.single(), _job(output=str(out)))
    assert (res["video_sha256"], res["audio_sha256"]) == _reference(REQ, 0)
    video, wave, fps, rate = read_mp4(out)
    assert video.shape == (13, 64, 96, 3) and fps == 12.5 and rate == 44100
    side = json.loads((tmp_path / "clip.json").read_text())
    assert side["video_sha256"] == res["video_sha256"] and side["request"]["prompt"] == "a cat"
    assert len(side["step_times_s"]["per_rank"]["0"]) == 3
    assert side["step_times_s"]["max"] == side["step_times_s"]["per_rank"]["0"]
    assert side["total_s"] >= sum(side["step_times_s"]["max"])
    assert side["layout"]["ulysses_degree"] == 1 and side["counters"]["0"]["moe_calls"] == 0
    assert side["layout"]["cuda_graphs"] is False  # --cuda-graphs: off by default
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clip.json", "clip.mp4"]


def test_seed_changes_the_output():
    assert _reference(REQ, 0)[0] != _reference(REQ, 1)[0]


def test_noise_is_drawn_as_the_release_draws_it():
    torch.manual_seed(7)
    video, audio = torch.randn(1, VIDEO_C, 4, 4, 6), torch.randn(1, 26, AUDIO_C)
    req = GenerateRequest(prompt="a cat", seed=7)
    parts = fake_components(None, None)
    noise = job_module.draw_noise(ParallelContext.single(), req, parts)
    assert torch.equal(noise.video, video[0].permute(1, 2, 3, 0))
    assert torch.equal(noise.audio, audio[0]) and noise.seed == 7


def test_ranks_with_other_noise_are_named():
    job_module.check_same_noise([(0, "a"), (0, "a"), (1, "b"), (1, "b")], "cuda")
    with pytest.raises(ValueError, match="rank 3 drew other noise than rank 2 of the same"):
        job_module.check_same_noise([(0, "a"), (0, "a"), (1, "b"), (1, "c")], "cuda")


def test_cuda_noise_needs_a_cuda_rank():
    req = GenerateRequest(prompt="a cat", noise_device="cuda")
    with pytest.raises(ValueError, match="noise_device='cuda' needs ranks on CUDA devices"):
        job_module.draw_noise(ParallelContext.single(), req, fake_components(None, None))


def test_output_path_per_dp_group():
    assert str(output_path("a/demo.mp4", 0, 1)) == "a/demo.mp4"
    assert str(output_path("a/demo.mp4", 1, 2)) == "a/demo.dp1.mp4"


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"height": 0}, "height"),
        ({"fps": 0.0}, "fps"),
        ({"sampler": "ddim"}, "sampler"),
        ({"sampler": "euler"}, "sampler"),
        ({"noise_device": "gpu"}, "noise_device"),
        ({"dtype": "fp16"}, "dtype"),
        ({"seed": -1}, "seed"),
        ({"num_inference_steps": 0}, "num_inference_steps"),
    ],
)
def test_request_rejects(kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        GenerateRequest(prompt="x", **kwargs)


LAYOUTS = {
    "dp4": ParallelConfig(data_parallel_size=4),
    "sp2_dp2": ParallelConfig(ulysses_degree=2, data_parallel_size=2),
    "sp4": ParallelConfig(ulysses_degree=4),
    "sp2_cfg2": ParallelConfig(ulysses_degree=2, cfg_parallel_size=2),
}


def _fake_layouts(rank, world_size, out_dir):
    jobs = [_job(p) for p in LAYOUTS.values()]
    jobs.append(_job(LAYOUTS["sp2_dp2"], output=f"{out_dir}/dp.mp4"))
    return run_jobs(rank, world_size, jobs)


@pytest.mark.multirank
def test_layouts_with_fake_denoiser(tmp_path):
    per_rank = run_ranks(_fake_layouts, 4, args=(str(tmp_path),), timeout=300)
    ref = [_reference(REQ, s) for s in range(4)]
    for j, name in enumerate(LAYOUTS):
        writers = {
            r["dp_index"]: (r["video_sha256"], r["audio_sha256"])
            for r in (per_rank[k][j] for k in range(4))
            if r["video_sha256"]
        }
        dp = LAYOUTS[name].data_parallel_size
        assert writers == {k: ref[k] for k in range(dp)}, name  # DP group k uses seed + k
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["dp.dp0.json", "dp.dp0.mp4", "dp.dp1.json", "dp.dp1.mp4"]
    side = json.loads((tmp_path / "dp.dp1.json").read_text())
    assert side["seed"] == 1 and side["layout"]["ranks"] == [2, 3]
    assert sorted(side["step_times_s"]["per_rank"]) == ["2", "3"]
    assert side["video_sha256"] == ref[1][0]


def test_audio_samples_of_a_clip():
    assert REQ.audio_samples(44100) == round(13 / 12.5 * 44100) == 45864
    with pytest.raises(ValueError, match=r"fps=1000000.0 must be a number in \[1, 120\]"):
        GenerateRequest(prompt="x", num_frames=1, fps=1e6)  # a clip under one sample
    assert GenerateRequest(prompt="x", num_frames=1, fps=120.0).audio_samples(44100) == 368


@pytest.mark.parametrize("timeout", [0, -1.0, 0.001, float("inf"), True, "60"])
def test_job_rejects_bad_timeout(timeout):
    with pytest.raises(ValueError, match=f"timeout.* (must be a positive finite number|must be "
                                         rf"at least 1 s .*), got {timeout!r}"):
        Deployment(model_config=None, timeout_s=timeout)


def test_a_job_without_a_component_factory_is_refused_before_it_runs():
    job = replace(_job(), components=None)
    with pytest.raises(ValueError, match="job.components is None: a job that runs needs a "
                                         "component factory"):
        run_job(ParallelContext.single(), job)


def test_the_job_imports_no_component_factory():
    """The factory is passed in (`GenerateJob.components`): importing the job loads none of
    the release's component code."""
    code = ("import sys, headmoe.pipeline.job; "
            "print(sorted(m for m in sys.modules if m.startswith('headmoe.release.comp')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120)
    assert out.stdout.strip() == "[]", out.stdout

def test_failed_sidecar_leaves_no_outputs(tmp_path, monkeypatch):
    out = tmp_path / "x.mp4"
    run_job(ParallelContext.single(), _job(output=str(out)))  # an earlier run's two files
    assert out.exists() and out.with_suffix(".json").exists()

    def broken(path, data, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(job_module, "write_sidecar", broken)
    with pytest.raises(OSError, match="disk full"):  # --overwrite: the old pair goes too
        run_job(ParallelContext.single(), replace(_job(output=str(out)), overwrite=True))
    assert sorted(p.name for p in tmp_path.iterdir()) == []
