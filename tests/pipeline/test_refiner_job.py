"""The 1080p request path on the embedded tiny release with a small refiner size: the
refiner flags, the mp4 (4 (2T - 1) - 3 frames at twice the preview's fps, the preview's
audio), the sidecar's refiner record, and 1 rank / SP4 / SP2 x CFG2 giving the same
hashes (one spawn of 4 ranks runs both layouts)."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from headmoe.admission import admit
from headmoe.cli.generate import build_job
from headmoe.cli.main import build_parser, main
from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.errors import Refusal
from headmoe.models.magi2 import get_config
from headmoe.models.refiner import get_refiner_config
from headmoe.pipeline.deployment import Budget, Deployment
from headmoe.pipeline.interfaces import Refiner
from headmoe.pipeline.job import run_job, run_jobs
from headmoe.pipeline.media import read_mp4
from headmoe.pipeline.refine import RefinerStage
from headmoe.release import folder as release
from headmoe.testing import run_ranks

REQUEST = ["--height", "32", "--width", "48", "--num-frames", "9", "--num-inference-steps", "2",
           "--prompt", "a red fox running through snow at dusk", "--no-progress"]
REFINER = ["--refiner-height", "48", "--refiner-width", "64", "--refiner-steps", "3"]
LAYOUTS = (ParallelConfig(ulysses_degree=4),
           ParallelConfig(ulysses_degree=2, cfg_parallel_size=2))


def _job(tmp_path, cache, *flags):
    args = build_parser().parse_args(["generate", "--cache-dir", str(cache), "--output",
                                      str(tmp_path / "out.mp4"), *REQUEST, *flags])
    return build_job(args)[0]


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.mark.multirank
def test_layouts_write_the_same_refined_clip(tmp_path, cache):
    job = _job(tmp_path, cache, *REFINER)
    one = run_job(ParallelContext.single(job.parallel), job)
    side = json.loads((tmp_path / "out.json").read_text())
    frames, audio, fps, _ = read_mp4(tmp_path / "out.mp4")
    t_preview = side["latents"]["video"][0]
    assert t_preview == 3 and side["refiner"]["latent"] == [2 * t_preview - 1, 3, 4, 48]
    assert frames.shape == (4 * (2 * t_preview - 1) - 3, 48, 64, 3) and fps == 25.0
    assert side["media"]["fps"] == 25.0 and side["request"]["fps"] == 12.5
    steps = side["refiner"]["step_times_s"]["per_rank"]["0"]
    assert len(steps) == 3 and len(side["step_times_s"]["per_rank"]["0"]) == 2
    preview = run_job(ParallelContext.single(job.parallel),
                      dataclasses.replace(job, refiner=None, output=None))
    assert one["audio_sha256"] == preview["audio_sha256"]  # the preview's audio is kept
    assert one["video_sha256"] != preview["video_sha256"]
    assert audio.shape[0] == 2
    jobs = [dataclasses.replace(job, deployment=dataclasses.replace(job.deployment, parallel=p),
                                output=None) for p in LAYOUTS]
    per_rank = run_ranks(run_jobs, 4, args=(jobs,), timeout=300)
    hashes = {(r["video_sha256"], r["audio_sha256"]) for results in per_rank for r in results
              if r["video_sha256"] is not None}
    assert hashes == {(one["video_sha256"], one["audio_sha256"])}


def test_refiner_flags_are_checked_before_any_rank(tmp_path, cache, capsys):
    no_refiner = tmp_path / "MAGI-2-preview"
    shutil.copytree(release.tiny_release(cache), no_refiner, copy_function=os.link,
                    ignore=shutil.ignore_patterns(release.REFINER_DIR))
    for flags, words in (
        (["--refiner-height", "40"], "--refiner-height=40 must be a multiple of 16"),
        (["--refiner-steps", "0"], "--refiner-steps=0 must be an integer in [1, 1000]"),
        (["--model", str(no_refiner), "--refiner-height", "48"],
         f"--refiner-height=48 needs the refiner stage, which --model {no_refiner} (config "
         "MAGI-2-preview) does not run"),
    ):
        code = main(["generate", "--cache-dir", str(cache), "--output",
                     str(tmp_path / "o.mp4"), *REQUEST, *flags])
        assert code == 2
        assert words in capsys.readouterr().err
        assert not (tmp_path / "o.mp4").exists()


def test_1080p_preset_is_the_540p_preview_then_the_refiner():
    cfg = get_refiner_config("magi2-refiner")
    dep = Deployment(model_config=get_config("magi2-preview"), refiner_config=cfg)
    got = admit({"prompt": "a fox", "resolution": "1080p"}, dep)
    assert (got.request.height, got.request.width) == (512, 896)
    assert got.refiner == RefinerStage(1088, 1920, 5)
    assert got.refiner.latent_thw(got.shape.video_latent[0]) == (63, 68, 120)
    assert got.describe()["refiner"] == {"refiner_height": 1088, "refiner_width": 1920,
                                         "refiner_steps": 5}
    small = admit({"prompt": "a fox", "resolution": "1080p", "refiner_height": 544,
                   "refiner_width": 960, "refiner_steps": 3}, dep)
    assert small.refiner == RefinerStage(544, 960, 3)
    assert admit({"prompt": "a fox", "resolution": "540p"}, dep).refiner is None
    with pytest.raises(Refusal, match="resolution='1080p' needs the refiner stage"):
        admit({"prompt": "a fox", "resolution": "1080p"}, Deployment(model_config=get_config("magi2-preview")))
    with pytest.raises(Refusal, match="refiner_width=100 must be a multiple of 16"):
        admit({"prompt": "a fox", "refiner_width": 100}, dep)
    tight = dataclasses.replace(dep, budget=Budget(520 << 30, "test"))  # the preview fits
    with pytest.raises(Refusal, match="the refiner stage at 1920x1088"):
        admit({"prompt": "a fox", "resolution": "1080p"}, tight)


class _Recorder(torch.nn.Module):
    def __init__(self, name, log):
        super().__init__()
        self.name, self.log = name, log

    def to(self, device):  # records the move instead of making it (no GPU here)
        self.log.append((self.name, str(device)))
        return self


def test_offload_moves_the_idle_stage_to_the_host():
    """--offload on a GPU: the refiner comes to the device for its stage and the preview
    transformer waits on the host meanwhile, then both go back; on a CPU nothing moves."""
    log = []
    model, preview = _Recorder("refiner", log), _Recorder("preview", log)
    with Refiner(model, preview, torch.device("cuda", 0), offload=True).active() as m:
        assert m is model and log == [("preview", "cpu"), ("refiner", "cuda:0")]
    assert log[2:] == [("refiner", "cpu"), ("preview", "cuda:0")]
    log.clear()
    with Refiner(model, preview, torch.device("cpu"), offload=True).active():
        pass
    with Refiner(model, None, torch.device("cuda", 0), offload=False).active():
        pass
    assert log == []
