import torch
import torch.distributed as dist

from headmoe.config import ParallelConfig
from headmoe.distributed import ParallelContext
from headmoe.testing import run_ranks


def _a2a(rank, world_size):
    ctx = ParallelContext.initialize(
        ParallelConfig(ulysses_degree=4, enable_expert_parallel=True, expert_parallel_size=2)
    )
    g = ctx.group("ep")
    x = torch.full((2,), float(rank))
    y = torch.empty(2)
    dist.all_to_all_single(y, x, group=g)
    ctx.destroy()
    return y.tolist()


def test_smoke():
    out = run_ranks(_a2a, 4, timeout=60)
    assert out == [[0.0, 1.0], [0.0, 1.0], [2.0, 3.0], [2.0, 3.0]]
