"""Streamed and resident runs of the embedded release write the same bytes (issue 20): one
rank, SP4+EP2 with both MoE exchanges, and SP2 x CFG2, in one 4-rank spawn; every rank
moves the planner's bytes per step (EP ranks: their own expert rows) and every counter is
`compare`'s prediction; and the refiner's layers streamed on SP2 x CFG2 give the resident
refined clip."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from headmoe.cli.compare import predicted_summary
from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.distributed.topology import plan_topology
from headmoe.pipeline.deployment import Deployment
from headmoe.pipeline.job import GenerateJob, run_job, run_jobs
from headmoe.pipeline.refine import RefinerStage
from headmoe.pipeline.request import GenerateRequest
from headmoe.planner.memory import StreamSettings, stream_estimate
from headmoe.release import folder as release
from headmoe.release.components import magi2_components

STEPS = 2
EP2 = {"ulysses_degree": 4, "enable_expert_parallel": True, "expert_parallel_size": 2}
#: (name, layout, resident layers); every rank of every layout streams its own shard
LAYOUTS = [
    ("1 rank (dp4)", ParallelConfig(data_parallel_size=4), 0),
    ("sp4 x ep2 ep_group", ParallelConfig(**EP2, moe_exchange="ep_group"), 1),
    ("sp4 x ep2 sp_group", ParallelConfig(**EP2, moe_exchange="sp_group"), 0),
    ("sp2 x cfg2", ParallelConfig(ulysses_degree=2, cfg_parallel_size=2), 2),
]
SP2CFG2 = LAYOUTS[-1][1]


def _job(found, parallel, offload, resident=0, output=None):
    req = GenerateRequest(prompt="a red fox running through snow at dusk", height=32, width=48,
                          num_frames=5, num_inference_steps=STEPS, seed=5, dtype="bf16")
    model = dataclasses.replace(found.model_config, name="tiny")  # as generate names it
    dep = Deployment(model_config=model, checkpoint=found.transformer, release=found,
                     parallel=parallel, timeout_s=120, offload_layers=offload,
                     resident_layers=resident)
    return GenerateJob(deployment=dep, request=req, output=output, progress=False,
                       components=magi2_components)


def _refined(found, parallel, offload):
    """The 1080p path at a tiny size: the preview, then the refiner (with `offload` the
    refiner's layers stream too)."""
    return dataclasses.replace(_job(found, parallel, offload), refiner=RefinerStage(48, 64, 3))


def _streamed(rank, world_size, folder, out):
    found = release.find_release(folder)
    jobs = [_job(found, p, True, n, f"{out}/{j}.mp4") for j, (_, p, n) in enumerate(LAYOUTS)]
    return run_jobs(rank, world_size, [*jobs, _refined(found, SP2CFG2, True)])


@pytest.mark.multirank
def test_streamed_runs_write_the_resident_bytes(tmp_path, tiny_release_in):
    from headmoe.testing import run_ranks

    folder = tiny_release_in(tmp_path)
    per_rank = run_ranks(_streamed, 4, args=(str(folder), str(tmp_path)), timeout=600)
    found = release.find_release(folder)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # like the ranks
    try:
        res = run_job(ParallelContext.single(), _job(found, ParallelConfig(), False))
        refined = run_job(ParallelContext.single(), _refined(found, ParallelConfig(), False))
    finally:
        torch.set_num_threads(threads)
    want = (res["video_sha256"], res["audio_sha256"])
    got = {(r[-1]["video_sha256"], r[-1]["audio_sha256"]) for r in per_rank if r[-1]["video_sha256"]}
    assert got == {(refined["video_sha256"], refined["audio_sha256"])}  # the refiner streamed
    assert refined["video_sha256"] != res["video_sha256"]
    for j, (name, _, _) in enumerate(LAYOUTS):
        writers = [r[j] for r in per_rank if r[j]["video_sha256"] and r[j]["seed"] == 5]
        assert writers, name
        for w in writers:
            assert (w["video_sha256"], w["audio_sha256"]) == want, name
        _check_bytes_moved(found.model_config, j, tmp_path)


def _check_bytes_moved(model, j, folder):
    """Every rank moved the planner's bytes per step, each step (its own EP shard only),
    as its sidecar's counters say."""
    name, parallel, resident = LAYOUTS[j]
    ep = parallel.resolved_expert_parallel_size()
    topo = plan_topology(parallel.world_size, parallel)
    ranks = set()
    for side in folder.glob(f"{j}*.json"):
        side_data = json.loads(side.read_text())
        for rank, counters in side_data["counters"].items():
            est = stream_estimate(model, ep, topo.coords(int(rank)).ep, torch.bfloat16,
                                  StreamSettings(resident))
            assert counters["streamed_bytes"] == STEPS * est.bytes_per_step > 0, (name, rank)
            # and `compare`'s prediction of every counter (rows, exchanges, streamed bytes)
            assert predicted_summary(side_data, parallel, int(rank)) == counters, (name, rank)
            ranks.add(rank)
    assert ranks == {"0", "1", "2", "3"}, name
