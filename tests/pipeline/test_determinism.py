"""The determinism contract at the output: the same request and seed give the same
video_sha256 / audio_sha256 on every supported layout (real tiny transformer)."""

import pytest
import torch

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.job import GenerateJob, run_job, run_jobs
from headmoe.pipeline.request import GenerateRequest
from headmoe.release.components import magi2_components, resolve_model
from headmoe.testing import run_ranks

# World 4 for every layout, so one spawn runs them all; "1 rank" is DP4 (each DP group of
# one rank runs the request alone, with seed + dp) and SP2 is SP2 x DP2.
LAYOUTS = {
    "1 rank (dp4)": ParallelConfig(data_parallel_size=4),
    "sp2 (x dp2)": ParallelConfig(ulysses_degree=2, data_parallel_size=2),
    "sp4": ParallelConfig(ulysses_degree=4),
    "sp2 x cfg2": ParallelConfig(ulysses_degree=2, cfg_parallel_size=2),
    "sp4 x ep2 ep_group": ParallelConfig(
        ulysses_degree=4,
        enable_expert_parallel=True,
        expert_parallel_size=2,
        moe_exchange="ep_group",
    ),
    "sp4 x ep2 sp_group": ParallelConfig(
        ulysses_degree=4,
        enable_expert_parallel=True,
        expert_parallel_size=2,
        moe_exchange="sp_group",
    ),
}
DTYPES = ("fp32", "bf16")


def _request(dtype, seed=3):
    return GenerateRequest(
        prompt="a fox in snow",
        negative_prompt="blurry",
        num_inference_steps=2,
        height=32,
        width=48,
        num_frames=5,
        seed=seed,
        dtype=dtype,
    )


def _jobs(cfg, ckpt):
    return [
        GenerateJob(deployment=Deployment(model_config=cfg, checkpoint=ckpt, parallel=par,
                                          timeout_s=120),
                    request=_request(dt), output=None, progress=False,
                    components=magi2_components)
        for dt in DTYPES
        for par in LAYOUTS.values()
    ]


def _all_layouts(rank, world_size, cfg, ckpt):
    return run_jobs(rank, world_size, _jobs(cfg, ckpt))


@pytest.mark.multirank
def test_same_bytes_on_every_layout(tmp_path):
    cfg, ckpt = resolve_model("tiny", tmp_path)
    per_rank = run_ranks(_all_layouts, 4, args=(cfg, ckpt), timeout=300)
    jobs = _jobs(cfg, ckpt)
    for dt in DTYPES:
        # the reference: one process, no process group at all
        ref = {}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # like the ranks (and fast on a loaded machine)
        try:
            for seed in (3, 4):
                job = GenerateJob(
                    deployment=Deployment(model_config=cfg, checkpoint=ckpt),
                    request=_request(dt, seed), output=None, progress=False,
                    components=magi2_components,
                )
                res = run_job(ParallelContext.single(), job)
                ref[seed] = (res["video_sha256"], res["audio_sha256"])
        finally:
            torch.set_num_threads(threads)
        assert ref[3] != ref[4]
        for j, job in enumerate(jobs):
            if job.request.dtype != dt:
                continue
            writers = {
                r["seed"]: (r["video_sha256"], r["audio_sha256"])
                for r in (per_rank[k][j] for k in range(4))
                if r["video_sha256"]
            }
            name = list(LAYOUTS)[j % len(LAYOUTS)]
            assert writers[3] == ref[3], (dt, name)
            if 4 in writers:  # DP group 1 runs seed + 1
                assert writers[4] == ref[4], (dt, name)
    fp32 = [per_rank[0][j]["video_sha256"] for j in range(len(LAYOUTS))]
    bf16 = [per_rank[0][j]["video_sha256"] for j in range(len(LAYOUTS), 2 * len(LAYOUTS))]
    assert fp32[0] != bf16[0]  # the dtype reaches the transformer
