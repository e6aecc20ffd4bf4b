"""Streamed and resident runs of the embedded release write the same bytes (issue 20): one
rank, SP4+EP2 with both MoE exchanges, and SP2 x CFG2, in one 4-rank spawn."""

from __future__ import annotations

import pytest
import torch

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.pipeline.job import GenerateJob, run_job, run_jobs
from headmoe.pipeline.request import GenerateRequest
from headmoe.release import folder as release

EP2 = {"ulysses_degree": 4, "enable_expert_parallel": True, "expert_parallel_size": 2}
#: (name, layout, resident layers); every rank of every layout streams its own shard
LAYOUTS = [
    ("1 rank (dp4)", ParallelConfig(data_parallel_size=4), 0),
    ("sp4 x ep2 ep_group", ParallelConfig(**EP2, moe_exchange="ep_group"), 1),
    ("sp4 x ep2 sp_group", ParallelConfig(**EP2, moe_exchange="sp_group"), 0),
    ("sp2 x cfg2", ParallelConfig(ulysses_degree=2, cfg_parallel_size=2), 2),
]


def _job(found, parallel, offload, resident=0):
    req = GenerateRequest(prompt="a red fox running through snow at dusk", height=32, width=48,
                          num_frames=5, num_inference_steps=2, seed=5, dtype="bf16")
    return GenerateJob(req, parallel, found.model_config, found.transformer, None,
                       timeout_s=120, progress=False, release=found, offload_layers=offload,
                       resident_layers=resident)


def _streamed(rank, world_size, folder):
    found = release.find_release(folder)
    return run_jobs(rank, world_size, [_job(found, p, True, n) for _, p, n in LAYOUTS])


@pytest.mark.multirank
def test_streamed_runs_write_the_resident_bytes(tmp_path):
    from headmoe.testing import run_ranks

    folder = release.tiny_release(tmp_path)
    per_rank = run_ranks(_streamed, 4, args=(str(folder),), timeout=600)
    found = release.find_release(folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the ranks
    try:
        res = run_job(ParallelContext.single(), _job(found, ParallelConfig(), False))
    finally:
        torch.set_num_threads(threads)
    want = (res["video_sha256"], res["audio_sha256"])
    for j, (name, _, _) in enumerate(LAYOUTS):
        writers = [r[j] for r in per_rank if r[j]["video_sha256"] and r[j]["seed"] == 5]
        assert writers, name
        for w in writers:
            assert (w["video_sha256"], w["audio_sha256"]) == want, name
